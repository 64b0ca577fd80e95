"""Which steps the CUDA-graph runner replays (decode batches up to max_num_seqs, mixed steps in token and
sequence buckets, and past 1024 tokens one graph per doubling up to the token budget) and which run eagerly.
The rules are host logic, checked here on CPU tensors; the captured graphs themselves are checked on the GPU
(tests/gpu/test_engine_gpu.py)."""

from __future__ import annotations

import torch

from nanoinfer.attention.metadata import AttentionMetadata
from nanoinfer.model_runner.cuda_graph import CUDAGraphRunner, batch_size_buckets, mixed_buckets


def runner(max_num_batched_tokens: int = 8192, max_num_seqs: int = 4) -> CUDAGraphRunner:
    return CUDAGraphRunner(torch.nn.Identity(), hidden_size=8, dtype=torch.float32, device=torch.device("cpu"),
                           max_num_seqs=max_num_seqs, max_model_len=2048, block_size=16,
                           max_num_batched_tokens=max_num_batched_tokens)


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
    full = mixed_buckets(16384, 256)
    assert sorted({t for t, _ in full}) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    assert len(full) == 3 + 3 + 5 * 4 + 4
    assert full[:4] == [(16, 1), (16, 4), (16, 16), (32, 1)]
    assert full[-8:] == [(1024, 1), (1024, 4), (1024, 16), (1024, 64), (2048, 256), (4096, 256), (8192, 256), (16384, 256)]
    assert mixed_buckets(10000, 128)[-4:] == [(2048, 128), (4096, 128), (8192, 128), (10000, 128)]  # the budget last
    assert mixed_buckets(1000, 256)[-1] == (512, 64)  # within the token buckets: no larger graph
    assert all(m <= t for t, m in full)  # a sequence has at least one token
    assert mixed_buckets(100, 8) == [(16, 1), (16, 4), (16, 8), (32, 1), (32, 4), (32, 8), (64, 1), (64, 4), (64, 8)]
    assert mixed_buckets(8, 256) == []  # no token bucket a step could fill


def test_decode_batches_and_small_mixed_steps_replay_graphs():
    graphs = runner()
    assert graphs.can_run(step([1, 1, 1, 1]))
    assert not graphs.can_run(step([1] * 5))  # more sequences than the largest decode bucket
    assert graphs.can_run(step([5])) and graphs.can_run(step([1024]))  # a prompt, or a chunk over a cached prefix
    assert graphs.can_run(step([5, 1])) and graphs.can_run(step([1000, 1, 1, 1]))  # prefills beside decodes
    assert graphs._mixed_bucket(5, 1) == (16, 1) and graphs._mixed_bucket(17, 2) == (32, 4)
    assert graphs._mixed_bucket(600, 4) == (1024, 4)
    # Past 1024 tokens, one graph per doubling up to the budget (8192 here), room for every sequence.
    assert graphs._mixed_bucket(1025, 1) == (2048, 4) and graphs._mixed_bucket(5000, 4) == (8192, 4)
    assert graphs.can_run(step([8000, 1, 1])) and not graphs.can_run(step([8190, 1, 1, 1]))  # past the budget
    # Static buffers hold the largest bucket of either kind.
    assert graphs.input_ids.shape[0] == graphs.slot_mapping.shape[0] == graphs.hidden.shape[0] == 8192
    assert graphs.mixed_query_start_loc.shape[0] == 5


def test_mixed_steps_beyond_the_sequence_buckets_take_a_large_graph_or_run_eagerly():
    graphs = runner(max_num_seqs=128)
    assert graphs._mixed_bucket(163, 64) == (256, 64)
    assert graphs._mixed_bucket(164, 65) == (2048, 128)  # more sequences than 64: the large graphs hold them all
    assert graphs.can_run(step([1] * 128))  # decode-only: the decode buckets
    small = runner(max_num_batched_tokens=1024, max_num_seqs=128)  # no graph past the token buckets
    assert small.can_run(step([100] + [1] * 63)) and not small.can_run(step([100] + [1] * 64))


def test_no_mixed_graphs_when_no_bucket_fits():
    graphs = runner(max_num_batched_tokens=8)
    assert graphs.mixed_buckets == [] and not graphs.can_run(step([5]))
    assert graphs.can_run(step([1, 1])) and graphs.input_ids.shape[0] == 4
