"""Prefix-cache keys. A block's hash covers its parent's hash, its own token ids
and, for a request's first block, an optional salt and LoRA adapter, so equal
hashes mean equal whole prefixes computed by the same weights, and a salt
isolates one tenant's cache from another's."""

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


def first_block_key(salt: str | None, lora_int_id: int | None = None) -> bytes:
    """What a request's first block is hashed with beside its tokens: its cache_salt's UTF-8 bytes, then its LoRA
    adapter's id after a 0xff byte (which UTF-8 never holds, so no salt can spell an adapter)."""
    key = salt.encode() if salt else b""
    return key + (b"\xff" + lora_int_id.to_bytes(8, "little") if lora_int_id else b"")


def extend_block_hashes(block_hashes: list[int], token_ids: Sequence[int], block_size: int, first_key: bytes) -> None:
    """Append hashes for every newly completed full block of `token_ids` (`first_key`: `first_block_key`'s).

    Called as tokens arrive, so each block is hashed exactly once in a request's life."""
    first = len(block_hashes) * block_size
    end = first + (len(token_ids) - first) // block_size * block_size
    if end <= first:  # most calls: a decode step's token completes no block
        return
    data = array("q", token_ids[first:end]).tobytes()  # one conversion for all new blocks (a prompt has hundreds)
    width = 8 * block_size
    for offset in range(0, len(data), width):
        parent = block_hashes[-1] if block_hashes else None
        block_hashes.append(hash_block_tokens(parent, data[offset : offset + width], first_key if parent is None else b""))
