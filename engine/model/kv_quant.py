"""8-bit KV cache rows: quantize on write, dequantize on read (the torch reference).

An 8-bit cache (``--kv-cache-dtype int8|fp8_e4m3``) stores each token's K (or V) vector of one
KV head as a row of ``head_dim`` one-byte codes followed by its float32 scale (see
``KVCacheSpec``). The scale is the row's absolute maximum over the dtype's largest code
(127 for int8, 448 for fp8 e4m3), so every row uses the codes' whole range and a new token
never changes the rows before it. ``x ~= code * scale``.

int8 keys are stored rotated by the normalized Hadamard matrix ``R`` (``key_rotation``, for a
power-of-two ``head_dim``): a few outlier channels set a key row's absmax, and so the step of
every other channel; rotated, a row's energy is spread over all channels and the key error
halves (measured on SmolLM2: 1.1% to 0.56% RMS). ``R`` is symmetric and orthonormal, so
``(k R) . (q R) = k . q``: the decode kernel reads rotated keys with a rotated query, and
gathers (the torch paths, the prefill scratch) rotate keys back. fp8's error is relative to
each value, which a rotation does not improve, and values gain little (0.67% to 0.59%).

The compiled decode kernel (``csrc/paged_decode_quantized.cpp``) reads the same rows in place
and folds each row's scale into its score (K) or its softmax weight (V); from AVX512_BF16 it
scores int8 keys by integer dot products against the query as int16 codes (``vpdpwssd``).
``csrc/kv_quant.cpp`` writes rows and widens a step's context into a scratch cache for the
compiled prefill kernel (``PagedKVCache.write``, ``.dequantized_layer``), as the functions
below do in torch.
"""

from __future__ import annotations

import enum
import functools

import torch

from engine.kv_cache_spec import KV_SCALE_BYTES, QUANTIZED_KV_DTYPES


class KVQuant(enum.Enum):
    """An 8-bit KV cache dtype: its codes' torch dtype and the kernels' id for it."""

    INT8 = "int8"
    FP8_E4M3 = "fp8_e4m3"

    @property
    def max_code(self) -> float:
        """The largest code magnitude a row's absolute maximum maps to."""
        return QUANTIZED_KV_DTYPES[self.value]

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.int8 if self is KVQuant.INT8 else torch.float8_e4m3fn

    @property
    def kernel_id(self) -> int:
        """The ``kind`` argument of the compiled kernels (0: int8, 1: fp8 e4m3)."""
        return 0 if self is KVQuant.INT8 else 1


def key_rotation(quant: KVQuant | None, head_dim: int) -> torch.Tensor | None:
    """The float32 ``[head_dim, head_dim]`` matrix int8 keys are stored multiplied by, or None
    (unquantized and fp8 caches, and head_dims that are not a power of two)."""
    if quant is not KVQuant.INT8 or head_dim & (head_dim - 1):
        return None
    return _hadamard(head_dim)


@functools.cache
def _hadamard(n: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix of order ``n`` (a power of two) over sqrt(n): symmetric and
    orthonormal, so it is its own inverse."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


def kv_quant_for(dtype: str) -> KVQuant | None:
    """The quantization of a cache dtype name, or None for an unquantized one."""
    return KVQuant(dtype) if dtype in QUANTIZED_KV_DTYPES else None


def quantize_rows(x: torch.Tensor, quant: KVQuant) -> torch.Tensor:
    """``uint8 [..., D + 4]`` rows of ``x`` ``[..., D]``: codes, then the float32 scale.

    Invariant: ``dequantize_rows(quantize_rows(x))`` is within half a code step of ``x``
    for int8 (``scale / 2``), and within fp8 e4m3's relative rounding (2**-4) for fp8.
    """
    xf = x.float()
    absmax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / quant.max_code, torch.ones_like(absmax))
    scaled = xf / scale
    if quant is KVQuant.INT8:
        codes = scaled.round_().clamp_(-127, 127).to(torch.int8)
    else:
        codes = scaled.clamp_(-448, 448).to(torch.float8_e4m3fn)
    return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, quant: KVQuant, dtype: torch.dtype) -> torch.Tensor:
    """``[..., D]`` values in ``dtype`` of ``uint8 [..., D + 4]`` rows (``quantize_rows``)."""
    head_dim = rows.shape[-1] - KV_SCALE_BYTES
    codes = rows[..., :head_dim].contiguous().view(quant.code_dtype).float()
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (codes * scale).to(dtype)
