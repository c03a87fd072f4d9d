"""The KV write in Triton: each new token's K and V rows into their cache slots, in place.

One program per (token, KV head) copies the key and the value row of one layer; over an 8-bit
cache it quantizes them as ``kv_quant.quantize_rows`` does (the row's absolute maximum over the
largest code is its scale; codes rounded to nearest even, int8 clamped to +-127, fp8 e4m3 to
+-448) and stores the float32 scale after the codes. Tokens whose slot is negative (the padding
rows of a captured batch) write nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.model.triton_kernels.kv_rows import float_to_fp8_e4m3, round_half_even


@triton.jit
def _store_row(
    cache,
    scales,
    row,
    x,
    cols,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,
    QUANT: tl.constexpr,
    MAX_CODE: tl.constexpr,
):
    mask = cols < HEAD_DIM
    ptrs = cache + row * ROW + cols
    if QUANT == 0:
        tl.store(ptrs, x.to(cache.dtype.element_ty), mask=mask)
    else:
        absmax = tl.max(tl.where(mask, tl.abs(x), 0.0), 0)
        scale = tl.where(absmax > 0, absmax / MAX_CODE, 1.0)
        scaled = tl.minimum(tl.maximum(x / scale, -MAX_CODE), MAX_CODE)
        if QUANT == 1:
            codes = round_half_even(scaled).to(tl.int32).to(tl.int8).to(tl.uint8, bitcast=True)
        else:
            codes = float_to_fp8_e4m3(scaled)
        tl.store(ptrs, codes, mask=mask)
        tl.store(scales + row * (ROW // 4) + HEAD_DIM // 4, scale)


# The layer and the slots change from step to step: not specialized, so that the kernel
# compiles once per model and cache (at start-up) and never while serving.
@triton.jit(do_not_specialize=["layer_offset"], do_not_specialize_on_alignment=["slot_rows"])
def _kv_write(
    cache,
    scales,
    slot_rows,
    k,
    v,
    layer_offset,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROW: tl.constexpr,
    QUANT: tl.constexpr,
    MAX_CODE: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_rows + token * NUM_KV_HEADS + head).to(tl.int64)
    if slot >= 0:
        cols = tl.arange(0, BLOCK_D)
        offsets = (token * NUM_KV_HEADS + head) * HEAD_DIM + cols
        key = tl.load(k + offsets, mask=cols < HEAD_DIM, other=0.0).to(tl.float32)
        value = tl.load(v + offsets, mask=cols < HEAD_DIM, other=0.0).to(tl.float32)
        key_row = slot + layer_offset
        _store_row(cache, scales, key_row, key, cols, HEAD_DIM, ROW, QUANT, MAX_CODE)
        value_row = key_row + NUM_KV_HEADS * BLOCK_SIZE
        _store_row(cache, scales, value_row, value, cols, HEAD_DIM, ROW, QUANT, MAX_CODE)


def kv_write(
    kv_cache: torch.Tensor,
    layer: int,
    slot_rows: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    quant: int,
    max_code: float,
) -> None:
    """Store ``k``/``v`` ``[T, KVH, D]`` of one layer at ``slot_rows`` ``[T, KVH]`` (layer 0's
    key rows, ``PagedKVCache.slot_rows``; negative: skip that token). An int8 cache's keys are
    passed already rotated. ``quant`` is a ``kv_rows`` QUANT_* code, ``max_code`` its largest
    code (ignored unquantized)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _, _, _, _, block_size, row = kv_cache.shape
    scales = kv_cache.view(torch.float32) if quant else kv_cache
    _kv_write[(num_tokens, num_kv_heads)](
        kv_cache,
        scales,
        slot_rows,
        k.contiguous(),
        v.contiguous(),
        layer * 2 * num_kv_heads * block_size,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        ROW=row,
        QUANT=quant,
        MAX_CODE=max_code,
    )
