"""vLLM's AsyncLLM over the server's engine client: outputs as each output kind asks, equal to the offline LLM's
(a tiny random Llama with the SmolLM2 tokenizer, greedy); aborts, early exits and cancellations free the request;
errors as LLM's; an engine made outside an event loop; shutdown, a dead core, embeddings."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import re
import time

import psutil
import pytest

from nanoinfer import (LLM, AsyncEngineArgs, AsyncLLM, AsyncLLMEngine, LoRARequest, PoolingParams, RequestOutput,
                       RequestOutputKind, SamplingParams)
from nanoinfer.engine.core import EngineDeadError
from test_lora import make_adapter
from test_server import tiny_model_with_smollm2_vocab

PROMPTS = ["The capital of France is", [5, 9, 17, 3, 88, 120, 7], {"prompt": "Once upon a time", "cache_salt": "s"},
           {"prompt_token_ids": [200, 1, 2, 3], "prompt": "their text"}]
MAX_NUM_WAITING = 16


def greedy(max_tokens: int = 16, **fields) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **fields)


def engine_args(model: str, **overrides) -> AsyncEngineArgs:
    return AsyncEngineArgs(model=model, num_kv_blocks=128, **overrides)


async def collect(outputs) -> list:
    return [output async for output in outputs]


async def started(args: AsyncEngineArgs) -> AsyncLLM:
    """An engine made inside the running loop (its core starts at once), once it serves."""
    engine = AsyncLLM.from_engine_args(args)
    await engine.check_health()
    return engine


def core_process(engine: AsyncLLM) -> psutil.Process:
    return psutil.Process(engine._client._proc.pid)


def metric(engine: AsyncLLM, name: str, **labels: str) -> float | None:
    """A sample of the engine client's metrics (the server's /metrics)."""
    return engine._client.metrics.registry.get_sample_value(f"nanoinfer:{name}",
                                                            {"model_name": engine.config.model, **labels})


def num_aborted(engine: AsyncLLM) -> float:
    return metric(engine, "request_success_total", finished_reason="abort") or 0.0


async def settled(engine: AsyncLLM, timeout: float = 15.0) -> None:
    """Until no request is in flight and the core reports every KV block free (its stats follow an abort)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while engine._client.num_unfinished or metric(engine, "kv_cache_blocks_in_use") != 0:
        assert asyncio.get_running_loop().time() < deadline, "the request was not freed"
        await asyncio.sleep(0.02)


# ----- fixtures -----


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return tiny_model_with_smollm2_vocab(tmp_path_factory)


@pytest.fixture(scope="module")
def adapter(model_path, tmp_path_factory) -> LoRARequest:
    return LoRARequest("sql", 1, make_adapter(tmp_path_factory.mktemp("async_lora") / "sql", model_path, seed=1))


@pytest.fixture(scope="module")
def runner():
    """One event loop for the module's engine, which serves the loop it was made in."""
    with asyncio.Runner() as runner:
        yield runner


@pytest.fixture(scope="module")
def engine(runner, model_path, smollm2_path):
    engine = runner.run(started(engine_args(model_path, tokenizer=smollm2_path, enable_lora=True,
                                            max_num_waiting=MAX_NUM_WAITING)))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def llm(model_path, smollm2_path) -> LLM:
    return LLM(model_path, tokenizer=smollm2_path, num_kv_blocks=128, enable_lora=True)


@pytest.fixture(scope="module")
def expected(llm) -> list[RequestOutput]:
    """The offline LLM's greedy outputs for PROMPTS."""
    return llm.generate(PROMPTS, greedy(), use_tqdm=False)


def assert_same(output: RequestOutput, expected: RequestOutput, request_id: str) -> None:
    assert output.request_id == request_id and output.finished
    assert (output.prompt, output.prompt_token_ids) == (expected.prompt, expected.prompt_token_ids)
    assert [(c.index, c.token_ids, c.text, c.finish_reason) for c in output.outputs] == \
        [(c.index, c.token_ids, c.text, c.finish_reason) for c in expected.outputs]


def joined(deltas: list[RequestOutput]) -> RequestOutput:
    """DELTA outputs added up."""
    final = copy.deepcopy(deltas[0])
    for delta in deltas[1:]:
        final.add(delta)
    return final


# ----- outputs -----


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_outputs_equal_the_offline_llms_in_every_output_kind(engine, expected, runner, kind):
    params = greedy(output_kind=kind)
    snapshots: dict[str, list[RequestOutput]] = {}

    async def read(request_id: str, prompt) -> list[RequestOutput]:
        outputs = []
        async for output in engine.generate(prompt, params, request_id):
            outputs.append(output)
            snapshots.setdefault(request_id, []).append(copy.deepcopy(output))
        return outputs

    async def main():
        return await asyncio.gather(*(read(f"r{i}", p) for i, p in enumerate(PROMPTS)))

    for i, (outputs, want) in enumerate(zip(runner.run(main()), expected)):
        request_id = f"r{i}"
        assert outputs == snapshots[request_id]  # nothing yielded was changed afterwards
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        assert all(o.request_id == request_id for o in outputs)
        if kind is RequestOutputKind.FINAL_ONLY:
            assert len(outputs) == 1
            final = outputs[0]
        elif kind is RequestOutputKind.DELTA:
            final = joined(outputs)
            assert [c.finish_reason for o in outputs[:-1] for c in o.outputs] == [None] * (len(outputs) - 1)
        else:
            for earlier, later in zip(outputs, outputs[1:]):
                assert later.outputs[0].token_ids[:len(earlier.outputs[0].token_ids)] == earlier.outputs[0].token_ids
                assert later.outputs[0].text.startswith(earlier.outputs[0].text)
            final = outputs[-1]
        assert_same(final, want, request_id)
    if kind is not RequestOutputKind.FINAL_ONLY:
        assert max(len(s) for s in snapshots.values()) > 1  # it streamed


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_n_completions(engine, llm, runner, kind):
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    offline = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    outputs = runner.run(collect(engine.generate(PROMPTS[0], dataclasses.replace(params, output_kind=kind), "n2")))
    final = joined(outputs) if kind is RequestOutputKind.DELTA else outputs[-1]
    assert_same(final, offline, "n2")
    assert final.outputs[0].token_ids != final.outputs[1].token_ids


def test_many_concurrent_requests(engine, llm, runner):
    prompts = [[(7 * i + j) % 250 + 1 for j in range(3 + i)] for i in range(12)]
    offline = llm.generate(prompts, greedy(), use_tqdm=False)

    async def main():
        return await asyncio.gather(*(collect(engine.generate(p, greedy(output_kind=RequestOutputKind.FINAL_ONLY),
                                                             f"c{i}")) for i, p in enumerate(prompts)))

    for i, (outputs, want) in enumerate(zip(runner.run(main()), offline)):
        assert_same(outputs[0], want, f"c{i}")
    assert engine._client.num_unfinished == 0


def test_lora_request(engine, llm, expected, runner, adapter):
    outputs = runner.run(collect(engine.generate(PROMPTS[0], greedy(), "lora", lora_request=adapter)))
    assert_same(outputs[-1], llm.generate(PROMPTS[0], greedy(), use_tqdm=False, lora_request=adapter)[0], "lora")
    assert outputs[-1].outputs[0].token_ids != expected[0].outputs[0].token_ids  # not the base model's


def test_tokenizer_and_default_sampling_params(engine, llm, runner):
    assert runner.run(engine.get_tokenizer()) is engine._client.tokenizer
    assert runner.run(engine.get_default_sampling_params()) == llm.get_default_sampling_params()
    assert AsyncLLMEngine is AsyncLLM


# ----- ending requests -----


def test_abort_ends_one_request_while_the_others_finish(engine, runner):
    async def read(request_id: str, abort: bool) -> list[RequestOutput]:
        outputs = []
        async for output in engine.generate(PROMPTS[0], greedy(300), request_id):
            outputs.append(output)
            if abort and len(outputs) == 1:
                await engine.abort([request_id, "not-in-flight"])
        return outputs

    async def main():
        results = await asyncio.gather(read("keep-1", False), read("gone", True), read("keep-2", False))
        await settled(engine)
        return results

    aborted_before = num_aborted(engine)
    kept_1, aborted, kept_2 = runner.run(main())
    assert num_aborted(engine) == aborted_before + 1
    assert [c.finish_reason for c in aborted[-1].outputs] == ["abort"] and aborted[-1].finished
    assert len(aborted[-1].outputs[0].token_ids) < 300
    for outputs in (kept_1, kept_2):
        assert outputs[-1].outputs[0].finish_reason == "length" and len(outputs[-1].outputs[0].token_ids) == 300


@pytest.mark.parametrize("how", ["break", "aclose", "cancel"])
def test_a_reader_that_stops_early_frees_its_request(engine, expected, runner, how):
    async def main():
        outputs = engine.generate(PROMPTS[0], greedy(400), "quitter")
        if how == "break":
            async for _ in outputs:
                break
            del outputs  # (as at the end of a function: the loop's finalizer hook closes it)
        elif how == "aclose":
            await outputs.__anext__()
            await outputs.aclose()
        else:
            started_reading = asyncio.Event()

            async def read():
                async for _ in outputs:
                    started_reading.set()

            task = asyncio.create_task(read())
            await started_reading.wait()
            task.cancel()
        await settled(engine)
        assert num_aborted(engine) == aborted_before + 1  # ended, not run to its end
        return await collect(engine.generate(PROMPTS[0], greedy(), "quitter"))  # the id is free again

    aborted_before = num_aborted(engine)
    assert_same(runner.run(main())[-1], expected[0], "quitter")


def test_a_request_id_in_flight_is_refused(engine, runner):
    async def main():
        first = engine.generate(PROMPTS[0], greedy(100), "dup")
        await first.__anext__()
        with pytest.raises(ValueError, match="'dup' is already in flight"):
            await collect(engine.generate(PROMPTS[1], greedy(), "dup"))
        rest = await collect(first)
        await collect(engine.generate(PROMPTS[1], greedy(), "dup"))  # finished: free again
        return rest

    assert runner.run(main())[-1].outputs[0].finish_reason == "length"


def test_an_id_is_free_once_its_final_output_is_out(engine, runner):
    """As vLLM's: reading the final output frees the id, even while the reader keeps its generator open."""
    async def main():
        kept = engine.generate(PROMPTS[1], greedy(4, output_kind=RequestOutputKind.FINAL_ONLY), "reuse")
        assert (await kept.__anext__()).finished
        again = await collect(engine.generate(PROMPTS[1], greedy(4), "reuse"))
        await kept.aclose()
        return again

    assert runner.run(main())[-1].finished


# ----- errors -----


def bad_temperature() -> SamplingParams:
    params = SamplingParams()
    params.temperature = -1.0  # set after construction: checked when the request is added
    return params


@pytest.mark.parametrize("prompt, params, kwargs", [
    ("", greedy(), {}),
    ([5, 1_000_000], greedy(), {}),
    ([5, 1.5], greedy(), {}),
    ({"text": "hi"}, greedy(), {}),
    (PROMPTS[0], greedy(10_000), {}),
    (PROMPTS[0], bad_temperature(), {}),
    (PROMPTS[0], PoolingParams(), {}),
    (PROMPTS[0], greedy(), {"priority": 1}),
], ids=["empty", "token-id", "float-id", "dict-keys", "too-long", "temperature", "pooling", "priority"])
def test_bad_input_raises_as_the_offline_llm(engine, llm, runner, prompt, params, kwargs):
    with pytest.raises((ValueError, TypeError)) as offline:
        llm.generate(prompt, params, use_tqdm=False, **{k: [v] for k, v in kwargs.items()})  # (a priority per prompt)
    with pytest.raises(offline.type, match=re.escape(str(offline.value))):
        runner.run(collect(engine.generate(prompt, params, "bad", **kwargs)))
    assert runner.run(collect(engine.generate(PROMPTS[0], greedy(2), "bad")))[-1].finished  # others unharmed


@pytest.mark.parametrize("kwargs, message", [
    ({"request_id": 7}, "request_id must be a str"),
    ({"sampling_params": "greedy"}, "params must be SamplingParams"),
    ({"lora_request": "sql"}, "lora_request must be a LoRARequest"),
])
def test_arguments_of_the_wrong_type(engine, runner, kwargs, message):
    kwargs = {"sampling_params": greedy(), "request_id": "typed"} | kwargs
    with pytest.raises(TypeError, match=message):
        runner.run(collect(engine.generate(PROMPTS[0], **kwargs)))


def test_a_full_waiting_queue_refuses_the_request(engine, runner):
    async def main():
        return await asyncio.gather(*(collect(engine.generate([5, 6, i + 1], greedy(2), f"q{i}"))
                                      for i in range(MAX_NUM_WAITING + 1)), return_exceptions=True)

    results = runner.run(main())
    assert isinstance(results[-1], OverflowError) and "waiting queue is full" in str(results[-1])
    assert all(isinstance(r, list) and r[-1].finished for r in results[:-1])


# ----- life cycle -----


def test_made_outside_a_loop_then_shut_down_after_it(model_path, smollm2_path, expected):
    engine = AsyncLLM(engine_args(model_path, tokenizer=smollm2_path))
    assert engine.is_running and not engine.errored  # its core starts in the loop of its first call
    outputs = asyncio.run(collect(engine.generate(PROMPTS[0], greedy(), "a")))
    assert_same(outputs[-1], expected[0], "a")
    with pytest.raises(RuntimeError, match="one event loop"):
        asyncio.run(engine.check_health())
    core = core_process(engine)
    engine.shutdown()
    engine.shutdown()
    assert not core.is_running()
    assert engine.errored and not engine.is_running
    with pytest.raises(EngineDeadError, match="shut down"):
        asyncio.run(engine.check_health())


def test_shutdown_in_the_loop_ends_requests_in_flight(model_path, smollm2_path):
    async def main():
        engine = await started(engine_args(model_path, tokenizer=smollm2_path))
        core = core_process(engine)
        outputs = engine.generate(PROMPTS[0], greedy(400), "a")
        await outputs.__anext__()
        engine.shutdown()
        assert not core.is_running()
        with pytest.raises(EngineDeadError, match="shut down"):
            await collect(outputs)
        engine.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            await collect(engine.generate(PROMPTS[0], greedy(), "b"))

    asyncio.run(main())


def test_shutdown_from_another_thread_ends_requests_in_flight(model_path, smollm2_path):
    """The loop's own objects are touched on the loop (the other thread hands it the work): a reader awaiting
    with no timer pending on the loop wakes with EngineDeadError."""
    import threading

    async def main():
        engine = await started(engine_args(model_path, tokenizer=smollm2_path))
        core = core_process(engine)
        outputs = engine.generate(PROMPTS[0], greedy(400, output_kind=RequestOutputKind.FINAL_ONLY), "a")
        reader = asyncio.ensure_future(collect(outputs))
        await asyncio.sleep(0.3)
        stopper = threading.Thread(target=engine.shutdown)
        begun = time.monotonic()
        stopper.start()
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(reader, 30)  # (its timer would wake a loop nothing else woke: hence the clock)
        assert time.monotonic() - begun < 10
        await asyncio.to_thread(stopper.join)
        assert not core.is_running()

    asyncio.run(main(), debug=True)  # (debug: a loop object touched from another thread raises, every time)


def test_a_failed_start_raises_in_every_call():
    async def main():
        engine = AsyncLLM(AsyncEngineArgs(model="/no/such/model"))
        for _ in range(2):
            with pytest.raises(EngineDeadError, match="failed to start") as error:
                await engine.check_health()
            assert isinstance(error.value.__cause__, (ValueError, FileNotFoundError))
        assert engine.errored and "failed to start" in str(engine.dead_error)
        engine.shutdown()

    asyncio.run(main())


def test_embeddings_without_a_tokenizer_and_a_dead_core(tiny_models):
    """A pooling engine's encode gives LLM.encode's vectors; then its core dies."""
    offline = LLM(tiny_models["llama"], runner="pooling", num_kv_blocks=64)
    want = offline.encode([[5, 9, 17]], use_tqdm=False)[0]

    async def main():
        engine = await started(AsyncEngineArgs(model=tiny_models["llama"], runner="pooling", num_kv_blocks=64))
        (output,) = await collect(engine.encode([5, 9, 17], PoolingParams(), "e"))
        assert output.request_id == "e" and output.prompt_token_ids == [5, 9, 17]
        assert output.outputs.data.tolist() == pytest.approx(want.outputs.data.tolist(), abs=1e-5)
        with pytest.raises(ValueError, match="no tokenizer"):
            await engine.get_tokenizer()
        with pytest.raises(TypeError, match="encode\\(\\) takes PoolingParams"):
            await collect(engine.encode([5, 9, 17], greedy()))
        core_process(engine).kill()
        with pytest.raises(EngineDeadError):  # admitted as the core died: the request in flight fails
            await collect(engine.encode([5, 9, 17]))
        assert engine.errored and not engine.is_running
        with pytest.raises(EngineDeadError, match="died"):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await collect(engine.encode([5, 9, 17]))
        engine.shutdown()

    asyncio.run(main())
