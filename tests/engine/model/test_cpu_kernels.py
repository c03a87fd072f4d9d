"""The compiled CPU attention kernels, at every level up to the host's (the ``kernels``
fixture), against the pure-torch reference paths."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig

import pytest
import torch

from engine.cpu_isa import CpuIsa, host_isa
from engine.model.attention import (
    DecodeInputs,
    PagedKVCache,
    PrefillSeq,
    _decode,
    _prefill,
    causal_mask,
    decode_bias,
)
from engine.model.cpu_kernels import CSRC_DIR, PAGED_DECODE_SHAPES, SOURCES


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
# Block boundaries and a single token; one sequence alone (fewer sequences than threads: the
# AVX2 path then splits it by KV head).
@pytest.mark.parametrize("context_lens", [(1, 15, 16, 17, 40, 95), (83,)], ids=["6seqs", "1seq"])
def test_kernel_matches_torch_path(kernels, dtype, atol, head_dim, window, context_lens):
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks, num_layers, kv_heads, group, bs = 64, 3, 2, 3, 16
    data = torch.randn(num_blocks, num_layers, 2, kv_heads, bs, head_dim, generator=gen)
    cache = PagedKVCache(data.to(dtype))
    lens = torch.tensor(context_lens)
    max_blocks = -(-int(lens.max()) // bs)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:max_blocks] for _ in lens])
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    for layer in range(num_layers):
        want = torch_reference(layer, q, cache, tables, lens, window)
        got = kernels.paged_decode(
            q, cache.tensor, tables, lens, layer, head_dim**-0.5, window or -1
        )
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("num_other_seqs", [0, 4], ids=["split-by-head", "whole-runs"])
def test_decode_rows_of_one_sequence_equal_each_row_alone(kernels, dtype, window, num_other_seqs):
    """A decode with draft tokens is one row per token: the same block table, context lengths
    n, n + 1, ... (the AVX2 path computes such a run in one task, each block read once). Every
    row's result is bit for bit the row computed alone: across block edges, in runs longer than
    a task holds (6 heads: 10 rows), beside other sequences or alone (split by KV head)."""
    gen = torch.Generator().manual_seed(21)
    num_blocks, kv_heads, group, head_dim, bs = 64, 2, 3, 64, 16
    data = torch.randn(num_blocks, 1, 2, kv_heads, bs, head_dim, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[:8]
    # Alone: one run, fewer than the threads (split by KV head); else also a run of 12.
    lens = [14, 15, 16, 17] if num_other_seqs == 0 else [14, 15, 16, 17, *range(100, 112)]
    tables = [table] * len(lens)
    for i in range(num_other_seqs):
        lens.append(30 + i)
        tables.append(torch.randperm(num_blocks, generator=gen)[:8])
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    args = (0, head_dim**-0.5, window or -1)
    got = kernels.paged_decode(q, data, torch.stack(tables), torch.tensor(lens), *args)
    for i, n in enumerate(lens):
        alone = kernels.paged_decode(q[i : i + 1], data, tables[i][None], torch.tensor([n]), *args)
        assert torch.equal(got[i : i + 1], alone), (i, n)


def sdpa_reference(layer, q, cache, tables, q_starts, q_lens, context_lens, window):
    """The SDPA path's output for each chunk, from the same cache (K/V already written)."""
    out = torch.zeros_like(q)
    k = torch.zeros(q.shape[0], cache.num_kv_heads, cache.head_dim, dtype=q.dtype)
    v = torch.zeros_like(k)
    for table, start, n, ctx in zip(tables, q_starts, q_lens, context_lens, strict=True):
        start, n, ctx = int(start), int(n), int(ctx)
        tile_rows = cache.tile_rows(table[None, : -(-ctx // cache.block_size)])
        keys, values = cache.gather(layer, tile_rows)  # [1, KVH, tokens, D]
        # The SDPA path takes a whole prompt's K/V from the step's own k/v, not the cache.
        k[start : start + n] = keys[0, :, ctx - n : ctx].transpose(0, 1)
        v[start : start + n] = values[0, :, ctx - n : ctx].transpose(0, 1)
        seq = PrefillSeq(start, n, ctx, tile_rows, causal_mask(n, ctx, window, q.device))
        out[start : start + n] = _prefill(layer, q, k, v, cache, seq)
    return out


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float32, 2e-5)])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("window", [None, 20])
def test_prefill_kernel_matches_sdpa(kernels, dtype, atol, head_dim, window, group):
    dtype_name = str(dtype).removeprefix("torch.")
    if not kernels.paged_prefill_supported(dtype_name, head_dim, 16, group):
        pytest.skip(f"the paged prefill kernel is not built for {dtype_name} at this level")
    gen = torch.Generator().manual_seed(head_dim * group)
    num_blocks, num_layers, kv_heads, bs = 96, 2, 2, 16
    data = torch.randn(num_blocks, num_layers, 2, kv_heads, bs, head_dim, generator=gen)
    cache = PagedKVCache(data.to(dtype))
    # (new tokens, context): a whole prompt, chunks after a cached prefix on and off block
    # boundaries, one token, a prompt longer than one query tile.
    chunks = [(37, 37), (5, 100), (16, 32), (1, 1), (20, 53), (70, 70)]
    q_lens = torch.tensor([n for n, _ in chunks])
    context_lens = torch.tensor([ctx for _, ctx in chunks])
    q_starts = torch.cumsum(q_lens, 0) - q_lens
    max_blocks = -(-int(context_lens.max()) // bs)
    tables = torch.randperm(num_blocks, generator=gen)[: len(chunks) * max_blocks]
    tables = tables.view(len(chunks), max_blocks).contiguous()
    heads = kv_heads * group
    # q as the model passes it: a strided view of the fused q/k/v rows.
    qkv = torch.randn(int(q_lens.sum()), heads + 2 * kv_heads, head_dim, generator=gen)
    q = qkv.to(dtype)[:, :heads]
    for layer in range(num_layers):
        want = sdpa_reference(layer, q, cache, tables, q_starts, q_lens, context_lens, window)
        got = torch.zeros_like(want)
        kernels.paged_prefill(
            q,
            cache.tensor,
            tables,
            q_starts,
            q_lens,
            context_lens,
            layer,
            head_dim**-0.5,
            window or -1,
            got,
        )
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)


def test_prefill_kernel_exists_exactly_where_its_level_allows(isa_level, kernels):
    """bfloat16 from AVX512_BF16, float32 from AVX2, never float16: elsewhere the engine must
    take the SDPA path, and the build says so."""
    assert kernels.paged_prefill_supported("bfloat16", 64, 16, 3) == (
        isa_level >= CpuIsa.AVX512_BF16
    )
    assert kernels.paged_prefill_supported("float32", 64, 16, 3) == (isa_level >= CpuIsa.AVX2)
    assert not kernels.paged_prefill_supported("float16", 64, 16, 3)


@pytest.mark.skipif(host_isa() is CpuIsa.AMX, reason="the host's own builds cover every path")
@pytest.mark.parametrize("source", SOURCES)
def test_sources_compile_above_the_host_level(source):
    """The paths this host cannot run (AVX-512 BF16) still compile: a syntax-only build at the
    highest level, whose flags enable every path of every source."""
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{path}" for path in (*include_paths(), sysconfig.get_paths()["include"])]
    proc = subprocess.run(
        ["g++", "-std=c++20", "-fsyntax-only", "-fopenmp", "-DTORCH_EXTENSION_NAME=check",
         *CpuIsa.AMX.compiler_flags, *includes, str(CSRC_DIR / source)],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
