"""Prefix-cache hashing and the KV cache manager: block sharing on prefix hits,
all-or-nothing allocation, free order, salts and statistics."""

from array import array

import pytest

import nanoinfer.kv_cache.hashing as hashing
from nanoinfer.lora.request import LoRARequest
from nanoinfer.kv_cache.hashing import extend_block_hashes, first_block_key, hash_block_tokens
from nanoinfer.kv_cache.manager import KVCacheManager
from nanoinfer.request import Request
from nanoinfer.sampling_params import SamplingParams

BS = 4


def make_request(request_id: str, prompt: list[int], cache_salt: str | None = None, block_size: int = BS) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=8), set(), block_size, 8, cache_salt=cache_salt)


def hashes(tokens: list[int], salt: str | None = None, block_size: int = BS) -> list[int]:
    out: list[int] = []
    extend_block_hashes(out, tokens, block_size, first_block_key(salt))
    return out


def run_prefill(kv: KVCacheManager, request: Request) -> None:
    """Admit a request the way the scheduler does and mark its prompt computed."""
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hits, num_hit) is not None
    request.num_computed_tokens = request.num_tokens


def pool_state(kv: KVCacheManager):
    pool = kv.pool
    return (
        [b.block_id for b in pool.free_block_queue],
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        {h: b.block_id for h, b in pool.cached_blocks.items()},
        {r: [b.block_id for b in blocks] for r, blocks in kv.req_to_blocks.items()},
        dict(kv.num_cached_blocks),
    )


# ----- hashing -----


def test_hash_is_chained_over_the_whole_prefix():
    a = hashes([1, 2, 3, 4, 5, 6, 7, 8])
    b = hashes([9, 2, 3, 4, 5, 6, 7, 8])  # same second block, different first
    assert len(a) == len(b) == 2
    assert a[0] != b[0] and a[1] != b[1]
    assert hashes([1, 2, 3, 4, 5, 6, 7, 8]) == a  # deterministic
    assert hashes([1, 2, 3, 4, 5, 6, 8, 7])[1] != a[1]  # order inside a block matters
    assert hash_block_tokens(None, array("q", [5, 6, 7, 8]).tobytes()) != a[1]  # the parent is part of the key


def test_salt_changes_every_block_hash():
    tokens = list(range(3 * BS))
    plain, salted, other = hashes(tokens), hashes(tokens, "tenant-a"), hashes(tokens, "tenant-b")
    assert len(plain) == len(salted) == len(other) == 3
    for i in range(3):
        assert len({plain[i], salted[i], other[i]}) == 3
    assert hashes(tokens, "tenant-a") == salted


@pytest.mark.parametrize("num_tokens", range(0, 3 * BS + 1))
def test_only_full_blocks_are_hashed(num_tokens):
    tokens = list(range(100, 100 + num_tokens))
    assert hashes(tokens) == hashes(list(range(100, 100 + 3 * BS)))[: num_tokens // BS]


def test_incremental_hashing_matches_and_hashes_each_block_once(monkeypatch):
    calls = []
    real = hashing.hash_block_tokens
    monkeypatch.setattr(hashing, "hash_block_tokens", lambda *a: calls.append(a) or real(*a))
    tokens = [7, 3, 9, 1, 4, 4, 2, 8, 6, 5, 0]
    incremental: list[int] = []
    for n in range(len(tokens) + 1):
        extend_block_hashes(incremental, tokens[:n], BS, first_block_key("s"))
    assert len(calls) == len(tokens) // BS
    assert incremental == hashes(tokens, "s")


def test_lora_adapter_is_part_of_the_first_block_key():
    """An adapter's KV differs from the base model's for the same tokens: its blocks hash apart, from each other
    adapter's, and from any salt's (0xff, which UTF-8 never holds, leads the adapter's part)."""
    plain, adapter_1 = first_block_key(None), first_block_key(None, 1)
    assert len({plain, adapter_1, first_block_key(None, 2), first_block_key("s", 1), first_block_key("s")}) == 5
    assert first_block_key("s", 1).startswith("s".encode()) and b"\xff" not in "s\u00ff\U0001f600".encode()
    request = Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=8), set(), BS, 8,
                      lora_request=LoRARequest("a", 1, "/adapters/a"))
    assert request.block_hashes != hashes([1, 2, 3, 4]) and request.first_block_key == adapter_1


def test_request_extends_its_hashes_as_tokens_arrive():
    request = make_request("r", [1, 2, 3, 4, 5, 6], cache_salt="x")
    assert request.block_hashes == hashes([1, 2, 3, 4], "x")
    for token in (7, 8, 9, 10, 11):
        request.append_output_token(token, max_model_len=1000)
    assert request.block_hashes == hashes(list(range(1, 12)), "x")


# ----- manager -----


def test_prefix_hit_shares_physical_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(10)))
    run_prefill(kv, a)
    a_blocks = kv.req_to_blocks["a"]
    assert len(a_blocks) == 3 and kv.num_free_blocks == 7
    b = make_request("b", list(range(8)) + [50, 51, 52])
    hits, num_hit = kv.get_computed_blocks(b)
    assert hits == a_blocks[:2] and num_hit == 8
    new = kv.allocate_slots(b, b.num_tokens - num_hit, hits, num_hit)
    assert len(new) == 1 and new[0] not in a_blocks
    b_blocks = kv.req_to_blocks["b"]
    assert b_blocks[0] is a_blocks[0] and b_blocks[1] is a_blocks[1]  # the same objects: nothing copied
    assert [blk.ref_cnt for blk in a_blocks] == [2, 2, 1]
    assert kv.num_free_blocks == 6
    kv.check_invariants()


def test_the_last_token_is_never_a_hit():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    run_prefill(kv, make_request("a", list(range(12))))
    assert kv.get_computed_blocks(make_request("same", list(range(12))))[1] == 8
    assert kv.get_computed_blocks(make_request("longer", list(range(13))))[1] == 12
    assert kv.get_computed_blocks(make_request("one", [0]))[1] == 0


def test_only_blocks_full_and_scheduled_are_registered():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(10)))
    kv.allocate_slots(a, 6)  # a prefill chunk ending inside block 1
    a.num_computed_tokens = 6
    assert [b.block_hash for b in kv.req_to_blocks["a"]] == [a.block_hashes[0], None]
    kv.allocate_slots(a, 4)
    assert [b.block_hash for b in kv.req_to_blocks["a"]] == [*a.block_hashes, None]
    assert kv.num_cached_blocks["a"] == 2


def test_hit_on_freed_blocks_revives_them_before_allocating():
    """The hit blocks sit at the head of the free queue; a careless allocation
    would evict and reuse them for the same request."""
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(9)))
    run_prefill(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 3
    kv.pool.touch(kv.pool.blocks)  # reorder so the hit blocks are evicted first
    kv.pool.free_blocks([kv.pool.blocks[0], kv.pool.blocks[1], kv.pool.blocks[2]])
    b = make_request("b", list(range(8)) + [70, 71, 72, 73])
    hits, num_hit = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and num_hit == 8
    new = kv.allocate_slots(b, b.num_tokens - num_hit, hits, num_hit)
    assert [blk.block_id for blk in new] == [2]
    assert kv.get_block_ids("b") == [0, 1, 2]
    assert [blk.block_hash for blk in hits] == b.block_hashes[:2]
    kv.check_invariants()


@pytest.mark.parametrize("with_hits", [False, True])
def test_failed_allocation_returns_none_and_changes_nothing(with_hits):
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(9)))
    run_prefill(kv, a)  # 3 blocks, two of them cached
    if with_hits:
        kv.free(a)  # cached and free: a hit must revive them, which uses free space
        b = make_request("b", list(range(8)) + list(range(50, 59)))  # needs 2 hits + 3 new > 4 free
    else:
        b = make_request("b", list(range(50, 59)))  # needs 3 blocks, 1 free
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == (8 if with_hits else 0)
    before = pool_state(kv)
    assert kv.allocate_slots(b, b.num_tokens - num_hit, hits, num_hit) is None
    assert pool_state(kv) == before
    assert "b" not in kv.req_to_blocks
    kv.check_invariants()


def test_failed_allocation_of_a_running_request_keeps_its_blocks():
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    a = make_request("a", list(range(8)))
    run_prefill(kv, a)
    a.append_output_token(9, max_model_len=1000)
    before = pool_state(kv)
    assert kv.allocate_slots(a, 1) is None
    assert pool_state(kv) == before


def test_allocation_succeeds_exactly_when_enough_blocks_are_free():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    assert kv.allocate_slots(make_request("a", list(range(13))), 13) is None  # 4 blocks
    new = kv.allocate_slots(make_request("b", list(range(12))), 12)
    assert len(new) == 3 and kv.num_free_blocks == 0


def test_free_puts_the_tail_block_first_in_line_for_eviction():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(12)))
    run_prefill(kv, a)
    a_ids = kv.get_block_ids("a")
    kv.free(a)
    assert [b.block_id for b in kv.pool.free_block_queue][-3:] == a_ids[::-1]
    assert "a" not in kv.req_to_blocks and "a" not in kv.num_cached_blocks
    kv.free(a)  # freeing twice is a no-op, not a double free
    kv.check_invariants()


def test_freeing_one_sharer_keeps_shared_blocks_held():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a, b = make_request("a", list(range(9))), make_request("b", list(range(9)))
    run_prefill(kv, a)
    run_prefill(kv, b)
    shared = kv.req_to_blocks["a"][:2]
    kv.free(a)
    assert [blk.ref_cnt for blk in shared] == [1, 1]
    assert not {blk.block_id for blk in shared} & {blk.block_id for blk in kv.pool.free_block_queue}
    kv.free(b)
    assert kv.num_free_blocks == 8
    kv.check_invariants()


def test_cache_salt_isolates_tenants():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(13))
    run_prefill(kv, make_request("a", prompt, cache_salt="alice"))
    assert kv.get_computed_blocks(make_request("b", prompt, cache_salt="bob"))[1] == 0
    assert kv.get_computed_blocks(make_request("c", prompt))[1] == 0
    assert kv.get_computed_blocks(make_request("d", prompt, cache_salt="alice"))[1] == 12
    run_prefill(kv, make_request("e", prompt))
    assert kv.get_computed_blocks(make_request("f", prompt))[1] == 12


def test_prefix_stats_count_tokens():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    run_prefill(kv, make_request("a", list(range(10))))
    assert (kv.prefix_queries, kv.prefix_hits) == (10, 0)
    run_prefill(kv, make_request("b", list(range(9)) + [99]))
    assert (kv.prefix_queries, kv.prefix_hits) == (20, 8)


def test_prefix_stats_leave_out_recomputes_and_requests_that_read_no_cache():
    """As vLLM's: a recompute after preemption finds its own blocks again (not a prefix hit), and a request
    with prompt logprobs makes no lookup."""
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(10)))
    run_prefill(kv, a)
    kv.free(a)
    a.num_computed_tokens, a.num_preemptions = 0, 1  # preempted: recomputed from the start
    run_prefill(kv, a)
    logprobs = Request("b", list(range(10)), SamplingParams(max_tokens=8, prompt_logprobs=1), set(), BS, 8)
    assert logprobs.skip_reading_prefix_cache
    run_prefill(kv, logprobs)
    assert (kv.prefix_queries, kv.prefix_hits) == (10, 0)


def test_caching_disabled_never_hits_nor_registers():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    a = make_request("a", list(range(9)))
    run_prefill(kv, a)
    assert kv.pool.cached_blocks == {}
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert (kv.prefix_queries, kv.prefix_hits) == (0, 0)


def test_reset_prefix_cache_through_the_manager():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(9)))
    run_prefill(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(make_request("b", list(range(9))))[1] == 0


def test_usage_follows_held_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(8)))
    run_prefill(kv, a)
    assert kv.usage == 0.5
    kv.free(a)
    assert kv.usage == 0.0


def test_check_invariants_catches_a_holder_mismatch():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    run_prefill(kv, make_request("a", list(range(8))))
    kv.check_invariants()
    kv.req_to_blocks["ghost"] = [kv.pool.blocks[kv.get_block_ids("a")[0]]]  # shared without a ref
    with pytest.raises(AssertionError, match="1 holders|2 holders"):
        kv.check_invariants()
