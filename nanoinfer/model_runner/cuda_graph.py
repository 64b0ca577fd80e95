"""CUDA graphs for decode-only steps and for mixed (prefill) steps.

A decode step of a small model is mostly kernel-launch overhead: ~15 kernels
per layer, each a few microseconds of CPU. We capture the model's forward once
per batch-size bucket over static input buffers and replay it; a step pads its
batch up to the next bucket. The graph's attention is launched for the longest
possible context (max_model_len), so one capture serves every sequence length;
the kernels stop at each sequence's real length. Block tables are sized for
max_model_len plus one block, so no bucket ever overflows its buffer.

A step that prefills, with up to `MIXED_TOKEN_BUCKETS[-1]` tokens from up to
`MIXED_SEQ_BUCKETS[-1]` sequences (one prompt alone, the single-stream time to
first token, or a prompt or chunk beside a few decodes, as a server at low load
runs them), is launch-bound the same way (a 128-token prefill: ~12 ms of host
work for ~1.2 ms of GPU work on an H200), so it replays a graph captured per
(token bucket, sequence bucket). Larger steps (a burst of prompts: an offline
batch, a loaded server) are still host-bound when eager (16,384 tokens: ~39 ms
of host for ~34 ms of GPU work), so they replay one graph per doubling of the
token count up to `max_num_batched_tokens`, each with room for `max_num_seqs`
sequences. The attention kernel maps its programs to sequences from
`query_start_loc` on the GPU, so one graph serves every split of its tokens into
sequences: padding tokens belong to no sequence (their tiles leave at once) and
write no KV (slot -1), and padding sequences are empty. Under tensor parallelism
the graphs hold the steps' all-reduces too (our symmetric-memory kernel up to
`max_num_seqs` rows, NCCL above): every rank captures the same graphs in the same
order and replays the same one each step, since they all see the same metadata."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from nanoinfer.attention.metadata import AttentionMetadata, set_forward_context

logger = logging.getLogger("nanoinfer")


MIXED_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024)
MIXED_SEQ_BUCKETS = (1, 4, 16, 64)


def batch_size_buckets(max_num_seqs: int) -> list[int]:
    buckets = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return buckets + [max_num_seqs]


def mixed_buckets(max_num_batched_tokens: int, max_num_seqs: int) -> list[tuple[int, int]]:
    """(tokens, sequences) of the mixed-step graphs, sorted by tokens: every token bucket a step can fill, with
    every sequence bucket up to max_num_seqs that its tokens can hold (a sequence has at least one token); past
    the last token bucket, one per doubling up to max_num_batched_tokens, with room for max_num_seqs."""
    seqs = sorted({min(b, max_num_seqs) for b in MIXED_SEQ_BUCKETS})
    buckets = [(t, n) for t in MIXED_TOKEN_BUCKETS if t <= max_num_batched_tokens for n in seqs if n <= t]
    tokens = MIXED_TOKEN_BUCKETS[-1]
    while tokens < max_num_batched_tokens:
        tokens = min(2 * tokens, max_num_batched_tokens)
        buckets.append((tokens, max_num_seqs))
    return buckets


class CUDAGraphRunner:
    def __init__(self, model: nn.Module, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 max_num_seqs: int, max_model_len: int, block_size: int, max_num_batched_tokens: int) -> None:
        self.model = model
        self.buckets = batch_size_buckets(max_num_seqs)
        self.mixed_buckets = mixed_buckets(max_num_batched_tokens, max_num_seqs)
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        max_blocks = -(-max_model_len // block_size) + 1
        n = max_num_seqs
        tokens = max([n, *(t for t, _ in self.mixed_buckets)])  # a decode row per sequence, or a mixed step's
        self.input_ids = torch.zeros(tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.mixed_query_start_loc = torch.zeros(max([0, *(m for _, m in self.mixed_buckets)]) + 1, dtype=torch.int32,
                                                 device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.identity_order = torch.arange(n, dtype=torch.int32, device=device)
        self.seq_order = self.identity_order.clone()
        self.hidden = torch.zeros(tokens, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.mixed_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
            max_query_len=1, max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(bs + 1)), seq_lens_cpu=[self.max_model_len] * bs,
            seq_order=self.seq_order[:bs])

    def _mixed_metadata(self, num_tokens: int, num_seqs: int) -> AttentionMetadata:
        """`num_tokens` new tokens of up to `num_seqs` sequences (query tiles launched for every split of the
        tokens into sequences) over contexts of up to max_model_len."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens], query_start_loc=self.mixed_query_start_loc[: num_seqs + 1],
            seq_lens=self.seq_lens[:num_seqs], block_tables=self.block_tables[:num_seqs],
            max_query_len=num_tokens, max_seq_len=self.max_model_len,
            query_start_loc_cpu=[0] + [num_tokens] * num_seqs, seq_lens_cpu=[self.max_model_len] * num_seqs)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        from nanoinfer.kernels.skinny_gemm import tune_skinny_gemm  # CUDA only: triton

        tune_skinny_gemm(self.model, self.buckets)  # cuBLAS or our skinny GEMM per (M <= 16, N, K), before capture
        self.mixed_query_start_loc.fill_(1)  # the warm-up mixed steps: one real token, of the first sequence
        self.mixed_query_start_loc[0] = 0
        # Largest first, so smaller graphs reuse its memory pool.
        for graphs, key, size, metadata in sorted(
                [(self.graphs, bs, bs, self._metadata(bs)) for bs in self.buckets]
                + [(self.mixed_graphs, (t, m), t, self._mixed_metadata(t, m)) for t, m in self.mixed_buckets],
                key=lambda g: -g[2]):
            with set_forward_context(metadata):
                self.hidden[:size] = self.model(self.input_ids[:size], self.positions[:size])  # warm-up / autotune
                torch.cuda.synchronize()
                # The warm-up's activations were cached outside the graphs' pool: give them back before the
                # capture needs as much again (a 16,384-token step's, beside the KV cache sized for one such peak).
                torch.cuda.empty_cache()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.hidden[:size] = self.model(self.input_ids[:size], self.positions[:size])
            if self.pool is None:
                self.pool = graph.pool()
            graphs[key] = graph
        torch.cuda.synchronize()
        largest = self.mixed_buckets[-1] if self.mixed_buckets else (0, 0)
        logger.info("captured %d CUDA graphs (decode batch sizes %s..%s; mixed steps of up to %s tokens from up to "
                    "%s sequences) in %.1f s", len(self.graphs) + len(self.mixed_graphs), self.buckets[0],
                    self.buckets[-1], *largest, time.perf_counter() - start)

    def can_run(self, metadata: AttentionMetadata) -> bool:
        if metadata.is_decode_only:
            return metadata.num_seqs <= self.max_num_seqs
        return self._mixed_bucket(metadata.query_start_loc_cpu[-1], metadata.num_seqs) is not None

    def _mixed_bucket(self, num_tokens: int, num_seqs: int) -> tuple[int, int] | None:
        """The smallest mixed-step graph that holds the step (buckets are sorted by tokens, then sequences)."""
        return next(((t, m) for t, m in self.mixed_buckets if t >= num_tokens and m >= num_seqs), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        if not metadata.is_decode_only:
            return self._run_mixed(input_ids, positions, metadata)
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

    def _run_mixed(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   metadata: AttentionMetadata) -> torch.Tensor:
        n, s = input_ids.shape[0], metadata.num_seqs
        size, seqs = self._mixed_bucket(n, s)
        self._copy_tokens(input_ids, positions, metadata.slot_mapping, size)
        self.mixed_query_start_loc[: s + 1].copy_(metadata.query_start_loc)
        self.mixed_query_start_loc[s + 1 : seqs + 1].fill_(n)  # padding sequences: empty; padding tokens: no one's
        self.seq_lens[:s].copy_(metadata.seq_lens)
        width = metadata.block_tables.shape[1]
        self.block_tables[:s, :width].copy_(metadata.block_tables)
        self.mixed_graphs[(size, seqs)].replay()
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
