"""The Triton prefill kernel (``triton_kernels.prefill``) against SDPA over the cache's gathers.

Several chunks run in one launch (whole prompts, chunks after a cached prefix, single-token
chunks, sliding windows, GQA) over caches written by ``PagedKVCache.write`` through shuffled
block tables; every other row of the cache is NaN (8-bit: all bytes 0xFF, NaN scales), so a
read of anything but the chunks' context poisons the output. The reference gathers with
``PagedKVCache.gather`` (dequantized, int8 keys rotated back) and runs
``F.scaled_dot_product_attention`` under ``causal_mask``. Without a GPU the kernel runs under
Triton's interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET``), with one on CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kv_cache_spec import KV_SCALE_BYTES
from engine.model.attention import PagedKVCache, causal_mask
from engine.model.kv_quant import KVQuant

pytest.importorskip("triton")

from engine.model.triton_kernels.kv_rows import QUANT_FP8_E4M3, QUANT_INT8, QUANT_NONE
from engine.model.triton_kernels.prefill import paged_prefill

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_LAYERS = 2
LAYER = 1  # layer 0 stays NaN: a wrong layer offset shows
SENTINEL = 123.0  # what ``out`` holds outside the chunks, before and after
QUANT_IDS = {None: QUANT_NONE, KVQuant.INT8: QUANT_INT8, KVQuant.FP8_E4M3: QUANT_FP8_E4M3}

# (dtype, quant, head_dim, heads, kv_heads, block_size, window, [(q_len, context_len)], atol)
CASES = {
    "f32-gqa2": (torch.float32, None, 32, 4, 2, 16, None, [(20, 20), (11, 37), (1, 9)], 1e-5),
    "f32-mqa-bs4-window": (torch.float32, None, 16, 4, 1, 4, 7, [(13, 13), (6, 30), (1, 22)], 1e-5),
    "f32-d24-two-m-tiles": (torch.float32, None, 24, 2, 2, 16, None, [(70, 70), (3, 90)], 1e-5),
    "bf16-long-context-window": (
        torch.bfloat16, None, 32, 4, 2, 16, 16, [(10, 150), (20, 20), (1, 33)], 2e-2,
    ),
    "f16-mha": (torch.float16, None, 16, 2, 2, 16, None, [(9, 9), (4, 21)], 2e-3),
    "int8-f32": (
        torch.float32, KVQuant.INT8, 32, 4, 2, 16, None, [(20, 20), (11, 37), (1, 9)], 1e-5,
    ),
    "fp8-f32-window": (
        torch.float32, KVQuant.FP8_E4M3, 16, 4, 1, 16, 10, [(17, 17), (5, 40), (1, 3)], 1e-5,
    ),
    "int8-bf16-bs4-window": (
        torch.bfloat16, KVQuant.INT8, 32, 4, 4, 4, 12, [(15, 15), (7, 26)], 2e-2,
    ),
    "fp8-bf16-d24": (torch.bfloat16, KVQuant.FP8_E4M3, 24, 4, 2, 16, None, [(6, 6), (5, 19)], 2e-2),
}  # fmt: skip


def build_cache(
    dtype: torch.dtype,
    quant: KVQuant | None,
    head_dim: int,
    kv_heads: int,
    block_size: int,
    context_lens: list[int],
    table_dtype: torch.dtype,
    gen: torch.Generator,
) -> tuple[PagedKVCache, torch.Tensor]:
    """A cache whose layer ``LAYER`` holds random K/V for each sequence's context through
    shuffled block tables (padded with block 0), every other row NaN; and the tables."""
    blocks = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks) + 2
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(blocks), max(blocks), dtype=table_dtype)
    row = head_dim + KV_SCALE_BYTES if quant is not None else head_dim
    shape = (num_blocks, NUM_LAYERS, 2, kv_heads, block_size, row)
    if quant is None:
        tensor = torch.full(shape, float("nan"), dtype=dtype)
    else:
        tensor = torch.full(shape, 0xFF, dtype=torch.uint8)
    cache = PagedKVCache(tensor, quant, dtype)
    used = 0
    for s, n in enumerate(context_lens):
        tables[s, : blocks[s]] = ids[used : used + blocks[s]]
        used += blocks[s]
        positions = torch.arange(n)
        slots = cache.slot_rows(tables[s, positions // block_size].long(), positions % block_size)
        k = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        cache.write(LAYER, slots, k, v)
    return cache, tables


def reference(
    cache: PagedKVCache,
    tables: torch.Tensor,
    q: torch.Tensor,
    chunks: list[tuple[int, int]],
    q_starts: list[int],
    window: int | None,
) -> list[torch.Tensor]:
    """Each chunk's float32 attention [q_len, H, D] over its gathered context."""
    outs = []
    for s, ((q_len, ctx), start) in enumerate(zip(chunks, q_starts, strict=True)):
        keys, values = cache.gather(LAYER, cache.tile_rows(tables[s : s + 1].long()))
        keys, values = keys[:, :, :ctx].float(), values[:, :, :ctx].float()
        qs = q[start : start + q_len].transpose(0, 1).unsqueeze(0).float()
        mask = causal_mask(q_len, ctx, window, q.device)
        out = F.scaled_dot_product_attention(
            qs, keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=True
        )
        outs.append(out[0].transpose(0, 1))
    return outs


def check_prefill(device: str, case: tuple) -> None:
    """One launch of ``case``'s chunks on ``device`` against the reference; the rows of
    ``out`` outside the chunks (two before, one between each) keep their sentinel."""
    dtype, quant, head_dim, heads, kv_heads, block_size, window, chunks, atol = case
    gen = torch.Generator().manual_seed(len(chunks) * 1000 + head_dim * 10 + block_size)
    # Block tables come as int32 or int64: the int8 cases take the latter.
    table_dtype = torch.int64 if quant is KVQuant.INT8 else torch.int32
    cache, tables = build_cache(
        dtype, quant, head_dim, kv_heads, block_size, [c for _, c in chunks], table_dtype, gen
    )
    q_starts, end = [], 2
    for q_len, _ in chunks:
        q_starts.append(end)
        end += q_len + 1
    q = torch.randn(end, heads, head_dim, generator=gen).to(dtype)
    # int8 keys are stored rotated; the caller rotates the query to match.
    q_kernel = q if cache.key_rotation is None else (q.float() @ cache.key_rotation).to(dtype)
    out = torch.full_like(q, SENTINEL, device=device)

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    paged_prefill(
        q_kernel.to(device),
        cache.tensor.to(device),
        LAYER,
        tables.to(device),
        ints(q_starts),
        ints([q_len for q_len, _ in chunks]),
        ints([ctx for _, ctx in chunks]),
        max(q_len for q_len, _ in chunks),
        head_dim**-0.5,
        window,
        QUANT_IDS[quant],
        out,
    )
    out = out.cpu()

    untouched = torch.ones(end, dtype=torch.bool)
    for (q_len, _), start, want in zip(
        chunks, q_starts, reference(cache, tables, q, chunks, q_starts, window), strict=True
    ):
        got = out[start : start + q_len]
        torch.testing.assert_close(got.float(), want, atol=atol, rtol=0)
        untouched[start : start + q_len] = False
    assert (out[untouched] == SENTINEL).all()


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_prefill_matches_sdpa_over_the_gathered_context(case):
    check_prefill(DEVICE, case)
