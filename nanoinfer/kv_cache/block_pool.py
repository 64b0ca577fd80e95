"""KV blocks as metadata, the LRU free queue and the prefix-cache map.

A block is an id into the one preallocated KV tensor plus bookkeeping. Every
operation here is O(1) per block:

* free blocks sit in a doubly linked queue in LRU order (least recently freed
  first); a block keeps its hash while free, so it can still be hit;
* a prefix hit on a free block unlinks it from the middle of the queue;
* allocation pops from the head, evicting the block's hash if it had one.

Invariants (checked by `check_invariants`): a block is in the free queue iff
its ref count is 0; `cached_blocks[h].block_hash == h`; ids are unique.
"""

from __future__ import annotations

from typing import Iterable


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Intrusive doubly linked list with sentinels: no allocation per operation."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.head, self.tail = KVCacheBlock(-1), KVCacheBlock(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self.tail.prev_free = self.tail, block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free, block.next_free.prev_free = block.next_free, block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVCacheBlock:
        if self.num_free_blocks == 0:
            raise RuntimeError("no free KV blocks")
        block = self.head.next_free
        self.remove(block)
        return block

    def __iter__(self):
        block = self.head.next_free
        while block is not self.tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[int, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take shared ownership of prefix-hit blocks; free ones leave the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        new = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            new.append(block)
        return new

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take blocks out of the prefix cache (no request can hit them again); who holds them keeps them."""
        for block in blocks:
            self._evict(block)

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[int], start: int, end: int) -> None:
        """Register blocks[start:end] (now full) under their hashes. If an equal
        block is cached already, this one stays private: never two owners of a hash."""
        for block, block_hash in zip(blocks[start:end], block_hashes[start:end]):
            if block.block_hash is None and block_hash not in self.cached_blocks:
                block.block_hash = block_hash
                self.cached_blocks[block_hash] = block

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; those reaching 0 join the queue's
        tail in the given order, so the first given are evicted first."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (debug mode, tests)."""
        queued = list(self.free_block_queue)
        assert len(queued) == self.free_block_queue.num_free_blocks, "free count drifted from the queue"
        assert len({b.block_id for b in queued}) == len(queued), "a block is queued twice"
        for block in self.blocks:
            in_queue = block.prev_free is not None
            assert in_queue == (block.ref_cnt == 0), f"{block}: queued={in_queue}"
            assert block.ref_cnt >= 0, f"{block}: negative ref count"
        for block_hash, block in self.cached_blocks.items():
            assert block.block_hash == block_hash, f"{block} is cached under another hash"
