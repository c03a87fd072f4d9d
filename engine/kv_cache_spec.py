"""The shape contract of a paged KV cache, shared by engines that exchange KV blocks."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

DTYPE_SIZE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Layout of one engine's KV cache.

    The cache is one tensor ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``
    so a block is a single contiguous region across all layers: one transfer descriptor per
    block. Two engines may exchange blocks only if their ``compat_hash()`` values are equal.
    Torch-free so the router and the transfer layer can check compatibility cheaply.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZE_BYTES:
            raise ValueError(
                f"unsupported KV dtype {self.dtype!r}; one of {list(DTYPE_SIZE_BYTES)}"
            )

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: ``[num_layers, 2, num_kv_heads, block_size, head_dim]``."""
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def block_bytes(self) -> int:
        n = self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
        return n * DTYPE_SIZE_BYTES[self.dtype]

    def compat_hash(self) -> str:
        """Short stable digest of every field; equal hashes mean blocks can be copied verbatim."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
