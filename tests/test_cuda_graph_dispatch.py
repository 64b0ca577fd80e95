"""Which steps the CUDA-graph runner replays (decode batches up to max_num_seqs, one sequence's prefill up to
the largest token bucket) and which run eagerly. The rules are host logic, checked here on CPU tensors; the
captured graphs themselves are checked on the GPU (tests/gpu/test_engine_gpu.py)."""

from __future__ import annotations

import torch

from nanoinfer.attention.metadata import AttentionMetadata
from nanoinfer.model_runner.cuda_graph import CUDAGraphRunner, batch_size_buckets, prefill_buckets


def runner(prefill: bool = True, max_num_batched_tokens: int = 8192) -> CUDAGraphRunner:
    return CUDAGraphRunner(torch.nn.Identity(), hidden_size=8, dtype=torch.float32, device=torch.device("cpu"),
                           max_num_seqs=4, max_model_len=2048, block_size=16,
                           max_num_batched_tokens=max_num_batched_tokens, prefill=prefill)


def step(q_lens: list[int], context: int = 600) -> AttentionMetadata:
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.long), query_start_loc=torch.tensor(starts),
        seq_lens=torch.full((len(q_lens),), context), block_tables=torch.zeros(len(q_lens), 40, dtype=torch.int32),
        max_query_len=max(q_lens), max_seq_len=context, query_start_loc_cpu=starts, seq_lens_cpu=[context] * len(q_lens))


def test_buckets():
    assert batch_size_buckets(256)[:6] == [1, 2, 4, 8, 16, 32] and batch_size_buckets(256)[-1] == 256
    assert prefill_buckets(16384, 2048) == [16, 32, 64, 128, 256, 512]
    assert prefill_buckets(8192, 100) == [16, 32, 64]  # no bucket a step could not fill
    assert prefill_buckets(24, 2048) == [16]


def test_decode_batches_and_one_sequence_prefills_replay_graphs():
    graphs = runner()
    assert graphs.can_run(step([1, 1, 1, 1]))
    assert not graphs.can_run(step([1] * 5))  # more sequences than the largest decode bucket
    assert graphs.can_run(step([5])) and graphs.can_run(step([512]))  # a prompt, or a chunk over a cached prefix
    assert not graphs.can_run(step([513]))
    assert not graphs.can_run(step([5, 1]))  # a prefill beside a decode: eager
    # Static buffers hold the largest bucket of either kind.
    assert graphs.input_ids.shape[0] == graphs.slot_mapping.shape[0] == graphs.hidden.shape[0] == 512


def test_no_prefill_graphs_when_turned_off_or_no_bucket_fits():
    for graphs in (runner(prefill=False), runner(max_num_batched_tokens=8)):
        assert graphs.prefill_buckets == [] and not graphs.can_run(step([5]))
        assert graphs.can_run(step([1, 1])) and graphs.input_ids.shape[0] == 4
