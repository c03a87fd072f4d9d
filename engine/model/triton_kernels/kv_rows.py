"""Device functions shared by the Triton kernels: where a cache row is, and its values.

The cache is ``[num_blocks, num_layers, 2, num_kv_heads, block_size, row]``. Kernels address it
by *row index* (``cache_row``) and take two views of the same storage: ``cache`` in its own
element type (the model's dtype, or ``uint8`` codes) and, for 8-bit caches, ``scales`` as
float32, where row ``r``'s scale is element ``r * ROW_BYTES // 4 + HEAD_DIM // 4`` (a row is
``HEAD_DIM`` codes then 4 bytes of scale; ``HEAD_DIM`` is a multiple of 4).

``QUANT`` is 0 (unquantized), 1 (int8) or 2 (fp8 e4m3, decoded and encoded with integer bit
operations so that the interpreter and every GPU agree bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

QUANT_NONE = 0
QUANT_INT8 = 1
QUANT_FP8_E4M3 = 2


@triton.jit
def cache_row(block, layer, kv, head, slot, NUM_LAYERS, NUM_KV_HEADS, BLOCK_SIZE):
    """Row index of (block, layer, k=0|v=1, KV head, slot in block)."""
    return (((block * NUM_LAYERS + layer) * 2 + kv) * NUM_KV_HEADS + head) * BLOCK_SIZE + slot


@triton.jit
def fp8_e4m3_to_float(code):
    """float32 values of fp8 e4m3fn codes (a ``uint8`` tensor); exact."""
    c = code.to(tl.int32)
    sign = (c >> 7) & 1
    exponent = (c >> 3) & 0xF
    mantissa = c & 0x7
    normal = ((sign << 31) | ((exponent + 120) << 23) | (mantissa << 20)).to(
        tl.float32, bitcast=True
    )
    subnormal = mantissa.to(tl.float32) * 0.001953125  # mantissa * 2**-9
    subnormal = tl.where(sign == 1, -subnormal, subnormal)
    return tl.where(exponent == 0, subnormal, normal)


@triton.jit
def round_half_even(x):
    """``x`` (float32, ``|x| < 2**22``) rounded to the nearest integer, ties to even, as
    ``torch.round`` does: adding and subtracting 1.5 * 2**23 leaves no fraction bits."""
    magic = 12582912.0
    return (x + magic) - magic


@triton.jit
def float_to_fp8_e4m3(x):
    """fp8 e4m3fn codes (``uint8``) of float32 ``x`` with ``|x| <= 448``, rounded to nearest
    even as torch's conversion does."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    magnitude = tl.abs(x)
    # Subnormal codes (and the smallest normal, 8) count steps of 2**-9.
    subnormal = round_half_even(magnitude * 512.0).to(tl.int32)
    # Normal: round the float32 mantissa to 3 bits (ties to even), then rebias 127 -> 7.
    mbits = magnitude.to(tl.int32, bitcast=True)
    rounded = mbits + 0x7FFFF + ((mbits >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    code = tl.where(magnitude < 0.015625, subnormal, normal)
    return ((sign << 7) | code).to(tl.uint8)


@triton.jit
def load_rows(
    cache,
    scales,
    rows,
    row_mask,
    cols,
    ROW: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QUANT: tl.constexpr,
):
    """``[len(rows), len(cols)]`` float32 values of cache ``rows`` (masked rows read 0)."""
    mask = row_mask[:, None] & (cols[None, :] < HEAD_DIM)
    if QUANT == 0:
        ptrs = cache + rows[:, None].to(tl.int64) * ROW + cols[None, :]
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    # Rows of codes are only 4-byte aligned (HEAD_DIM codes, then a float32 scale), yet Triton
    # 3.6's pipeliner copies them in 16-byte vectors (misaligned address on the GPU): columns
    # in runs of 4 cap the vector width.
    ptrs = cache + rows[:, None].to(tl.int64) * ROW + (cols // 4 * 4 + cols % 4)[None, :]
    codes = tl.load(ptrs, mask=mask, other=0)
    if QUANT == 1:
        values = codes.to(tl.int8, bitcast=True).to(tl.float32)
    else:
        values = fp8_e4m3_to_float(codes)
    scale_ptrs = scales + rows.to(tl.int64) * (ROW // 4) + HEAD_DIM // 4
    scale = tl.load(scale_ptrs, mask=row_mask, other=0.0)
    return values * scale[:, None]


def float32_dot(q: torch.Tensor) -> bool:
    """Whether a kernel's matmuls for ``q`` run on float32 operands in IEEE precision: for
    float32 models (no TF32), and under the interpreter, whose 16-bit ``tl.dot`` is wrong
    (it multiplies the raw bits); there the operands are widened after their rounding to
    the model dtype, which is what a GPU's 16-bit dot with float32 accumulation computes."""
    return q.dtype == torch.float32 or q.device.type == "cpu"


@triton.jit
def dot(a, b, FLOAT32: tl.constexpr):
    """``a @ b`` with float32 accumulation (``float32_dot`` chooses ``FLOAT32``)."""
    if FLOAT32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)
