"""Prefill attention over the paged KV cache: every chunk of a step in one Triton launch.

Chunk ``s`` is rows ``[q_starts[s], q_starts[s] + q_lens[s])`` of the step's queries: the last
``q_lens[s]`` of its ``context_lens[s]`` context tokens, whose K/V are already in the cache.
A program owns ``BLOCK_M`` query rows of one chunk and one query head, and runs a
flash-attention loop (online softmax in float32) over the context in ``BLOCK_N``-token tiles,
gathering each tile's rows through the chunk's block table, bottom-right causal and, with a
sliding window, only over the tiles the window reaches.

8-bit caches are read dequantized to float32 (``kv_rows.load_rows``) and rounded to the query's
dtype, as the torch reference dequantizes to the model dtype. int8 keys are stored rotated
(``kv_quant.key_rotation``): the caller passes the query rotated the same way; the kernel never
rotates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.model.triton_kernels.kv_rows import QUANT_NONE, cache_row, dot, float32_dot, load_rows

# A sliding window no context reaches: with no window the window mask keeps every key.
_NO_WINDOW = 1 << 30


# Arguments that change from step to step are neither value- nor alignment-specialized, so that
# the kernel compiles once per tile height (at start-up) and never while serving.
@triton.jit(
    do_not_specialize=["layer", "window", "stride_bt"],
    do_not_specialize_on_alignment=["block_tables", "q_starts", "q_lens", "context_lens"],
)
def _prefill_kernel(
    q_ptr,
    out_ptr,
    cache,
    scales,
    block_tables,
    q_starts,
    q_lens,
    context_lens,
    layer,
    scale,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    NUM_LAYERS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ROW: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QUANT: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FLOAT32_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    m_block = tl.program_id(1)
    head = tl.program_id(2)
    q_len = tl.load(q_lens + seq)
    if m_block * BLOCK_M >= q_len:
        return
    context_len = tl.load(context_lens + seq)
    q_start = tl.load(q_starts + seq)
    kv_head = head // GROUP
    dtype = q_ptr.dtype.element_ty

    rows_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows_m < q_len
    # Rows past the chunk take its last query's position: every row then sees a key.
    positions = context_len - q_len + tl.minimum(rows_m, q_len - 1)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < HEAD_DIM
    token = (q_start + rows_m).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head * stride_qh + cols[None, :],
        mask=row_mask[:, None] & col_mask[None, :],
        other=0.0,
    )

    # Keys after the tile's last query and before its first query's window are never seen.
    last = context_len - q_len + tl.minimum((m_block + 1) * BLOCK_M, q_len) - 1
    start = tl.maximum(context_len - q_len + m_block * BLOCK_M - window + 1, 0)
    start = (start // BLOCK_N) * BLOCK_N

    # A finite floor instead of -inf: a row with no key in a tile keeps exp(-inf - m) = 0
    # rather than exp(-inf + inf) = NaN. Every row sees its own position, so l_i > 0 at the end.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables + seq.to(tl.int64) * stride_bt
    for tile in range(start, last + 1, BLOCK_N):
        keys_n = tile + tl.arange(0, BLOCK_N)
        key_mask = keys_n <= last
        block = tl.load(table + keys_n // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
        slot = keys_n % BLOCK_SIZE
        key_rows = cache_row(block, layer, 0, kv_head, slot, NUM_LAYERS, NUM_KV_HEADS, BLOCK_SIZE)
        value_rows = key_rows + NUM_KV_HEADS * BLOCK_SIZE
        k = load_rows(cache, scales, key_rows, key_mask, cols, ROW, HEAD_DIM, QUANT).to(dtype)
        v = load_rows(cache, scales, value_rows, key_mask, cols, ROW, HEAD_DIM, QUANT).to(dtype)

        scores = dot(q, tl.trans(k), FLOAT32_DOT) * scale
        distance = positions[:, None] - keys_n[None, :]
        visible = key_mask[None, :] & (distance >= 0) & (distance < window)
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(p.to(dtype), v, FLOAT32_DOT)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head * stride_oh + cols[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def paged_prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    max_q_len: int,
    scale: float,
    sliding_window: int | None,
    quant: int,
    out: torch.Tensor,
) -> None:
    """Attention of every prefill chunk's queries over its cached context, into ``out``.

    ``q`` and ``out`` are ``[T, H, D]`` in the model dtype (head dim contiguous); ``kv_cache``
    is the whole cache ``[num_blocks, num_layers, 2, KVH, block_size, row]`` (``uint8`` rows of
    ``D`` codes and a float32 scale when ``quant`` is ``kv_rows.QUANT_INT8`` or
    ``QUANT_FP8_E4M3``); ``block_tables`` ``[S, max_blocks]`` (padded with any block id);
    ``q_starts``, ``q_lens``, ``context_lens`` ``[S]``: chunk ``s`` is rows
    ``q_starts[s] : q_starts[s] + q_lens[s]`` of ``q``, the last ``q_lens[s]`` of
    ``context_lens[s]`` tokens whose K/V are all in the cache. A query at position ``p`` attends
    keys ``k <= p`` with ``p - k < sliding_window`` (when set); query head ``h`` reads KV head
    ``h // (H // KVH)``. ``max_q_len`` (``max(q_lens)``, a host int) sizes the grid. int8 keys
    are stored rotated: ``q`` must be rotated by the same matrix.

    Side effect: writes the chunks' rows of ``out``; its other rows are left as they were.
    """
    _, num_heads, head_dim = q.shape
    _, num_layers, _, num_kv_heads, block_size, row = kv_cache.shape
    assert out.shape == q.shape and out.dtype == q.dtype
    assert q.stride(2) == 1 and out.stride(2) == 1 and kv_cache.is_contiguous()
    assert num_heads % num_kv_heads == 0
    num_seqs = q_lens.shape[0]
    if num_seqs == 0 or max_q_len == 0:
        return
    scales = kv_cache if quant == QUANT_NONE else kv_cache.view(torch.float32)
    block_d = triton.next_power_of_2(head_dim)
    block_m = min(64, max(16, triton.next_power_of_2(max_q_len)))
    block_n = 64 if block_d <= 128 else 32
    grid = (num_seqs, triton.cdiv(max_q_len, block_m), num_heads)
    _prefill_kernel[grid](
        q,
        out,
        kv_cache,
        scales,
        block_tables,
        q_starts,
        q_lens,
        context_lens,
        layer,
        scale,
        _NO_WINDOW if sliding_window is None else sliding_window,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        NUM_LAYERS=num_layers,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_SIZE=block_size,
        ROW=row,
        HEAD_DIM=head_dim,
        QUANT=quant,
        GROUP=num_heads // num_kv_heads,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        FLOAT32_DOT=float32_dot(q),
    )
