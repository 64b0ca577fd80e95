"""The data plane: turns a SchedulerOutput into tensors, runs the model, samples.

It makes no policy decisions; it only follows the scheduler's token counts and
block ids, remembers per-request state between steps, and reports the tokens
it sampled for requests whose known tokens are all computed."""

from __future__ import annotations

import logging
import os
from typing import Callable, NamedTuple

import numpy as np
import torch

from nanoinfer.attention.backend import get_attention_backend
from nanoinfer.attention.metadata import AttentionMetadata, set_forward_context
from nanoinfer.config import EngineConfig
from nanoinfer.distributed.parallel_state import enable_symmetric_all_reduce, tp_broadcast_from_rank0, tp_rank
from nanoinfer.host_copy import to_device_many
from nanoinfer.layers.skinny_dispatch import set_skinny_gemm
from nanoinfer.layers.attention import bind_kv_cache
from nanoinfer.layers.fp8 import resolve_quantization
from nanoinfer.layers.fusion import set_fusion
from nanoinfer.loader.weights import load_model
from nanoinfer.lora.model_manager import LoRAModelManager
from nanoinfer.model_runner.block_table import BlockTable
from nanoinfer.model_runner.cuda_graph import CUDAGraphRunner
from nanoinfer.model_runner.output import NO_TOKEN, RunnerFuture, copy_to_host, stack_rows
from nanoinfer.model_runner.pooler import Pooler
from nanoinfer.model_runner.state import CachedRequestState
from nanoinfer.sample.metadata import allowed_token_mask
from nanoinfer.sample.penalties import PenaltyState
from nanoinfer.sample.sampler import LogprobsTensors, Sampler, SamplerOutput, SamplingMetadata, gather_logprobs
from nanoinfer.sample.structured import GrammarCompiler, RequestGrammar
from nanoinfer.pooling_params import PoolerConfig
from nanoinfer.scheduler.output import SchedulerOutput

logger = logging.getLogger("nanoinfer")


class StepInputs(NamedTuple):
    """What `_prepare_inputs` makes of a scheduler output."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    query_start_loc: list[int]  # per request (the metadata's may be per token: a step of drafts)
    logits_indices: torch.Tensor  # hidden rows to sample
    sample_states: list[CachedRequestState]  # per sampled row
    output_index: list[int]  # per sampled row: the output position it samples
    drafts: list | None  # speculative decoding: per sampled request, its draft tokens


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, model_path: str, device: torch.device,
                 dtype: torch.dtype, eos_token_ids: set[int], tp_size: int = 1,
                 tokenizer_path: str | None = None, pooler: PoolerConfig | None = None) -> None:
        """`pooler`: runner="pooling" (the model's embeddings), or None (it generates)."""
        self.config, self.hf_config, self.device, self.dtype = config, hf_config, device, dtype
        # fp8: K/V rounded to float8_e4m3fn as they are stored; attention upcasts them as it loads them.
        self.kv_cache_dtype = dtype if config.kv_cache_dtype == "auto" else torch.float8_e4m3fn
        self.block_size = config.block_size
        self.eos_token_ids = eos_token_ids
        self.vocab_size = hf_config.vocab_size
        self.num_layers = hf_config.num_hidden_layers
        self.num_kv_heads = hf_config.num_key_value_heads // tp_size
        self.head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        backend = config.attention_backend
        if backend == "auto":
            backend = "triton" if device.type == "cuda" else "torch"
        if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend='triton' needs a CUDA GPU (or TRITON_INTERPRET=1, Triton's "
                             "interpreter, as the tests use it on a CPU)")
        self.attn_backend = get_attention_backend(backend)
        torch.manual_seed(config.seed)
        set_fusion(device.type == "cuda" and not config.enforce_eager)
        set_skinny_gemm(device.type == "cuda" and not config.enforce_eager)
        load_format = "safetensors" if config.load_format == "gguf" else config.load_format  # converted on resolve
        self.pooler = None if pooler is None else Pooler(pooler.pooling_type)
        self.model = load_model(model_path, hf_config, load_format, dtype, device, needs_lm_head=self.pooler is None,
                                quantization=resolve_quantization(config.quantization, hf_config))
        # LoRA slots are allocated now, so the KV cache sizing counts them. A step has at most this many tokens.
        self.lora = LoRAModelManager(self.model, hf_config, config, max(config.max_num_batched_tokens,
                                                                        config.max_num_seqs), dtype, device) \
            if config.enable_lora else None
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        self.block_table = BlockTable()
        self.scoring: set[str] = set()  # requests with prompt_logprobs whose prompt is not all computed yet
        self.tokenizer_path = tokenizer_path  # for structured outputs' grammars (`grammar_compiler`)
        self.grammars: GrammarCompiler | None = None
        self.penalties: PenaltyState | None = None  # token counts of the requests with penalties
        self.kv_cache: torch.Tensor | None = None
        self.cuda_graphs: CUDAGraphRunner | None = None
        # The latest step's sampled tokens, still on the device, and each request's row in it.
        self.prev_sampled: torch.Tensor | None = None
        self.prev_rows: dict[str, int] = {}
        # The latest reusable sampling metadata and its rows' request ids (`_sampling_metadata`).
        self.last_sampling: tuple[list[str], SamplingMetadata] | None = None
        self.last_future: RunnerFuture | None = None

    # ----- KV cache -----

    @property
    def kv_block_bytes(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.kv_cache_dtype.itemsize

    def num_kv_blocks_for_budget(self) -> int:
        """How many blocks the configured memory budget holds on this rank."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cuda" and self.config.kv_cache_memory_bytes is None:
            return self._profile_gpu_kv_blocks()
        budget = self.config.kv_cache_memory_bytes or (1 << 30)
        if budget < self.kv_block_bytes:
            raise ValueError(f"kv_cache_memory_bytes={budget} is smaller than one KV block ({self.kv_block_bytes} "
                             f"bytes at block_size={self.block_size})")
        return budget // self.kv_block_bytes

    def _profile_gpu_kv_blocks(self) -> int:
        """Run a worst-case forward, then give the KV cache what is left of
        gpu_memory_utilization after weights, peak activations and the penalties' token counts."""
        num_tokens = self.config.max_num_batched_tokens
        self.initialize_kv_cache(-(-num_tokens // self.block_size))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cache_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        metadata = self._metadata_for_single_sequence(num_tokens)
        with torch.inference_mode(), set_forward_context(metadata):
            hidden = self.model(ids, positions)
            logits = self.model.compute_logits(hidden[-min(num_tokens, self.config.max_num_seqs):])
            if logits is not None:  # the sampler's float32 copy (penalties, filters, logprobs)
                logits.float()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - cache_bytes
        self.kv_cache = None
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        # Room for the penalties' token counts too, allocated when a request first asks for one, and for
        # allowed_token_ids masks: a [vocab] bool per request, and the batch's stacked copy.
        peak += PenaltyState.bytes_for(self.config.max_num_seqs, self.vocab_size) + \
            2 * self.config.max_num_seqs * self.vocab_size
        available = total * self.config.gpu_memory_utilization - peak
        if available <= 0:
            raise RuntimeError(f"no memory left for the KV cache: peak use {peak / 2**30:.1f} GiB of "
                               f"{total * self.config.gpu_memory_utilization / 2**30:.1f} GiB allowed")
        return int(available // self.kv_block_bytes)

    def _metadata_for_single_sequence(self, num_tokens: int) -> AttentionMetadata:
        num_blocks = -(-num_tokens // self.block_size)
        return AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=self.device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=self.device)[None],
            max_query_len=num_tokens, max_seq_len=num_tokens,
            query_start_loc_cpu=[0, num_tokens], seq_lens_cpu=[num_tokens],
        )

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """The one preallocated KV tensor: [2, layers, blocks, block_size, kv_heads, head_dim]."""
        self.num_blocks = num_blocks
        self.kv_cache = torch.zeros(2, self.num_layers, num_blocks, self.block_size, self.num_kv_heads,
                                    self.head_dim, dtype=self.kv_cache_dtype, device=self.device)
        bind_kv_cache(self.model, self.kv_cache, self.attn_backend)

    def capture_cuda_graphs(self, max_model_len: int) -> None:
        """Decode steps and small mixed steps replay graphs on CUDA with the Triton backend, unless
        enforce_eager."""
        if self.device.type != "cuda" or self.config.enforce_eager or self.attn_backend.name != "triton":
            return
        self.cuda_graphs = CUDAGraphRunner(self.model, self.hf_config.hidden_size, self.dtype, self.device,
                                           self.config.max_num_seqs, max_model_len, self.block_size,
                                           self.config.max_num_batched_tokens)
        self.cuda_graphs.capture()
        self._compile_eager_variants()

    def release_cuda_graphs(self) -> None:
        """Free the captured graphs (later decode steps run eagerly). NCCL keeps a communicator
        in use while any graph that captured one of its collectives exists, so a TP rank must do
        this before it leaves the group: an abort would otherwise wait forever. The caller waits
        for the GPU first, bounded (`wait_for_device`): an unbounded wait here could hang a
        shutdown whose peer died mid-collective."""
        self.cuda_graphs = None  # the only reference: the graphs and their memory pool go now

    @torch.inference_mode()
    def _compile_eager_variants(self) -> None:
        """Compile now what the first requests would otherwise pay for mid-run: the
        prefill kernel's tile variants (one per power-of-two query length up to its
        widest tile), the sampling kernel (one compile serves every batch size) and the
        penalties' (~0.5 s in the first penalized step otherwise).
        Writes only into KV blocks that hold no request yet."""
        from nanoinfer.kernels.penalties import penalize_kernel  # CUDA only: triton
        from nanoinfer.kernels.sampling import sample_from_logits

        for num_tokens in (2, 4, 8, 16, 32, 64, 128):
            metadata = self._metadata_for_single_sequence(num_tokens)
            with set_forward_context(metadata):
                self.model(torch.zeros(num_tokens, dtype=torch.long, device=self.device),
                           torch.arange(num_tokens, device=self.device))
        for dtype in {self.dtype, torch.float32}:  # the model's logits, or float32 ones
            sample_from_logits(torch.zeros(1, self.vocab_size, dtype=dtype, device=self.device),
                               torch.ones(1, device=self.device), torch.zeros(1, device=self.device))
        one = torch.zeros(1, dtype=torch.long, device=self.device)
        penalize_kernel(torch.zeros(1, self.vocab_size, device=self.device), one, one,
                        torch.zeros(1, self.vocab_size, dtype=torch.int32, device=self.device),
                        torch.zeros(1, self.vocab_size, dtype=torch.bool, device=self.device), None, None, None)
        torch.cuda.synchronize()

    # ----- one step -----

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        for new in scheduler_output.new_reqs:
            self._forget(new.req_id)
            self.requests[new.req_id] = CachedRequestState.from_new(new, self.block_table.add(new.block_ids), self.device)
            if new.sampling_params.prompt_logprobs is not None:
                self.scoring.add(new.req_id)
        for cached in scheduler_output.cached_reqs:
            state = self.requests[cached.req_id]
            if cached.new_block_ids:
                self.block_table.append(state.table_row, cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _forget(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        self.scoring.discard(req_id)
        if state is not None:
            self.block_table.free(state.table_row)
            if state.penalty_slot is not None:
                self.penalties.close(state.penalty_slot)
        if self.last_sampling is not None and req_id in self.last_sampling[0]:
            self.last_sampling = None  # it holds this state's slot: a request back under its id needs its own

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
        states = [self.requests[r] for r in scheduler_output.num_scheduled_tokens]
        counts_list = list(scheduler_output.num_scheduled_tokens.values())
        spec = scheduler_output.scheduled_spec_tokens
        # One pass in plain Python ints (cheaper than numpy scalars at a few hundred requests).
        token_ids: list[int] = []
        starts = [s.num_computed_tokens for s in states]
        pending: list[tuple[int, int]] = []  # (input row, row in the previous step's sampled tensor)
        prev_rows = self.prev_rows
        sample_rows: list[int] = []  # requests whose known (or in-flight) tokens are now all computed
        sampled_drafts: list = []  # per sampled request: the draft tokens after its known ones (speculative decoding)
        for i, (s, begin, n) in enumerate(zip(states, starts, counts_list)):
            end, known = begin + n, len(s.token_ids)
            drafts = spec.get(s.req_id, ()) if spec else ()
            if drafts:  # scheduled synchronously: its known tokens are all on the host
                token_ids.extend(s.token_ids[begin:known])
                token_ids.extend(drafts)
            elif end > known:  # its newest token is still on the device (async scheduling)
                token_ids.extend(s.token_ids[begin:known])
                token_ids.append(0)
                pending.append((len(token_ids) - 1, prev_rows[s.req_id]))
            else:
                token_ids.extend(s.token_ids[begin:end])
            if end >= known:
                sample_rows.append(i)
                if spec:
                    sampled_drafts.append(drafts)
        counts = np.array(counts_list, dtype=np.int64)
        seq_lens = np.array(starts, dtype=np.int64) + counts
        query_start_loc = np.zeros(len(states) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start_loc[1:])
        # positions[t] = start of its request + offset within the request's chunk
        offsets = np.arange(int(query_start_loc[-1])) - np.repeat(query_start_loc[:-1], counts)
        positions = np.repeat(seq_lens - counts, counts) + offsets
        input_ids = np.array(token_ids, dtype=np.int64)
        block_tables = self.block_table.gather(np.fromiter((s.table_row for s in states), np.int64, len(states)))
        row = np.repeat(np.arange(len(states)), counts)
        slot_mapping = block_tables[row, positions // self.block_size].astype(np.int64) * self.block_size
        slot_mapping += positions % self.block_size
        logits_indices = query_start_loc[1:][sample_rows] - 1
        if spec:  # a request with d drafts samples its last d + 1 positions
            logits_indices = _expand_rows(logits_indices, np.array([len(d) for d in sampled_drafts], dtype=np.int64))

        pending_rows = np.array(pending, dtype=np.int64).reshape(-1, 2)
        # Attention's view of the step: a sequence per request; or, for a step of drafts and decodes that fits
        # the decode graphs, a sequence per token, each seeing the context up to itself (its request's drafts
        # are written before attention reads): the decode kernel splits a long context over many programs,
        # where the prefill kernel would give a request's few query tokens only a few (bench/NOTES.md).
        attn_qsl, attn_seq_lens, attn_tables = query_start_loc, seq_lens, block_tables
        all_decoding = spec and all(n == 1 + len(spec.get(s.req_id, ())) for s, n in zip(states, counts_list))
        if all_decoding and len(token_ids) <= self.config.max_num_seqs:  # no prefill in the step
            attn_qsl, attn_seq_lens, attn_tables = np.arange(len(token_ids) + 1), positions + 1, block_tables[row]
        max_query_len = int(np.diff(attn_qsl).max())
        decode_only = max_query_len == 1
        seq_order = np.argsort(-attn_seq_lens, kind="stable").astype(np.int32) if decode_only else np.zeros(0, np.int32)
        lora_slots = np.repeat(self._lora_slots(states), counts) if self.lora is not None else np.zeros(0, np.int32)
        (slot_mapping_gpu, query_start_loc_gpu, seq_lens_gpu, block_tables_gpu, input_ids_gpu, positions_gpu,
         logits_indices_gpu, pending_gpu, seq_order_gpu, lora_slots_gpu) = to_device_many(
            [slot_mapping, attn_qsl.astype(np.int32), attn_seq_lens.astype(np.int32), attn_tables,
             input_ids, positions, logits_indices, pending_rows, seq_order, lora_slots], self.device)
        if self.lora is not None:
            self.lora.set_mapping(lora_slots_gpu)
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping_gpu,
            query_start_loc=query_start_loc_gpu,
            seq_lens=seq_lens_gpu,
            block_tables=block_tables_gpu,
            max_query_len=max_query_len,
            max_seq_len=int(attn_seq_lens.max()),
            query_start_loc_cpu=attn_qsl.tolist(),
            seq_lens_cpu=attn_seq_lens.tolist(),
            seq_order=seq_order_gpu if decode_only else None,
        )
        if pending:
            input_ids_gpu[pending_gpu[:, 0]] = self.prev_sampled[pending_gpu[:, 1]]
        sample_states = [states[i] for i in sample_rows]
        output_index = [n - s.prompt_len for n, s in zip(seq_lens[sample_rows].tolist(), sample_states)]
        inputs = StepInputs(input_ids_gpu, positions_gpu, metadata, query_start_loc.tolist(), logits_indices_gpu,
                            sample_states, output_index, None)
        if not spec:
            return inputs
        # A sampling row per sampled position: a request's rows sample its output positions in order.
        rows = [(s, last - len(d) + j) for s, last, d in zip(sample_states, output_index, sampled_drafts)
                for j in range(len(d) + 1)]
        return inputs._replace(sample_states=[s for s, _ in rows], output_index=[i for _, i in rows],
                               drafts=sampled_drafts)

    def _lora_slots(self, states: list[CachedRequestState]) -> np.ndarray:
        """Each request's adapter slot (-1: the base model), once the step's adapters are in slots. A request
        whose adapter cannot be loaded (its folder changed since admission) runs without it and fails at its next
        sampling, alone."""
        loras = {s.lora_request.lora_int_id: s.lora_request for s in states if s.lora_request is not None}
        if not loras:
            return np.full(len(states), -1, dtype=np.int32)
        slot_of, failed = self.lora.activate(loras)
        slots = []
        for s in states:
            lora_id = 0 if s.lora_request is None else s.lora_request.lora_int_id
            if lora_id in failed:
                s.lora_error = failed[lora_id]
            slots.append(slot_of.get(lora_id, -1))
        return np.array(slots, dtype=np.int32)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerFuture | None:
        """Launch one step. The sampled tokens come back through the returned
        future, so the caller can plan the next step while the GPU works."""
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return None
        # A grammar needs its request's newest token on the host, but only to sample: the forward takes it from
        # the device. So the forward is launched first and the previous step waited for after, while the GPU runs
        # it (the grammar's bitmask is filled meanwhile).
        waits_for_history = self.last_future is not None and any(
            self.requests[r].needs_newest_token and r in self.prev_rows for r in scheduler_output.num_scheduled_tokens)
        input_ids, positions, metadata, query_start_loc, logits_indices, sample_states, output_index, drafts = \
            self._prepare_inputs(scheduler_output)
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(metadata):
            hidden = self.cuda_graphs.run(input_ids, positions, metadata)
        else:
            with set_forward_context(metadata):
                hidden = self.model(input_ids, positions)
        if self.pooler is not None:
            return self._pool(hidden, scheduler_output, query_start_loc, logits_indices, sample_states)
        prompt_logprobs = self._prompt_logprobs(hidden, scheduler_output, query_start_loc)
        if not sample_states:
            self.last_future = None
            return RunnerFuture([], None, None, prompt_logprobs=prompt_logprobs)
        logits = self.model.compute_logits(hidden[logits_indices])
        if waits_for_history:
            self.last_future.result()
        # Rank 0 samples; TP workers receive the tokens on the device, so that, like rank 0, they can
        # feed them to the next step before anyone has read them back (async scheduling).
        if tp_rank() == 0:
            sampled, errors = self._sample(logits, sample_states, output_index)
            if self.lora is not None:
                errors.update((s.req_id, s.lora_error) for s in sample_states if s.lora_error is not None)
            token_ids = sampled.sampled_token_ids
        else:
            token_ids = torch.empty(len(sample_states), dtype=torch.long, device=self.device)
        self.prev_sampled = tp_broadcast_from_rank0(token_ids)
        self.prev_rows = {s.req_id: i for i, s in enumerate(sample_states)}
        if tp_rank() != 0:
            return None
        positions = [s.prompt_len + i for s, i in zip(sample_states, output_index)]
        if sampled.no_token is not None:  # (the device keeps a real id: the next step may read it before the host)
            token_ids = torch.where(sampled.no_token, NO_TOKEN, token_ids)
        self.last_future = RunnerFuture(sample_states, sampled, copy_to_host(token_ids), errors, positions,
                                        prompt_logprobs, None if self.grammars is None else self.grammars.accept,
                                        drafts)
        return self.last_future

    def _pool(self, hidden: torch.Tensor, scheduler_output: SchedulerOutput, query_start_loc: list[int],
              last_rows: torch.Tensor, finishing: list[CachedRequestState]) -> RunnerFuture | None:
        """runner="pooling": no sampling; the requests whose prompt this step ends get their pooled vector (rank 0
        reports it; the hidden states are the same on every TP rank)."""
        states = [self.requests[r] for r in scheduler_output.num_scheduled_tokens]
        ends = {s.req_id for s in finishing}
        vectors = self.pooler(hidden, states, query_start_loc, [i for i, s in enumerate(states) if s.req_id in ends],
                              last_rows)
        self.last_future = None
        if tp_rank() != 0:
            return None
        return RunnerFuture([], None, None, pooled=None if vectors is None else
                            ([s.req_id for s in finishing], copy_to_host(vectors)))

    def _prompt_logprobs(self, hidden: torch.Tensor, scheduler_output: SchedulerOutput, query_start_loc: list[int]
                         ) -> tuple[list[tuple[str, int, int, int]], LogprobsTensors] | None:
        """For requests with prompt_logprobs, the logprob of each prompt token this step's chunk predicts (the
        hidden state at position p predicts token p + 1; the prompt's last position predicts the first output,
        which the sampler handles), with the top-n: ([(req_id, first position, count, n)], tensors). Logits are
        made max_num_seqs rows at a time, the size the KV-cache sizing profiled. Every TP rank runs this (the LM
        head gathers across them); rank 0 gets the result."""
        if not self.scoring:  # the usual step: no per-request loop
            return None
        spans, rows, targets = [], [], []
        for i, req_id in enumerate(scheduler_output.num_scheduled_tokens):
            if req_id not in self.scoring:
                continue
            state = self.requests[req_id]
            n = state.sampling_params.prompt_logprobs
            begin = state.num_computed_tokens
            end = min(begin + query_start_loc[i + 1] - query_start_loc[i], state.prompt_len - 1)
            if end == state.prompt_len - 1:
                self.scoring.discard(req_id)  # the rest is sampling
            if end <= begin:
                continue
            spans.append((req_id, begin + 1, end - begin, n))
            rows.extend(range(query_start_loc[i], query_start_loc[i] + end - begin))
            targets.extend(state.token_ids[begin + 1 : end + 1])
        if not spans:
            return None
        width = max(n for *_, n in spans)
        rows_gpu, targets_gpu = (torch.tensor(x, dtype=torch.long, device=self.device) for x in (rows, targets))
        parts = []
        for first in range(0, len(rows), self.config.max_num_seqs):
            logits = self.model.compute_logits(hidden[rows_gpu[first : first + self.config.max_num_seqs]])
            if logits is not None:
                parts.append(gather_logprobs(logits.float().log_softmax(dim=-1),
                                             targets_gpu[first : first + self.config.max_num_seqs], width))
        if not parts:  # a TP worker
            return None
        return spans, LogprobsTensors(*(torch.cat([getattr(p, f) for p in parts])
                                        for f in ("logprob_token_ids", "logprobs", "selected_token_ranks")))

    def _sample(self, logits: torch.Tensor, states: list[CachedRequestState],
                output_index: list[int]) -> tuple[SamplerOutput, dict[str, str]]:
        """Sample the batch. If that raises, sample row by row, so that only the
        requests whose own sampling raises fail (`errors`: req_id -> why), not the engine."""
        try:
            return self.sampler(logits, self._sampling_metadata(states, output_index)), {}
        except Exception:
            logger.exception("sampling a batch of %d requests failed; sampling them one by one", len(states))
        rows: list[SamplerOutput | None] = []
        errors: dict[str, str] = {}
        for i, state in enumerate(states):
            try:
                rows.append(self.sampler(logits[i : i + 1], self._sampling_metadata([state], output_index[i : i + 1])))
            except Exception as e:
                logger.exception("sampling request %s failed: it ends with finish_reason 'error'", state.req_id)
                errors[state.req_id] = f"{type(e).__name__}: {e}"
                rows.append(None)
        return stack_rows(rows, self.device), errors

    def _sampling_metadata(self, states: list[CachedRequestState], output_index: list[int]) -> SamplingMetadata:
        """Built from the rows' parameters, or last step's again while the batch is the same requests
        and none of them samples differently from step to step (`sampling_varies`): at 256 requests
        building it took ~0.7 ms of host time on our CPU machine, and most decode steps keep their batch."""
        req_ids = [s.req_id for s in states]
        reusable = not any(s.sampling_varies for s in states)
        if reusable and self.last_sampling is not None and self.last_sampling[0] == req_ids:
            return self.last_sampling[1]
        structured = [i for i, s in enumerate(states) if s.sampling_params.structured_outputs is not None]
        bad_words = any(s.sampling_params.bad_words_token_ids for s in states)
        limited = [s for s in states if s.sampling_params.allowed_token_ids is not None]
        for s in limited:
            if s.allowed_mask is None:
                s.allowed_mask = allowed_token_mask(s.sampling_params.allowed_token_ids, self.vocab_size, self.device)
        penalized = [s for s in states if s.sampling_params.uses_penalties]
        for s in penalized:
            if s.penalty_slot is None:  # its first sampling here: every token it has is on the host
                if self.penalties is None:  # max_num_seqs x vocab x 5 bytes, when first needed
                    self.penalties = PenaltyState(self.config.max_num_seqs, self.vocab_size, self.device)
                s.penalty_slot = self.penalties.open(s.token_ids[: s.prompt_len], s.token_ids[s.prompt_len :])
        metadata = SamplingMetadata.build(
            params=[s.sampling_params for s in states],
            num_output_tokens=output_index,
            generators=_row_generators(states, output_index),
            stop_token_ids=[self._min_tokens_stop_ids(s) for s in states],
            vocab_size=self.vocab_size,
            device=self.device,
            allowed_tokens=(structured, self.grammar_compiler().bitmask([self._grammar(states[i]) for i in structured]))
            if structured else None,
            penalties=(self.penalties, [s.penalty_slot for s in states]) if penalized else None,
            bad_word_ids=[s.bad_word_ids() for s in states] if bad_words else None,
            allowed_masks=[s.allowed_mask for s in states] if limited else None,
        )
        self.last_sampling = (req_ids, metadata) if reusable else None
        return metadata

    def grammar_compiler(self) -> GrammarCompiler:
        """Built at the first structured-output request (it loads the tokenizer: ~0.2-1 s once)."""
        if self.grammars is None:
            from nanoinfer.engine.llm_engine import load_tokenizer

            tokenizer = load_tokenizer(self.tokenizer_path)
            if tokenizer is None:
                raise ValueError("structured outputs need a tokenizer")
            self.grammars = GrammarCompiler(tokenizer, self.vocab_size, self.config.reasoning_parser)
        return self.grammars

    def _grammar(self, state: CachedRequestState) -> RequestGrammar:
        """The request's grammar, made at its first sampling (after a preemption: fed its outputs)."""
        if state.grammar is None:
            state.grammar = self.grammar_compiler().request_grammar(state.sampling_params.structured_outputs,
                                                                    state.token_ids, state.prompt_len)
        return state.grammar

    def add_sampled_tokens(self, req_ids: list[str], positions: list[int], token_ids: list[list[int]]) -> None:
        """TP workers: append the tokens rank 0 has read back (each request's new tokens, from `position` on), so
        every rank keeps the same token lists. Tokens whose position the request already holds (it was re-added
        with its tokens after a preemption), or of a request gone meanwhile, are skipped."""
        for req_id, position, new in zip(req_ids, positions, token_ids):
            state = self.requests.get(req_id)
            if state is not None and len(state.token_ids) == position:
                state.token_ids.extend(new)

    def _min_tokens_stop_ids(self, state: CachedRequestState) -> set[int]:
        """Token ids masked while the request is below min_tokens (none when min_tokens is 0)."""
        params = state.sampling_params
        if params.min_tokens == 0:
            return set()
        ids = set(params.stop_token_ids or ())
        return ids if params.ignore_eos else ids | self.eos_token_ids


def _row_generators(states: list[CachedRequestState], output_index: list[int]) -> list[torch.Generator | None]:
    """Each row's seeded generator (None: unseeded); a request's consecutive rows (speculative decoding) get one
    each, so every position draws what it would draw alone."""
    generators, previous, row = [], None, 0
    for state, index in zip(states, output_index):
        row = row + 1 if state is previous else 0
        previous = state
        generators.append(state.seeded_generator(index, row))
    return generators


def _expand_rows(last_rows: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """Each request's last row, preceded by as many rows as it has drafts: [9, 20] with [2, 0] -> [7, 8, 9, 20]."""
    widths = num_drafts + 1
    group_start = np.repeat(np.cumsum(widths) - widths, widths)
    return np.repeat(last_rows - num_drafts, widths) + np.arange(int(widths.sum())) - group_start


def start_model_runner(config: EngineConfig, source, device: torch.device, dtype: torch.dtype,
                       agree_num_blocks: Callable[[int], int] = lambda n: n) -> ModelRunner:
    """Build a runner, size and allocate its KV cache, capture its CUDA graphs. Every
    tensor-parallel rank runs exactly this, so the collectives inside (profiling,
    agreeing on the block count, graph warm-up) happen in the same order everywhere."""
    runner = ModelRunner(config, source.hf_config, source.model_path, device, dtype, source.eos_token_ids,
                         config.tensor_parallel_size, source.tokenizer_path, source.pooler)
    runner.initialize_kv_cache(agree_num_blocks(runner.num_kv_blocks_for_budget()))
    if config.tensor_parallel_size > 1 and device.type == "cuda":  # decode-sized all-reduces
        enable_symmetric_all_reduce(config.max_num_seqs, source.hf_config.hidden_size, dtype)
    runner.capture_cuda_graphs(source.max_model_len)
    return runner
