"""Per-request block tables on top of the block pool: prefix lookups, lazy
allocation as tokens are scheduled, and freeing. Pure Python over metadata."""

from __future__ import annotations

from nanoinfer.kv_cache.block_pool import BlockPool, KVCacheBlock
from nanoinfer.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # how many of a request's blocks are registered
        # Prefix-cache statistics, in tokens (exported as metrics).
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks matching the request's prefix.

        The last token is always left to compute: the model must produce logits for it."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        Returns the newly allocated blocks, or None (and changes nothing) when
        the pool cannot supply them; the scheduler then preempts and retries."""
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        end = num_computed + num_new_tokens
        num_new_blocks = cdiv(end, self.block_size) - len(blocks) - len(new_computed_blocks)
        new_blocks: list[KVCacheBlock] = []
        # A decode step runs this for every request, and most have room in their last block: they skip to the
        # caching below. Admission (nothing computed yet) always takes this path, for its prefix statistics.
        if num_new_blocks > 0 or new_computed_blocks or request.num_computed_tokens == 0:
            num_new_blocks = max(0, num_new_blocks)
            # Hit blocks that are free leave the queue too, so they use up free space.
            num_reviving = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
            if num_new_blocks + num_reviving > self.pool.num_free_blocks:
                if not blocks:
                    del self.req_to_blocks[request.request_id]
                return None
            if (self.enable_caching and request.num_computed_tokens == 0 and request.num_preemptions == 0
                    and not request.skip_reading_prefix_cache):
                # A first admission's lookup, once it succeeded (vLLM's counts: a recompute after preemption
                # finds its own blocks, and a request that reads no cache made no lookup).
                self.prefix_queries += request.num_tokens
                self.prefix_hits += num_new_computed_tokens
            if new_computed_blocks:
                self.pool.touch(new_computed_blocks)
                blocks.extend(new_computed_blocks)
            new_blocks = self.pool.get_new_blocks(num_new_blocks)
            blocks.extend(new_blocks)
        if self.enable_caching:
            # Blocks whose tokens are all known and will be computed this step.
            num_full = min(end // self.block_size, len(request.block_hashes))
            start = self.num_cached_blocks.get(request.request_id, 0)
            if num_full > start:
                self.pool.cache_full_blocks(blocks, request.block_hashes, start, num_full)
                self.num_cached_blocks[request.request_id] = num_full
        return new_blocks

    def free(self, request: Request, uncache_computed: bool = False) -> None:
        """Release all of a request's blocks; tail blocks first, so they are evicted first. `uncache_computed`: the
        blocks it computed itself (past its prefix hit) leave the prefix cache, for a request that failed, whose KV
        may be wrong (an adapter that could not be loaded ran without it)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        if uncache_computed:
            self.pool.uncache(blocks[max(request.num_cached_tokens, 0) // self.block_size:])
        self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Pool consistency plus: every block's ref count equals the number of requests holding it."""
        self.pool.check_invariants()
        holders = [0] * self.pool.num_blocks
        for blocks in self.req_to_blocks.values():
            for block in blocks:
                holders[block.block_id] += 1
        for block in self.pool.blocks:
            assert block.ref_cnt == holders[block.block_id], f"{block}: {holders[block.block_id]} holders"
