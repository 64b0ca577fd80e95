"""CUDA graphs for decode-only steps and for one sequence's short prefill.

A decode step of a small model is mostly kernel-launch overhead: ~15 kernels
per layer, each a few microseconds of CPU. We capture the model's forward once
per batch-size bucket over static input buffers and replay it; a step pads its
batch up to the next bucket. The graph's attention is launched for the longest
possible context (max_model_len), so one capture serves every sequence length;
the kernels stop at each sequence's real length. Block tables are sized for
max_model_len plus one block, so no bucket ever overflows its buffer.

A step that prefills (or continues) one sequence with up to `PREFILL_BUCKETS[-1]`
tokens, the single-stream time to first token, is launch-bound the same way
(a 128-token prefill: ~12 ms of host work for ~1.2 ms of GPU work on an H200),
so it replays a graph captured per token-count bucket: the padding tokens belong
to no sequence (the attention tiles past the prompt leave at once) and write no
KV (slot -1). Larger or multi-sequence steps run eagerly, and so do all prefills
under tensor parallelism (their all-reduces in a graph are untested on GPUs)."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from nanoinfer.attention.metadata import AttentionMetadata, set_forward_context

logger = logging.getLogger("nanoinfer")


PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)


def batch_size_buckets(max_num_seqs: int) -> list[int]:
    buckets = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return buckets + [max_num_seqs]


def prefill_buckets(max_num_batched_tokens: int, max_model_len: int) -> list[int]:
    """Token counts of the one-sequence prefill graphs: those a step can schedule."""
    return [b for b in PREFILL_BUCKETS if b <= min(max_num_batched_tokens, max_model_len)]


class CUDAGraphRunner:
    def __init__(self, model: nn.Module, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 max_num_seqs: int, max_model_len: int, block_size: int, max_num_batched_tokens: int,
                 prefill: bool = True) -> None:
        """prefill=False: decode graphs only (tensor-parallel ranks, whose prefill graphs are not tested)."""
        self.model = model
        self.buckets = batch_size_buckets(max_num_seqs)
        self.prefill_buckets = prefill_buckets(max_num_batched_tokens, max_model_len) if prefill else []
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        max_blocks = -(-max_model_len // block_size) + 1
        n = max_num_seqs
        tokens = max([n, *self.prefill_buckets])  # a decode row per sequence, or one sequence's prefill
        self.input_ids = torch.zeros(tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.prefill_query_start_loc = torch.zeros(2, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.identity_order = torch.arange(n, dtype=torch.int32, device=device)
        self.seq_order = self.identity_order.clone()
        self.hidden = torch.zeros(tokens, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
            max_query_len=1, max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(bs + 1)), seq_lens_cpu=[self.max_model_len] * bs,
            seq_order=self.seq_order[:bs])

    def _prefill_metadata(self, num_tokens: int) -> AttentionMetadata:
        """One sequence's `num_tokens` new tokens (the query tiles launched for all of them) over a context of
        up to max_model_len."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens], query_start_loc=self.prefill_query_start_loc,
            seq_lens=self.seq_lens[:1], block_tables=self.block_tables[:1],
            max_query_len=num_tokens, max_seq_len=self.max_model_len,
            query_start_loc_cpu=[0, num_tokens], seq_lens_cpu=[self.max_model_len])

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        from nanoinfer.kernels.skinny_gemm import tune_skinny_gemm  # CUDA only: triton

        tune_skinny_gemm(self.model, self.buckets)  # cuBLAS or our skinny GEMM per (M <= 16, N, K), before capture
        self.prefill_query_start_loc.copy_(torch.tensor([0, 1]))  # the warm-up prefills: one real token each
        # Largest first, so smaller graphs reuse its memory pool.
        for graphs, size, metadata in sorted(
                [(self.graphs, bs, self._metadata(bs)) for bs in self.buckets]
                + [(self.prefill_graphs, t, self._prefill_metadata(t)) for t in self.prefill_buckets],
                key=lambda g: -g[1]):
            with set_forward_context(metadata):
                self.hidden[:size] = self.model(self.input_ids[:size], self.positions[:size])  # warm-up / autotune
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.hidden[:size] = self.model(self.input_ids[:size], self.positions[:size])
            if self.pool is None:
                self.pool = graph.pool()
            graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs (decode batch sizes %s..%s, one-sequence prefills of up to %s tokens) "
                    "in %.1f s", len(self.graphs) + len(self.prefill_graphs), self.buckets[0], self.buckets[-1],
                    self.prefill_buckets[-1] if self.prefill_buckets else 0, time.perf_counter() - start)

    def can_run(self, metadata: AttentionMetadata) -> bool:
        if metadata.is_decode_only:
            return metadata.num_seqs <= self.max_num_seqs
        return (metadata.num_seqs == 1 and bool(self.prefill_buckets)
                and metadata.query_start_loc_cpu[1] <= self.prefill_buckets[-1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        if not metadata.is_decode_only:
            return self._run_prefill(input_ids, positions, metadata)
        n = metadata.num_seqs
        bs = next(b for b in self.buckets if b >= n)
        self._copy_tokens(input_ids, positions, metadata.slot_mapping, bs)  # padding rows write nothing ...
        self.seq_lens[:n].copy_(metadata.seq_lens)
        self.seq_lens[n:bs].fill_(1)  # ... and read one (stale but valid) slot
        # Padding rows (length 1) come last in the launch order; without an order, the batch's own.
        self.seq_order[:n].copy_(metadata.seq_order if metadata.seq_order is not None else self.identity_order[:n])
        self.seq_order[n:bs].copy_(self.identity_order[n:bs])
        width = metadata.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(metadata.block_tables)
        self.graphs[bs].replay()
        return self.hidden[:n]

    def _run_prefill(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     metadata: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        size = next(t for t in self.prefill_buckets if t >= n)
        self._copy_tokens(input_ids, positions, metadata.slot_mapping, size)
        self.prefill_query_start_loc.copy_(metadata.query_start_loc)  # [0, n]: the padding tokens are no one's
        self.seq_lens[:1].copy_(metadata.seq_lens)
        width = metadata.block_tables.shape[1]
        self.block_tables[:1, :width].copy_(metadata.block_tables)
        self.prefill_graphs[size].replay()
        return self.hidden[:n]

    def _copy_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                     size: int) -> None:
        """The step's tokens into the static buffers; the padding up to `size` stores no K/V (slot -1). Its
        ids and positions are stale values of earlier steps: valid, and read by nothing that is kept."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
