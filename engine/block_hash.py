"""Chained block hashes: the identity of a KV block across processes and machines.

Torch-free on purpose: the router imports this module to compute the same hashes the workers
compute. A block is ``block_size`` consecutive tokens; only full blocks are hashed::

    hash(block i) = sha256(hash(block i-1) ‖ token_ids(block i) ‖ extra_key)
    hash(block -1) = 32 zero bytes

with token ids encoded as little-endian uint32 and ``extra_key`` (model revision, adapter, cache
salt: anything that changes what a KV block means) as UTF-8 behind its uint32 byte length.
The encoding is fixed; changing it is a wire-format change.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes
ROOT_PARENT_HASH: BlockHash = bytes(32)


def block_extra_key(cache_salt: str, lora_name: str = "") -> str:
    """The ``extra_key`` of a request's blocks: its ``cache_salt`` alone on the base model (so
    unsalted base-model blocks hash as they always have), else the adapter's name ahead of it.
    An adapter's key starts with a NUL, which no client's ``cache_salt`` may contain
    (``engine.request_limits.check_client_cache_salt``), so no salt reaches an adapter's
    blocks."""
    if not lora_name:
        return cache_salt
    return f"\0lora\0{lora_name}\0{cache_salt}"


def hash_block(parent_hash: BlockHash, token_ids: Sequence[int], extra_key: str = "") -> BlockHash:
    """Hash one full block given its parent's hash."""
    extra = extra_key.encode()
    payload = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return hashlib.sha256(parent_hash + payload + struct.pack("<I", len(extra)) + extra).digest()


def hash_block_tokens(
    token_ids: Sequence[int],
    block_size: int,
    extra_key: str = "",
    parent_hash: BlockHash = ROOT_PARENT_HASH,
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` (a trailing partial block is not hashed).

    ``parent_hash`` lets a caller extend an existing chain incrementally: pass the hash of the
    last block already hashed and only the tokens after it.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start : start + block_size], extra_key)
        hashes.append(parent_hash)
    return hashes
