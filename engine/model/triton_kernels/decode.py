"""Paged decode attention in Triton: flash-decoding over the cache, read in place.

One query row per decode token (a draft is one more row with its own context length) attends
to its sequence's first ``context_lens[row]`` cached tokens, found through its block table.
The context is split into ``SPLIT_TOKENS`` pieces, each a program per (row, KV head, piece)
that scores the KV head's whole query group at once (GQA/MQA: the group's heads are the rows
of one ``tl.dot``) with an online float32 softmax; a second kernel merges the pieces' partial
results by their log-sum-exp. Pieces past a row's context (or before its sliding window) do
nothing, so one grid, sized by the longest context a launch may see, serves every batch: a
CUDA graph captures it once per batch size.

Numerics follow the torch reference path (``attention._decode``): scores from the model-dtype
query and keys with float32 accumulation, softmax in float32, its weights cast to the model
dtype before multiplying the values. 8-bit caches are dequantized in registers (codes times
the row's scale); int8 keys are stored rotated, so the caller passes a rotated query.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.model.triton_kernels.kv_rows import cache_row, float32_dot, load_rows
from engine.model.triton_kernels.kv_rows import dot as _dot

# Tokens a program scores per iteration; the shortest piece of context a program takes (a
# multiple of it), lengthened for long contexts so that a row has at most MAX_PIECES pieces.
TILE_TOKENS = 32
SPLIT_TOKENS = 256
MAX_PIECES = 32
# ``window`` of a model without a sliding window: longer than any context.
_NO_WINDOW = 1 << 30


# Arguments that change from step to step are neither value- nor alignment-specialized, so that
# each kernel compiles once per model and cache (at start-up) and never while serving.
@triton.jit(
    do_not_specialize=["layer", "window", "num_pieces", "split", "table_stride"],
    do_not_specialize_on_alignment=["block_tables", "context_lens"],
)
def _decode_pieces(
    q,
    cache,
    scales,
    block_tables,
    context_lens,
    piece_acc,
    piece_max,
    piece_sum,
    layer,
    scale,
    window,
    num_pieces,
    split,
    table_stride,
    NUM_LAYERS,
    NUM_KV_HEADS,
    BLOCK_SIZE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROW: tl.constexpr,
    QUANT: tl.constexpr,
    FLOAT32_DOT: tl.constexpr,
    TILE: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    piece = tl.program_id(2)
    context_len = tl.load(context_lens + row)
    first = tl.maximum(context_len - window, 0)
    start = tl.maximum(piece * split, (first // TILE) * TILE)
    end = tl.minimum((piece + 1) * split, context_len)
    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
    head_mask = tl.arange(0, GROUP_PAD) < GROUP
    cols = tl.arange(0, BLOCK_D)
    q_ptrs = q + (row * NUM_HEADS + heads)[:, None] * HEAD_DIM + cols[None, :]
    q_mask = head_mask[:, None] & (cols[None, :] < HEAD_DIM)
    qv = tl.load(q_ptrs, mask=q_mask, other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for tile_start in range(start, end, TILE):
        tokens = tile_start + tl.arange(0, TILE)
        valid = (tokens >= first) & (tokens < end)
        blocks = tl.load(
            block_tables + row * table_stride + tokens // BLOCK_SIZE, mask=valid, other=0
        )
        rows = cache_row(
            blocks, layer, 0, kv_head, tokens % BLOCK_SIZE, NUM_LAYERS, NUM_KV_HEADS, BLOCK_SIZE
        )
        keys = load_rows(cache, scales, rows, valid, cols, ROW, HEAD_DIM, QUANT).to(qv.dtype)
        s = _dot(qv, tl.trans(keys), FLOAT32_DOT)
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        values = load_rows(
            cache, scales, rows + NUM_KV_HEADS * BLOCK_SIZE, valid, cols, ROW, HEAD_DIM, QUANT
        )
        pv = _dot(p.to(qv.dtype), values.to(qv.dtype), FLOAT32_DOT)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if start < end:  # the merge reads only the pieces that hold context
        slot = (row * NUM_HEADS + heads) * num_pieces + piece
        tl.store(piece_acc + slot[:, None] * BLOCK_D + cols[None, :], acc, mask=head_mask[:, None])
        tl.store(piece_max + slot, m_i, mask=head_mask)
        tl.store(piece_sum + slot, l_i, mask=head_mask)


@triton.jit(
    do_not_specialize=["window", "num_pieces", "split"],
    do_not_specialize_on_alignment=["context_lens"],
)
def _merge_pieces(
    out,
    context_lens,
    piece_acc,
    piece_max,
    piece_sum,
    window,
    num_pieces,
    split,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PIECES_PAD: tl.constexpr,
    TILE: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens + row)
    first = tl.maximum(context_len - window, 0)
    pieces = tl.arange(0, PIECES_PAD)
    active = (pieces >= ((first // TILE) * TILE) // split) & (pieces * split < context_len)
    slots = (row * NUM_HEADS + head) * num_pieces + pieces
    maxes = tl.load(piece_max + slots, mask=active, other=float("-inf"))
    m = tl.max(maxes, 0)
    weights = tl.where(active, tl.exp(maxes - tl.where(m == float("-inf"), 0.0, m)), 0.0)
    total = tl.sum(weights * tl.load(piece_sum + slots, mask=active, other=0.0), 0)
    cols = tl.arange(0, BLOCK_D)
    accs = tl.load(
        piece_acc + slots[:, None] * BLOCK_D + cols[None, :], mask=active[:, None], other=0.0
    )
    acc = tl.sum(weights[:, None] * accs, 0)
    result = acc / tl.where(total > 0, total, 1.0)  # no context (padding): zeros
    tl.store(
        out + (row * NUM_HEADS + head) * HEAD_DIM + cols,
        result.to(out.dtype.element_ty),
        mask=cols < HEAD_DIM,
    )


def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    scale: float,
    sliding_window: int | None,
    quant: int,
) -> torch.Tensor:
    """Attention output ``[B, H, D]`` (``q``'s dtype) of decode rows ``q`` ``[B, H, D]``.

    Row ``b`` attends to the first ``context_lens[b]`` tokens of its block table row
    (``block_tables`` ``[B, max_blocks]`` int32); a row with context 0 (batch padding) gets
    zeros. ``max_context_len`` (a host int, at least every row's context) sizes the grid;
    the launch is the same for any ``context_lens`` up to it, so it can be graph-captured.
    ``quant`` is a ``kv_rows`` QUANT_* code; an int8 cache's keys take a rotated ``q``.
    """
    num_rows, num_heads, head_dim = q.shape
    _, num_layers, _, num_kv_heads, block_size, row = kv_cache.shape
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    split = max(SPLIT_TOKENS, triton.next_power_of_2(triton.cdiv(max_context_len, MAX_PIECES)))
    num_pieces = max(triton.cdiv(max_context_len, split), 1)
    pieces = (num_rows, num_heads, num_pieces)
    piece_acc = torch.empty((*pieces, block_d), dtype=torch.float32, device=q.device)
    piece_max = torch.empty(pieces, dtype=torch.float32, device=q.device)
    piece_sum = torch.empty(pieces, dtype=torch.float32, device=q.device)
    q = q.contiguous()
    out = torch.empty_like(q)
    if num_rows == 0:
        return out
    scales = kv_cache.view(torch.float32) if quant else kv_cache
    window = sliding_window or _NO_WINDOW
    _decode_pieces[(num_rows, num_kv_heads, num_pieces)](
        q,
        kv_cache,
        scales,
        block_tables,
        context_lens,
        piece_acc,
        piece_max,
        piece_sum,
        layer,
        scale,
        window,
        num_pieces,
        split,
        block_tables.stride(0),
        num_layers,
        num_kv_heads,
        BLOCK_SIZE=block_size,
        NUM_HEADS=num_heads,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        ROW=row,
        QUANT=quant,
        FLOAT32_DOT=float32_dot(q),
        TILE=TILE_TOKENS,
    )
    _merge_pieces[(num_rows, num_heads)](
        out,
        context_lens,
        piece_acc,
        piece_max,
        piece_sum,
        window,
        num_pieces,
        split,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PIECES_PAD=MAX_PIECES,
        TILE=TILE_TOKENS,
    )
    return out
