"""BlockPool: the O(1) LRU free queue, ref counting, the prefix-cache map and
its self-check. A hypothesis test replays random operations against a plain
list-based reference model of the same rules."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoinfer.kv_cache.block_pool import BlockPool


def queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue]


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def cached_pool(num_blocks: int) -> BlockPool:
    """Every block allocated, registered under hash 100 + id, then freed in id order."""
    pool = BlockPool(num_blocks)
    blocks = pool.get_new_blocks(num_blocks)
    pool.cache_full_blocks(blocks, [100 + b.block_id for b in blocks], 0, num_blocks)
    pool.free_blocks(blocks)
    return pool


def test_rejects_empty_pool():
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)


def test_new_pool_is_all_free_in_id_order():
    pool = BlockPool(5)
    assert queue_ids(pool) == [0, 1, 2, 3, 4]
    assert pool.num_free_blocks == 5 and pool.usage == 0.0
    pool.check_invariants()


def test_freed_order_is_eviction_order():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(6)
    assert ids(blocks) == [0, 1, 2, 3, 4, 5] and pool.num_free_blocks == 0
    pool.free_blocks([blocks[3], blocks[1], blocks[5]])
    pool.free_blocks([blocks[0], blocks[4], blocks[2]])
    assert queue_ids(pool) == [3, 1, 5, 0, 4, 2]
    assert ids(pool.get_new_blocks(2)) == [3, 1]
    assert ids(pool.get_new_blocks(4)) == [5, 0, 4, 2]
    pool.check_invariants()


def test_free_blocks_keeps_the_given_order_even_for_a_generator():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks(reversed(blocks))
    assert queue_ids(pool) == [3, 2, 1, 0]


def test_prefix_hit_unlinks_from_the_middle_of_the_queue():
    pool = cached_pool(5)
    hit = pool.get_cached_block(102)
    assert hit is pool.blocks[2] and hit.ref_cnt == 0
    pool.touch([hit])
    assert queue_ids(pool) == [0, 1, 3, 4]
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 4
    assert hit.block_hash == 102 and pool.get_cached_block(102) is hit  # a hit keeps its hash
    # Allocation skips the held block and keeps LRU order for the others.
    assert ids(pool.get_new_blocks(4)) == [0, 1, 3, 4]
    pool.check_invariants()


def test_touch_of_the_queue_ends_and_of_a_held_block():
    pool = cached_pool(4)
    pool.touch([pool.blocks[0], pool.blocks[3]])
    assert queue_ids(pool) == [1, 2]
    pool.touch([pool.blocks[0]])  # already held: only the ref count moves
    assert pool.blocks[0].ref_cnt == 2 and queue_ids(pool) == [1, 2]
    pool.check_invariants()


def test_allocation_evicts_the_hash_of_a_cached_free_block():
    pool = cached_pool(3)
    [block] = pool.get_new_blocks(1)
    assert block.block_id == 0 and block.block_hash is None and block.ref_cnt == 1
    assert pool.get_cached_block(100) is None
    assert pool.get_cached_block(101) is pool.blocks[1]  # the others stay cached
    assert set(pool.cached_blocks) == {101, 102}
    pool.check_invariants()


def test_ref_counting_touch_and_free():
    pool = BlockPool(2)
    [block] = pool.get_new_blocks(1)
    pool.touch([block, block])
    assert block.ref_cnt == 3
    pool.free_blocks([block])
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and queue_ids(pool) == [1]  # still held: not free
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and queue_ids(pool) == [1, 0]
    pool.check_invariants()


def test_double_free_raises():
    pool = BlockPool(2)
    [block] = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([pool.blocks[1]])  # never allocated
    assert queue_ids(pool) == [1, 0]
    pool.check_invariants()


def test_asking_for_more_blocks_than_free_raises_and_takes_nothing():
    pool = cached_pool(3)
    pool.get_new_blocks(1)
    with pytest.raises(RuntimeError, match="asked for 3 blocks, 2 free"):
        pool.get_new_blocks(3)
    assert queue_ids(pool) == [1, 2] and set(pool.cached_blocks) == {101, 102}
    pool.check_invariants()


def test_unlinking_a_held_block_is_refused():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="not in the free queue"):
        pool.free_block_queue.remove(pool.get_new_blocks(1)[0])


def test_cache_full_blocks_registers_only_the_range_and_never_two_owners():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)
    pool.cache_full_blocks(a, [10, 11, 12], 1, 3)
    assert a[0].block_hash is None and (a[1].block_hash, a[2].block_hash) == (11, 12)
    b = pool.get_new_blocks(3)
    pool.cache_full_blocks(b, [10, 11, 99], 0, 3)
    assert b[0].block_hash == 10 and pool.get_cached_block(10) is b[0]
    assert b[1].block_hash is None and pool.get_cached_block(11) is a[1]  # equal block stays private
    assert b[2].block_hash == 99
    pool.cache_full_blocks(a, [77, 78, 79], 1, 3)  # already registered: hashes do not change
    assert (a[1].block_hash, a[2].block_hash) == (11, 12) and 78 not in pool.cached_blocks
    pool.check_invariants()


def test_reset_prefix_cache_only_when_idle():
    pool = cached_pool(3)
    [held] = pool.get_new_blocks(1)
    assert pool.reset_prefix_cache() is False
    assert set(pool.cached_blocks) == {101, 102} and pool.blocks[1].block_hash == 101
    pool.free_blocks([held])
    assert pool.reset_prefix_cache() is True
    assert pool.cached_blocks == {} and all(b.block_hash is None for b in pool.blocks)
    assert queue_ids(pool) == [1, 2, 0]  # LRU order survives a reset
    pool.check_invariants()


def test_usage_counts_held_blocks_only():
    pool = cached_pool(4)
    assert pool.usage == 0.0  # cached but free blocks are free
    pool.touch([pool.blocks[2]])
    pool.get_new_blocks(1)
    assert pool.usage == 0.5


def _corrupt_free_ref_count(pool):
    pool.blocks[1].ref_cnt = 1


def _corrupt_held_ref_count(pool):
    pool.blocks[0].ref_cnt = 0


def _corrupt_negative_ref_count(pool):
    pool.blocks[0].ref_cnt = -1


def _corrupt_free_count(pool):
    pool.free_block_queue.num_free_blocks += 1


def _corrupt_queue_a_held_block(pool):
    pool.free_block_queue.append(pool.blocks[0])


def _corrupt_queue_a_block_twice(pool):
    pool.free_block_queue.append(pool.blocks[2])


def _corrupt_cached_map(pool):
    pool.cached_blocks[999] = pool.blocks[3]


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (_corrupt_free_ref_count, "queued=True"),
        (_corrupt_held_ref_count, "queued=False"),
        (_corrupt_negative_ref_count, "negative ref count"),
        (_corrupt_free_count, "free count drifted"),
        (_corrupt_queue_a_held_block, "queued=True"),
        (_corrupt_queue_a_block_twice, "queued twice|free count drifted"),
        (_corrupt_cached_map, "cached under another hash"),
    ],
)
def test_check_invariants_catches_corruption(corrupt, message):
    pool = cached_pool(4)
    pool.get_new_blocks(1)  # block 0 held, 1..3 free and cached
    pool.check_invariants()
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        pool.check_invariants()


# ----- property test against a reference model -----

ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 4)),
        st.tuples(st.just("free"), st.lists(st.integers(0, 63), max_size=6)),
        st.tuples(st.just("touch"), st.lists(st.integers(0, 15), max_size=4)),
        st.tuples(st.just("cache"), st.integers(0, 63), st.integers(0, 5)),
        st.tuples(st.just("reset"),),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 8), ops=ops)
def test_pool_matches_a_list_model(num_blocks, ops):
    """The pool behaves like: a list of free ids (append on free, pop from the front
    on allocate, remove anywhere on touch), per-block ref counts and a hash map."""
    pool = BlockPool(num_blocks)
    queue = list(range(num_blocks))
    refs = [0] * num_blocks
    hash_of: dict[int, int] = {}  # block id -> hash
    held: list[int] = []  # one entry per reference
    for op in ops:
        if op[0] == "alloc":
            n = op[1]
            if n > len(queue):
                with pytest.raises(RuntimeError):
                    pool.get_new_blocks(n)
            else:
                assert ids(pool.get_new_blocks(n)) == queue[:n]
                for b in queue[:n]:
                    refs[b] = 1
                    hash_of.pop(b, None)
                    held.append(b)
                del queue[:n]
        elif op[0] == "free":
            picks = [held[i % len(held)] for i in op[1]] if held else []
            picks = [b for i, b in enumerate(picks) if picks[: i + 1].count(b) <= held.count(b)]
            pool.free_blocks(pool.blocks[b] for b in picks)
            for b in picks:
                held.remove(b)
                refs[b] -= 1
                if refs[b] == 0:
                    queue.append(b)
        elif op[0] == "touch":
            targets = sorted({v % num_blocks for v in op[1]} & ({*hash_of} | {*held}))
            pool.touch(pool.blocks[b] for b in targets)
            for b in targets:
                if refs[b] == 0:
                    queue.remove(b)
                refs[b] += 1
                held.append(b)
        elif op[0] == "cache":
            if held:
                b = held[op[1] % len(held)]
                h = op[2]
                pool.cache_full_blocks([pool.blocks[b]], [h], 0, 1)
                if b not in hash_of and h not in hash_of.values():
                    hash_of[b] = h
        else:
            assert pool.reset_prefix_cache() is (not held)
            if not held:
                hash_of.clear()
        assert queue_ids(pool) == queue
        assert [b.ref_cnt for b in pool.blocks] == refs
        assert {h: b.block_id for h, b in pool.cached_blocks.items()} == {h: b for b, h in hash_of.items()}
        assert pool.num_free_blocks == len(queue)
        pool.check_invariants()
