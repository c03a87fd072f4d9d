"""The shape contract of a paged KV cache, shared by engines that exchange KV blocks."""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import asdict, dataclass

DTYPE_SIZE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# 8-bit caches: the largest code magnitude each one uses (see QUANTIZED_KV_DTYPES' rows below).
QUANTIZED_KV_DTYPES = {"int8": 127.0, "fp8_e4m3": 448.0}
# Each token's K (or V) row of one head in an 8-bit cache: head_dim codes, then its float32 scale.
KV_SCALE_BYTES = 4


class KVLayout(enum.Enum):
    """How a cache's blocks lie in memory. Caches pair only when their layouts are equal."""

    # [num_blocks, num_layers, 2, num_kv_heads, block_size, row], contiguous: splitserve's
    # engines. A block is one region across all layers.
    BLOCK_MAJOR = "block-major"
    # Per layer [num_blocks, num_kv_heads, 2, block_size, row], the layers one after another in
    # one allocation: vLLM's CPU attention (its KV cache layout LBHNC). A block is one region
    # per layer.
    VLLM_CPU = "vllm-cpu layer-major"


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Layout of one engine's KV cache.

    The cache is one tensor ``[num_blocks, *block_shape]``, laid out as ``layout`` says:
    block-major (contiguous: a block is one region across all layers, one transfer descriptor
    per block) or layer-major (its ``transpose(0, 1)`` is contiguous: a block is
    ``num_layers`` regions, which move as ``num_layers`` segments).
    ``row`` is ``head_dim`` elements of ``dtype``, or for an 8-bit ``dtype``
    (``QUANTIZED_KV_DTYPES``) ``head_dim`` one-byte codes followed by the row's float32 scale
    (``head_dim + KV_SCALE_BYTES`` bytes, the tensor is ``uint8``): each token's K and V rows
    are quantized on their own, so appending a token never rewrites another. Two engines may
    exchange blocks only if their ``compat_hash()`` values are equal. Torch-free so the router
    and the transfer layer can check compatibility cheaply.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    layout: KVLayout = KVLayout.BLOCK_MAJOR

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZE_BYTES and self.dtype not in QUANTIZED_KV_DTYPES:
            known = [*DTYPE_SIZE_BYTES, *QUANTIZED_KV_DTYPES]
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; one of {known}")

    @property
    def quantized(self) -> bool:
        """Whether rows hold 8-bit codes and a scale (the tensor is then ``uint8``)."""
        return self.dtype in QUANTIZED_KV_DTYPES

    @property
    def row_size(self) -> int:
        """Elements of one token's row of one head (bytes when ``quantized``)."""
        return self.head_dim + KV_SCALE_BYTES if self.quantized else self.head_dim

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: ``[num_layers, 2, num_kv_heads, block_size, row_size]``
        (``[num_layers, num_kv_heads, 2, block_size, row_size]`` in vLLM's CPU layout)."""
        if self.layout is KVLayout.VLLM_CPU:
            return (self.num_layers, self.num_kv_heads, 2, self.block_size, self.row_size)
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.row_size)

    @property
    def layer_major(self) -> bool:
        """Whether a block is one region per layer (else one region)."""
        return self.layout is KVLayout.VLLM_CPU

    @property
    def block_bytes(self) -> int:
        n = self.num_layers * 2 * self.block_size * self.num_kv_heads * self.row_size
        return n * (1 if self.quantized else DTYPE_SIZE_BYTES[self.dtype])

    @property
    def num_segments(self) -> int:
        """Contiguous regions per block: ``num_layers`` when ``layer_major``, else 1."""
        return self.num_layers if self.layer_major else 1

    def describe(self) -> str:
        """One line naming every field, e.g. ``int8 KV cache: 30 layers x 3 KV heads x
        head_dim 64, 16-token blocks``: what a refused peer's error shows of each side."""
        return (
            f"{self.dtype} KV cache: {self.num_layers} layers x {self.num_kv_heads} KV heads x "
            f"head_dim {self.head_dim}, {self.block_size}-token blocks, {self.layout.value}"
        )

    def compat_hash(self) -> str:
        """Short stable digest of every field; equal hashes mean blocks can be copied verbatim."""
        blob = json.dumps({**asdict(self), "layout": self.layout.value}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
