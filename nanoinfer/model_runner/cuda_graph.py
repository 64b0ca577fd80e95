"""CUDA graphs for decode-only steps.

A decode step of a small model is mostly kernel-launch overhead: ~15 kernels
per layer, each a few microseconds of CPU. We capture the model's forward once
per batch-size bucket over static input buffers and replay it; a step pads its
batch up to the next bucket. The graph's attention is launched for the longest
possible context (max_model_len), so one capture serves every sequence length;
the kernels stop at each sequence's real length. Block tables are sized for
max_model_len plus one block, so no bucket ever overflows its buffer."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from nanoinfer.attention.metadata import AttentionMetadata, set_forward_context

logger = logging.getLogger("nanoinfer")


def batch_size_buckets(max_num_seqs: int) -> list[int]:
    buckets = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return buckets + [max_num_seqs]


class CUDAGraphRunner:
    def __init__(self, model: nn.Module, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 max_num_seqs: int, max_model_len: int, block_size: int) -> None:
        self.model = model
        self.buckets = batch_size_buckets(max_num_seqs)
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        max_blocks = -(-max_model_len // block_size) + 1
        n = max_num_seqs
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.identity_order = torch.arange(n, dtype=torch.int32, device=device)
        self.seq_order = self.identity_order.clone()
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
            max_query_len=1, max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(bs + 1)), seq_lens_cpu=[self.max_model_len] * bs,
            seq_order=self.seq_order[:bs])

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        from nanoinfer.kernels.skinny_gemm import tune_skinny_gemm  # CUDA only: triton

        tune_skinny_gemm(self.model, self.buckets)  # cuBLAS or our skinny GEMM per (M <= 16, N, K), before capture
        for bs in reversed(self.buckets):  # largest first, so smaller graphs reuse its memory pool
            metadata = self._metadata(bs)
            with set_forward_context(metadata):
                self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs])  # warm-up / autotune
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs])
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs (batch sizes %s..%s) in %.1f s", len(self.graphs), self.buckets[0],
                    self.buckets[-1], time.perf_counter() - start)

    def can_run(self, metadata: AttentionMetadata) -> bool:
        return metadata.is_decode_only and metadata.num_seqs <= self.max_num_seqs

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        n = metadata.num_seqs
        bs = next(b for b in self.buckets if b >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.slot_mapping[n:bs].fill_(-1)  # padding rows write nothing ...
        self.seq_lens[:n].copy_(metadata.seq_lens)
        self.seq_lens[n:bs].fill_(1)  # ... and read one (stale but valid) slot
        # Padding rows (length 1) come last in the launch order; without an order, the batch's own.
        self.seq_order[:n].copy_(metadata.seq_order if metadata.seq_order is not None else self.identity_order[:n])
        self.seq_order[n:bs].copy_(self.identity_order[n:bs])
        width = metadata.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(metadata.block_tables)
        self.graphs[bs].replay()
        return self.hidden[:n]
