"""Prefix-cache keys. A block's hash covers its parent's hash, its own token ids
and, for a request's first block, an optional salt, so equal hashes mean equal
whole prefixes and a salt isolates one tenant's cache from another's."""

from __future__ import annotations

from array import array
from typing import Sequence

import xxhash


def hash_block_tokens(parent_hash: int | None, token_bytes: bytes, extra: bytes = b"") -> int:
    """One block's key; `token_bytes` are its token ids as int64 (`array("q", ids).tobytes()`)."""
    h = xxhash.xxh3_128()
    h.update((parent_hash or 0).to_bytes(16, "little"))
    h.update(token_bytes)
    h.update(extra)
    return h.intdigest()


def extend_block_hashes(block_hashes: list[int], token_ids: Sequence[int], block_size: int, salt: str | None) -> None:
    """Append hashes for every newly completed full block of `token_ids`.

    Called as tokens arrive, so each block is hashed exactly once in a request's life."""
    first = len(block_hashes) * block_size
    end = first + (len(token_ids) - first) // block_size * block_size
    if end <= first:  # most calls: a decode step's token completes no block
        return
    data = array("q", token_ids[first:end]).tobytes()  # one conversion for all new blocks (a prompt has hundreds)
    width = 8 * block_size
    for offset in range(0, len(data), width):
        parent = block_hashes[-1] if block_hashes else None
        extra = salt.encode() if (salt and parent is None) else b""
        block_hashes.append(hash_block_tokens(parent, data[offset : offset + width], extra))
