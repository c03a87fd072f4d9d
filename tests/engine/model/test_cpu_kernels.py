"""The compiled CPU decode kernel against the pure-torch reference path."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.model.attention import DecodeInputs, PagedKVCache, _decode, decode_bias
from engine.model.cpu_kernels import PAGED_DECODE_SHAPES, load_paged_decode

# Skip only where no compiler exists; a build failure on a machine with one must fail loudly
# rather than let the engine fall back unnoticed.
pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
kernel = load_paged_decode() if shutil.which("c++") else None


def test_kernel_builds():
    assert kernel is not None


def torch_reference(layer, q, cache, tables, lens, window):
    inputs = DecodeInputs(
        block_tables=tables,
        context_lens=lens,
        tile_rows=cache.tile_rows(tables),
        bias=decode_bias(lens, tables.shape[1] * cache.block_size, window, q.dtype),
        kernel=None,
        sliding_window=window,
    )
    meta = type("Meta", (), {"decode": inputs})()
    return _decode(layer, q, cache, meta)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim", sorted({d for d, _ in PAGED_DECODE_SHAPES}))
@pytest.mark.parametrize("window", [None, 20])
def test_kernel_matches_torch_path(dtype, atol, head_dim, window):
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks, num_layers, kv_heads, group, bs = 64, 3, 2, 3, 16
    data = torch.randn(num_blocks, num_layers, 2, kv_heads, bs, head_dim, generator=gen)
    cache = PagedKVCache(data.to(dtype))
    lens = torch.tensor([1, 15, 16, 17, 40, 95])  # block boundaries and a single token
    max_blocks = -(-int(lens.max()) // bs)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:max_blocks] for _ in lens])
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    for layer in range(num_layers):
        want = torch_reference(layer, q, cache, tables, lens, window)
        got = kernel.paged_decode(
            q, cache.tensor, tables, lens, layer, head_dim**-0.5, window or -1
        )
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)
