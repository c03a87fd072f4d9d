"""One layer's attention through the Triton kernels (``triton_kernels``), on GPUs.

The same contract as ``attention.paged_attention``: write the new tokens' K/V into their slots,
then attend. Decode rows (first ``num_decode_tokens`` of the step) run the flash-decoding
kernel; every prefill chunk of the step runs in one launch of the prefill kernel over the
paged context, which by then holds the chunk's own tokens too. Every input is a device
tensor of a shape fixed by the batch, and no host value is read back, so a decode step
through this path can be captured in a CUDA graph (``cuda_graphs``).
"""

from __future__ import annotations

import torch

from engine.model.kv_quant import KVQuant
from engine.model.triton_inputs import TritonInputs
from engine.model.triton_kernels.decode import paged_decode
from engine.model.triton_kernels.kv_rows import QUANT_FP8_E4M3, QUANT_INT8, QUANT_NONE
from engine.model.triton_kernels.kv_write import kv_write
from engine.model.triton_kernels.prefill import paged_prefill

_QUANT_CODES = {None: QUANT_NONE, KVQuant.INT8: QUANT_INT8, KVQuant.FP8_E4M3: QUANT_FP8_E4M3}


def quant_code(quant: KVQuant | None) -> int:
    """The kernels' ``QUANT`` code of a cache's quantization."""
    return _QUANT_CODES[quant]


def triton_paged_attention(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    quant: KVQuant | None,
    key_rotation: torch.Tensor | None,
    slot_rows: torch.Tensor,
    num_decode_tokens: int,
    inputs: TritonInputs,
) -> torch.Tensor:
    """Attention output ``[T, H, D]`` for queries ``q`` ``[T, H, D]`` and new ``k``/``v``
    ``[T, KVH, D]``. Side effect: writes ``k``/``v`` into ``kv_cache`` at ``slot_rows``.

    An int8 cache stores keys rotated by ``key_rotation`` (``kv_quant``): the new keys are
    rotated before their write and the queries before they score the cache.
    """
    code = quant_code(quant)
    max_code = quant.max_code if quant is not None else 0.0
    if key_rotation is not None:
        k = k.float() @ key_rotation
        q = (q.float() @ key_rotation).to(q.dtype)
    kv_write(kv_cache, layer, slot_rows, k, v, code, max_code)
    scale = q.shape[-1] ** -0.5
    decode = paged_decode(
        q[:num_decode_tokens],
        kv_cache,
        layer,
        inputs.decode_tables,
        inputs.decode_lens,
        inputs.max_decode_context,
        scale,
        inputs.sliding_window,
        code,
    )
    prefill = inputs.prefill
    if prefill is None:
        return decode
    q = q.contiguous()
    out = torch.empty_like(q)
    out[:num_decode_tokens] = decode
    paged_prefill(
        q,
        kv_cache,
        layer,
        prefill.block_tables,
        prefill.q_starts,
        prefill.q_lens,
        prefill.context_lens,
        prefill.max_q_len,
        scale,
        inputs.sliding_window,
        code,
        out,
    )
    return out


def compile_kernels(
    kv_cache: torch.Tensor,
    quant: KVQuant | None,
    num_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    sliding_window: int | None,
) -> None:
    """Launch every attention kernel once in each variant a step can need (the prefill
    kernel's tile heights), on scratch inputs, so that no request's step waits for a
    compilation (seconds each on a GPU). The kernels specialize on nothing that changes from
    step to step (layer, lengths, block-table width, metadata alignment), so these are all the
    variants a model and cache ever use.

    No side effect on the cache: the attention kernels only read it, and the KV write is
    given only skipped (negative) slots.
    """
    device = kv_cache.device
    _, _, _, num_kv_heads, block_size, _ = kv_cache.shape
    code = quant_code(quant)
    scale = head_dim**-0.5
    for q_len in (16, 32, 64):  # the prefill kernel's tile heights
        q = torch.zeros(q_len, num_heads, head_dim, dtype=dtype, device=device)
        ints = torch.tensor([0, q_len, q_len], dtype=torch.int32, device=device)
        tables = torch.zeros(1, -(-q_len // block_size), dtype=torch.int32, device=device)
        out = torch.empty_like(q)
        paged_prefill(
            q,
            kv_cache,
            0,
            tables,
            ints[:1],
            ints[1:2],
            ints[2:],
            q_len,
            scale,
            sliding_window,
            code,
            out,
        )
    q = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=device)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=device)
    lens = torch.ones(1, dtype=torch.int32, device=device)
    paged_decode(q, kv_cache, 0, tables, lens, 1, scale, sliding_window, code)
    kv = torch.zeros(1, num_kv_heads, head_dim, dtype=dtype, device=device)
    skipped = torch.full((1, num_kv_heads), -1, dtype=torch.int64, device=device)
    kv_write(kv_cache, 0, skipped, kv, kv, code, quant.max_code if quant is not None else 0.0)
