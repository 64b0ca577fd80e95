"""Tensor parallelism on CPU (gloo): TP=N greedy output equals TP=1 token for
token, bad sizes fail before any process starts, a dead worker is a clear
error instead of a hang, and workers stop when the engine closes.

Only one TP engine may live in a process (the default torch.distributed group
is the TP group), and a TP=1 engine must not run while one does: every test
builds its references first and closes its TP engine before returning."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import nanoinfer
from nanoinfer import LLM, SamplingParams
from nanoinfer.distributed.channel import HEAD_BYTES, BroadcastChannel
from nanoinfer.distributed.driver import WorkerDiedError
from nanoinfer.engine.core import EngineDeadError
from nanoinfer.layers import embedding as embedding_module
from nanoinfer.layers import linear as linear_module
from nanoinfer.loader.weights import get_hf_config, load_model

SMALL_KV = 64 << 20


def greedy(n: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, min_tokens=n, **kw)


def tiny_prompts() -> list[list[int]]:
    shared = [(11 * j + 5) % 256 for j in range(24)]  # a shared prefix: prefix-cache hits under TP too
    return [shared + [(13 * i + j) % 256 for j in range(4 + 4 * i)] for i in range(6)]


# 24 blocks of 4 tokens for six requests of up to 64 tokens: preemption (resent requests), and
# chunked prefill (16-token budget) — the deltas the workers must follow.
PRESSURE = dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=16)


def run_tiny(llm: LLM) -> tuple[list[list[int]], list[list[float]], list[list[float]]]:
    """Greedy tokens and their logprobs; then two prompts' own logprobs (prompt_logprobs: the LM head on every
    prompt position, gathered across the ranks)."""
    outs = llm.generate(tiny_prompts(), greedy(logprobs=1), use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
    scored = llm.generate(tiny_prompts()[:2], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    prompt_logprobs = [[lp[t].logprob for t, lp in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])] for o in scored]
    return tokens, logprobs, prompt_logprobs


@pytest.fixture(scope="module")
def tiny_qwen3(tiny_models) -> str:
    return tiny_models["qwen3"]  # 4 query heads, 2 KV heads: 2 and 1 per rank at TP=2


@pytest.fixture(scope="module")
def tiny_reference(tiny_qwen3) -> tuple[list[list[int]], list[list[float]]]:
    return run_tiny(LLM(tiny_qwen3, device="cpu", **PRESSURE))


@pytest.fixture(autouse=True)
def no_leftover_group():
    yield
    assert not dist.is_initialized(), "a test left its tensor-parallel engine open"


def test_tp_size_that_does_not_divide_heads_fails_before_starting_workers() -> None:
    # SmolLM2-135M: 9 query heads, 3 KV heads.
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide this model's "
                                         r"num_attention_heads=9, num_key_value_heads=3; "
                                         r"valid tensor-parallel sizes: \[1, 3\]"):
        LLM(device="cpu", tensor_parallel_size=2)
    assert multiprocessing.active_children() == []


def test_dummy_weights_are_the_same_model_for_every_tp_size(tmp_path, monkeypatch) -> None:
    """Each rank's dummy shard is exactly its slice of the TP=1 dummy model (ranks simulated in-process:
    loading does no communication). The vocabulary (255) does not split evenly: the last row pads."""
    from transformers import Qwen3Config

    Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, vocab_size=255, architectures=["Qwen3ForCausalLM"]).save_pretrained(tmp_path)
    hf_config = get_hf_config(tmp_path)
    load = lambda: dict(load_model(None, hf_config, "dummy", torch.float32, "cpu").named_parameters())  # noqa: E731
    full = load()
    for rank in range(2):
        for module in (linear_module, embedding_module):
            monkeypatch.setattr(module, "tp_rank", lambda r=rank: r)
            monkeypatch.setattr(module, "tp_world_size", lambda: 2)
        shard = load()

        def rows(name: str, *sizes: int) -> torch.Tensor:
            """This rank's half of each fused part (q, k, v or gate, up), back to back."""
            parts = full[name].split(sizes)
            return torch.cat([part[rank * s // 2 : (rank + 1) * s // 2] for part, s in zip(parts, sizes)])

        def columns(name: str) -> torch.Tensor:
            half = full[name].shape[1] // 2
            return full[name][:, rank * half : (rank + 1) * half]

        layer = "model.layers.0."
        assert torch.equal(shard[layer + "self_attn.qkv_proj.weight"], rows(layer + "self_attn.qkv_proj.weight", 64, 32, 32))
        assert torch.equal(shard[layer + "mlp.gate_up_proj.weight"], rows(layer + "mlp.gate_up_proj.weight", 128, 128))
        assert torch.equal(shard[layer + "self_attn.o_proj.weight"], columns(layer + "self_attn.o_proj.weight"))
        assert torch.equal(shard[layer + "mlp.down_proj.weight"], columns(layer + "mlp.down_proj.weight"))
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            real = full[name][rank * 128 : (rank + 1) * 128]
            assert torch.equal(shard[name][: len(real)], real) and not shard[name][len(real) :].any()
        for name in (layer + "input_layernorm.weight", layer + "self_attn.q_norm.weight", "model.norm.weight"):
            assert torch.equal(shard[name], full[name])
    assert not torch.equal(full["model.embed_tokens.weight"], full["lm_head.weight"])  # per-name seeds


def test_a_tensor_parallel_engine_lives_alone_in_its_process(tiny_qwen3) -> None:
    """torch.distributed keeps one process group per process, and every model of the process reads it: beside a TP
    engine another engine's steps went into the group's collectives and hung. Refused either way, until the
    other engine is closed."""
    single = LLM(tiny_qwen3, device="cpu", num_kv_blocks=32)
    with pytest.raises(RuntimeError, match="another engine runs in this process"):
        LLM(tiny_qwen3, device="cpu", tensor_parallel_size=2, num_kv_blocks=32)
    assert not dist.is_initialized()
    single.close()
    parallel = LLM(tiny_qwen3, device="cpu", tensor_parallel_size=2, num_kv_blocks=32)
    try:
        with pytest.raises(RuntimeError, match="a tensor-parallel engine runs in this process"):
            LLM(tiny_qwen3, device="cpu", num_kv_blocks=32)
        out = parallel.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
    finally:
        parallel.close()
    assert LLM(tiny_qwen3, device="cpu", num_kv_blocks=32).generate([[1, 2, 3]], SamplingParams(max_tokens=2),
                                                                   use_tqdm=False)


def test_a_script_without_a_main_guard_is_told_why_its_worker_died(tiny_qwen3, tmp_path) -> None:
    """The spawn start method imports the script again in each worker; without an `if __name__ == "__main__":`
    guard the worker dies starting, and the error says so (it said only that the worker exited)."""
    script = tmp_path / "unguarded.py"
    script.write_text(f"from nanoinfer import LLM\nLLM({tiny_qwen3!r}, device='cpu', tensor_parallel_size=2, "
                      f"num_kv_blocks=32)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env=os.environ | {"PYTHONPATH": str(Path(nanoinfer.__file__).parent.parent)})
    assert proc.returncode != 0 and "WorkerDiedError" in proc.stderr, proc.stderr[-2000:]
    assert 'lacks an `if __name__ == "__main__":` guard' in proc.stderr


def test_tp_workers_load_the_commit_a_hub_name_resolved_to(tiny_qwen3, tmp_path, monkeypatch) -> None:
    """A Hub name is resolved once, by rank 0: the workers get its commit as the revision (they looked the name up
    again, and would load another commit had the branch moved meanwhile: here it moves to one the cache lacks right
    after rank 0's lookup, so a worker that looked it up again would die)."""
    from nanoinfer.loader import resolve
    from test_offline_api import fake_hub_cache

    cache = fake_hub_cache(tmp_path, "org/tiny", tiny_qwen3, "2" * 40)
    looked_up = resolve.local_path

    def then_the_branch_moves(*args, **kwargs):
        folder = looked_up(*args, **kwargs)
        (Path(cache) / "models--org--tiny" / "refs" / "main").write_text("3" * 40)
        return folder

    monkeypatch.setattr(resolve, "local_path", then_the_branch_moves)
    parallel = LLM("org/tiny", download_dir=cache, device="cpu", tensor_parallel_size=2, num_kv_blocks=32)
    try:
        assert parallel.llm_engine.core.source.hub_revisions == {"revision": "2" * 40}
        out = parallel.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                                use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
    finally:
        parallel.close()


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_tp2_equals_tp1_on_tiny_qwen3(tiny_qwen3, tiny_reference, async_scheduling: bool) -> None:
    """Async: workers feed each step's tokens from rank 0's broadcast before any host list has them."""
    llm = LLM(tiny_qwen3, device="cpu", tensor_parallel_size=2, async_scheduling=async_scheduling, **PRESSURE)
    try:
        assert llm.llm_engine.core.async_scheduling is async_scheduling
        tokens, logprobs, prompt_logprobs = run_tiny(llm)
        assert tokens == tiny_reference[0]
        assert llm.llm_engine.core.scheduler.num_preemptions > 0
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(tiny_reference[1]), atol=1e-4)
        for ours, ref in zip(prompt_logprobs, tiny_reference[2]):
            assert torch.allclose(torch.tensor(ours), torch.tensor(ref), atol=1e-4)
        again, _, _ = run_tiny(llm)  # every prompt now hits the prefix cache (on every rank's KV)
        assert again == tiny_reference[0]
        assert llm.llm_engine.core.scheduler.kv_cache_manager.prefix_hits > 0
        worker = llm.llm_engine.core.tp_driver.workers.processes[0]
    finally:
        llm.close()
    assert worker.exitcode == 0  # told to stop, it left its loop cleanly


def test_tp2_speculative_decoding_equals_tp1(tiny_qwen3, tiny_reference) -> None:
    """Workers follow the drafts in each step's delta and get every kept token with the next one."""
    spec = {"num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    llm = LLM(tiny_qwen3, device="cpu", tensor_parallel_size=2, speculative_config=spec, **PRESSURE)
    try:
        tokens, logprobs, _ = run_tiny(llm)
        assert tokens == tiny_reference[0]
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(tiny_reference[1]), atol=1e-4)
        assert llm.llm_engine.core.stats().spec_decode_num_accepted_tokens > 0
    finally:
        llm.close()


def test_tp2_serves_lora_adapters_as_tp1(tiny_qwen3, tmp_path) -> None:
    """Column-parallel layers hold their B shard (A whole, folded with the norm), row-parallel ones their A shard
    (the all-reduce sums the parts); one slot, so adapters take turns and every rank reloads it alike."""
    from test_lora import make_adapter, perturbed

    base = perturbed(tiny_qwen3, tmp_path / "base")
    a = make_adapter(tmp_path / "a", base, seed=1)
    b = make_adapter(tmp_path / "b", base, seed=2, rank=8, modules=("q_proj", "o_proj", "down_proj"))
    loras = [nanoinfer.LoRARequest("a", 1, a), None, nanoinfer.LoRARequest("b", 2, b)] * 2
    kwargs = dict(device="cpu", enable_lora=True, max_loras=1, max_lora_rank=8, **PRESSURE)
    single = LLM(base, **kwargs)
    reference = [o.outputs[0].token_ids for o in single.generate(tiny_prompts(), greedy(), use_tqdm=False,
                                                                 lora_request=loras)]
    plain = [o.outputs[0].token_ids for o in single.generate(tiny_prompts(), greedy(), use_tqdm=False)]
    single.close()
    assert all((ours == theirs) == (lora is None) for ours, theirs, lora in zip(reference, plain, loras))
    llm = LLM(base, tensor_parallel_size=2, **kwargs)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(tiny_prompts(), greedy(), use_tqdm=False,
                                                              lora_request=loras)] == reference
    finally:
        llm.close()


def test_tp3_equals_tp1_on_smollm2() -> None:
    """The embedded GGUF (converted folder): 9/3 heads split three ways."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    reference = [o.outputs[0].token_ids for o in LLM(device="cpu").generate(prompts, greedy(), use_tqdm=False)]
    llm = LLM(device="cpu", tensor_parallel_size=3, kv_cache_memory_bytes=SMALL_KV)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)] == reference
    finally:
        llm.close()


def test_killed_worker_is_a_clear_error_not_a_hang(tiny_qwen3) -> None:
    llm = LLM(tiny_qwen3, device="cpu", tensor_parallel_size=2, kv_cache_memory_bytes=SMALL_KV)
    try:
        worker = llm.llm_engine.core.tp_driver.workers.processes[0]
        llm.llm_engine.add_request("r", list(range(1, 30)), greedy(400))
        for _ in range(3):
            llm.llm_engine.step()
        os.kill(worker.pid, signal.SIGKILL)  # the next step is most likely mid-collective when it notices
        errors: list[BaseException] = []

        def run() -> None:
            try:
                while llm.llm_engine.has_unfinished_requests():
                    llm.llm_engine.step()
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(60)
        assert not thread.is_alive(), "the engine hung after its worker died"
        assert len(errors) == 1 and isinstance(errors[0], WorkerDiedError), errors
        assert f"tensor-parallel worker rank 1 (pid {worker.pid}) was killed by SIGKILL" in str(errors[0])
        with pytest.raises(EngineDeadError, match=r"after a step failed \(WorkerDiedError: tensor-parallel worker rank 1"):
            llm.llm_engine.step()
    finally:
        llm.close()


class _Event:
    """Stands in for a CUDA event of a launched step: done, or (a GPU spinning in an all-reduce
    whose peer died) never."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_waiting_for_a_step_watches_the_workers(tiny_qwen3) -> None:
    """Rank 0 waits for a step's tokens by polling its event and checking the workers: if one dies
    while rank 0's GPU spins in a symmetric-memory all-reduce (which no NCCL timeout ends), the
    wait ends in WorkerDiedError instead of blocking in CUDA for ever."""
    llm = LLM(tiny_qwen3, device="cpu", tensor_parallel_size=2, kv_cache_memory_bytes=SMALL_KV)
    try:
        driver = llm.llm_engine.core.tp_driver
        llm.llm_engine.add_request("r", list(range(1, 30)), greedy(4))
        llm.llm_engine.step()
        wait = driver._unsent[-1].wait_for_device  # what the step's future waits with
        wait(_Event(True))  # a finished step: returns at once
        worker = driver.workers.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=f"rank 1 \\(pid {worker.pid}\\) was killed by SIGKILL"):
            wait(_Event(False))
        assert time.monotonic() - start < 30
    finally:
        llm.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_workers_launched_by_hand_join_through_env_rendezvous(tiny_qwen3, tiny_reference, monkeypatch) -> None:
    """The launch across hosts, on one host: `python -m nanoinfer.distributed.worker` as rank 1, the engine
    as rank 0, both through MASTER_ADDR/MASTER_PORT. Garbage-collecting the engine stops the worker."""
    rendezvous = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2")
    repo = str(Path(nanoinfer.__file__).parents[1])
    env = dict(os.environ, **rendezvous, RANK="1", LOCAL_RANK="0",
               PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    worker = subprocess.Popen([sys.executable, "-m", "nanoinfer.distributed.worker"], env=env)
    try:
        for name, value in dict(rendezvous, RANK="0").items():
            monkeypatch.setenv(name, value)
        llm = LLM(tiny_qwen3, device="cpu", tensor_parallel_size=2, **PRESSURE)
        assert llm.llm_engine.core.tp_driver.workers.processes == []  # nothing spawned
        assert run_tiny(llm)[0] == tiny_reference[0]
        del llm
        gc.collect()
        assert worker.wait(timeout=60) == 0
    finally:
        if worker.poll() is None:
            worker.kill()


def test_worker_module_needs_the_env_rendezvous() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(Path(nanoinfer.__file__).parents[1])
    done = subprocess.run([sys.executable, "-m", "nanoinfer.distributed.worker"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "set MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE" in done.stderr


def test_a_stuck_group_teardown_does_not_hang_the_shutdown(monkeypatch, caplog) -> None:
    """If leaving the process group never returns (a stuck NCCL abort), closing gives up after its
    timeout with a logged error instead of hanging the engine's shutdown."""
    from nanoinfer.distributed import parallel_state

    release = threading.Event()
    monkeypatch.setattr(parallel_state, "_leave_groups", lambda uses_nccl: release.wait())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.destroy_tensor_parallel(timeout_s=0.2)
        assert "did not finish within" in caplog.text
    finally:
        release.set()
        dist.destroy_process_group()
    assert not dist.is_initialized()


def test_group_is_left_at_interpreter_exit_where_no_thread_can_start(monkeypatch) -> None:
    """From Python 3.12 an atexit handler (the engine's finalizer) cannot start a thread: leaving
    then happens in the calling thread."""
    from nanoinfer.distributed import parallel_state

    def no_threads(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", no_threads)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.destroy_tensor_parallel(timeout_s=0.2)
    assert not dist.is_initialized()


CHANNEL_MESSAGES = [None, {"step": 1}, *(b"x" * n for n in (HEAD_BYTES - 9, HEAD_BYTES - 8, HEAD_BYTES, 100_000))]


def _receive_channel_messages(rank: int, port: int, results) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        channel = BroadcastChannel(dist.group.WORLD)
        results.put([channel.recv() for _ in CHANNEL_MESSAGES])
    finally:
        dist.destroy_process_group()


def test_broadcast_channel_round_trips_messages_of_every_size() -> None:
    """Messages shorter than, exactly at, and longer than the one-broadcast head arrive intact and in order."""
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    receiver = context.Process(target=_receive_channel_messages, args=(1, store.port, results))
    receiver.start()
    dist.init_process_group("gloo", store=store, rank=0, world_size=2)
    try:
        channel = BroadcastChannel(dist.group.WORLD)
        for message in CHANNEL_MESSAGES:
            channel.send(message)
        assert results.get(timeout=60) == CHANNEL_MESSAGES
    finally:
        dist.destroy_process_group()
        receiver.join(30)


def test_symmetric_all_reduce_stays_off_without_nccl() -> None:
    """Symmetric memory is for GPU ranks on NCCL: with no group, or a gloo (CPU) group, it stays
    off and all-reduces keep their gloo path (the sum is `x` itself, reduced in place)."""
    from nanoinfer.distributed import parallel_state

    x = torch.arange(8.0)
    assert parallel_state.enable_symmetric_all_reduce(4, 256, torch.float32) is False
    assert parallel_state.tp_all_reduce(x) is x
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert parallel_state.enable_symmetric_all_reduce(4, 256, torch.float32) is False
        assert parallel_state.fused_all_reduce() is None
        assert torch.equal(parallel_state.tp_all_reduce(x), torch.arange(8.0))
    finally:
        dist.destroy_process_group()


def test_tp2_follows_grammars_as_tp1(tmp_path_factory, smollm2_path) -> None:
    """Structured outputs: rank 0 masks the gathered logits by each request's grammar before it samples."""
    import re

    from test_server import tiny_model_with_smollm2_vocab

    from nanoinfer import StructuredOutputsParams

    model = tiny_model_with_smollm2_vocab(tmp_path_factory)  # 4 / 2 heads, SmolLM2's vocabulary and tokenizer
    params = SamplingParams(temperature=0, max_tokens=12,
                            structured_outputs=StructuredOutputsParams(regex="[a-c]{3}( [0-9]{2})?"))
    prompts = ["one", "two words", "three words here"]
    reference = [o.outputs[0].text for o in LLM(model, tokenizer=smollm2_path, device="cpu",
                                                kv_cache_memory_bytes=SMALL_KV).generate(prompts, params, use_tqdm=False)]
    llm = LLM(model, tokenizer=smollm2_path, device="cpu", tensor_parallel_size=2, kv_cache_memory_bytes=SMALL_KV)
    try:
        assert [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)] == reference
    finally:
        llm.close()
    assert all(re.fullmatch("[a-c]{3}( [0-9]{2})?", text) for text in reference), reference


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_tp2_embeds_as_tp1(tiny_qwen3, pooling_type) -> None:
    """runner="pooling": rank 0 pools the hidden states every rank holds after the last all-reduce; chunked
    prefill and preemption under TP too."""
    kwargs = dict(device="cpu", runner="pooling", pooler_config={"pooling_type": pooling_type}, **PRESSURE)
    reference = [o.outputs.embedding for o in LLM(tiny_qwen3, **kwargs).embed(tiny_prompts(), use_tqdm=False)]
    llm = LLM(tiny_qwen3, tensor_parallel_size=2, **kwargs)
    try:
        got = [o.outputs.embedding for o in llm.embed(tiny_prompts(), use_tqdm=False)]
    finally:
        llm.close()
    assert torch.allclose(torch.tensor(got), torch.tensor(reference), atol=1e-5)
