"""8-bit KV cache rows (``kv_quant``): quantize/dequantize bounds, the cache's writes and
gathers, and the compiled decode and prefill paths at every level against the torch reference."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache_spec import KVCacheSpec
from engine.model.attention import (
    AttentionMetadata,
    DecodeInputs,
    PagedKVCache,
    PrefillBatch,
    decode_bias,
    paged_attention,
)
from engine.model.kv_quant import (
    KVQuant,
    dequantize_rows,
    key_rotation,
    kv_quant_for,
    quantize_rows,
)
from tests.engine.model.test_cpu_kernels import sdpa_reference, torch_reference


def rows_of(shape: tuple[int, ...], seed: int, decades: tuple[int, int] = (-3, 2)) -> torch.Tensor:
    """Rows scaled over ``decades`` orders of magnitude, a zero row and a row of one value."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.logspace(*decades, shape[0])[:, None]
    x[0] = 0.0
    x[1] = -7.25
    return x


def test_int8_round_trip_is_within_half_a_step_of_each_row():
    x = rows_of((64, 64), 0)
    rows = quantize_rows(x, KVQuant.INT8)
    assert rows.dtype == torch.uint8 and rows.shape == (64, 68)
    back = dequantize_rows(rows, KVQuant.INT8, torch.float32)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert torch.all((back - x).abs() <= step / 2 * (1 + 1e-5) + 1e-30)
    assert torch.equal(back[0], torch.zeros(64))
    torch.testing.assert_close(back[1], x[1])  # a row's absmax is exact


def test_fp8_round_trip_is_within_e4m3_rounding():
    x = rows_of((64, 64), 1)
    back = dequantize_rows(quantize_rows(x, KVQuant.FP8_E4M3), KVQuant.FP8_E4M3, torch.float32)
    scale = x.abs().amax(-1, keepdim=True) / 448
    # 3 mantissa bits: half a step is 2**-4 of the value; subnormal codes step by 2**-9 * scale.
    bound = torch.maximum(x.abs() * 2**-4, scale * 2**-10) * (1 + 1e-5)
    assert torch.all((back - x).abs() <= bound)
    assert torch.equal(back[0], torch.zeros(64))


def test_bfloat16_input_quantizes_like_its_float32_value():
    x = rows_of((8, 32), 2).to(torch.bfloat16)
    for quant in KVQuant:
        assert torch.equal(quantize_rows(x, quant), quantize_rows(x.float(), quant))


def test_spec_of_an_8bit_cache_has_about_half_the_bytes_and_its_own_hash():
    shape = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "block_size": 16}
    bf16 = KVCacheSpec(**shape, dtype="bfloat16")
    int8 = KVCacheSpec(**shape, dtype="int8")
    fp8 = KVCacheSpec(**shape, dtype="fp8_e4m3")
    assert int8.block_shape == (30, 2, 3, 16, 68) and int8.quantized and not bf16.quantized
    assert int8.block_bytes == fp8.block_bytes == bf16.block_bytes * 68 // 128
    assert len({bf16.compat_hash(), int8.compat_hash(), fp8.compat_hash()}) == 3
    assert kv_quant_for("bfloat16") is None and kv_quant_for("fp8_e4m3") is KVQuant.FP8_E4M3
    with pytest.raises(ValueError, match="unsupported KV dtype 'int4'"):
        KVCacheSpec(**shape, dtype="int4")


def stored_key(k: torch.Tensor, quant: KVQuant) -> torch.Tensor:
    """What a gather returns of key ``k`` written to a float32 cache of ``quant``: int8 keys
    are quantized rotated (``key_rotation``) and rotated back."""
    rotation = key_rotation(quant, k.shape[-1])
    if rotation is None:
        return dequantize_rows(quantize_rows(k, quant), quant, torch.float32)
    return dequantize_rows(quantize_rows(k @ rotation, quant), quant, torch.float32) @ rotation


def test_int8_keys_are_stored_rotated_and_the_rotation_is_its_own_inverse():
    rotation = key_rotation(KVQuant.INT8, 64)
    assert rotation is not None
    torch.testing.assert_close(rotation @ rotation, torch.eye(64), atol=1e-6, rtol=0)
    assert key_rotation(KVQuant.FP8_E4M3, 64) is None and key_rotation(KVQuant.INT8, 80) is None
    # One outlier channel sets a row's absmax: rotated, the other channels keep their precision.
    k = torch.randn(256, 64, generator=torch.Generator().manual_seed(10))
    k[:, 5] *= 30
    plain = dequantize_rows(quantize_rows(k, KVQuant.INT8), KVQuant.INT8, torch.float32)
    others = [c for c in range(64) if c != 5]
    plain_err = (plain - k)[:, others].pow(2).mean()
    rotated_err = (stored_key(k, KVQuant.INT8) - k)[:, others].pow(2).mean()
    assert rotated_err < plain_err / 4


def quantized_cache(quant, dtype, num_blocks, num_layers, kv_heads, head_dim, seed):
    data = rows_of((num_blocks * num_layers * 2 * kv_heads * 16, head_dim), seed, (-1, 1))
    rows = quantize_rows(data, quant).view(num_blocks, num_layers, 2, kv_heads, 16, head_dim + 4)
    return PagedKVCache(rows.contiguous(), quant, dtype)


@pytest.mark.parametrize("quant", list(KVQuant), ids=lambda q: q.value)
def test_cache_write_then_gather_returns_the_dequantized_tokens(quant):
    cache = quantized_cache(quant, torch.float32, 8, 2, 3, 32, 3)
    gen = torch.Generator().manual_seed(4)
    k, v = torch.randn(5, 3, 32, generator=gen), torch.randn(5, 3, 32, generator=gen)
    blocks, offsets = torch.tensor([2, 2, 5, 7, 7]), torch.tensor([0, 15, 3, 8, 9])
    cache.write(1, cache.slot_rows(blocks, offsets), k, v)
    for i, (b, o) in enumerate(zip(blocks.tolist(), offsets.tolist(), strict=True)):
        keys, values = cache.gather(1, cache.tile_rows(torch.tensor([[b]])))
        want_k = stored_key(k[i], quant)
        want_v = dequantize_rows(quantize_rows(v[i], quant), quant, torch.float32)
        # Rotating back is a float32 matmul: its summation order depends on the matrix's shape
        # and the host's BLAS kernel (AVX2 hosts differ in the last bit).
        torch.testing.assert_close(keys[0, :, o], want_k, rtol=1e-6, atol=1e-6)
        assert torch.equal(values[0, :, o], want_v)
    layer = cache.dequantized_layer(1, torch.tensor([7, 2]))
    keys, values = cache.gather(1, cache.tile_rows(torch.tensor([[7, 2]])))
    assert torch.equal(layer[:, 0, 0].transpose(0, 1).reshape(3, 32, 32), keys[0])
    assert torch.equal(layer[:, 0, 1].transpose(0, 1).reshape(3, 32, 32), values[0])


def int16_query(q: torch.Tensor) -> torch.Tensor:
    """``q`` [..., D] as the AVX-512 kernel scores int8 keys against it: per head, int16 codes
    of step absmax / 32767 (``int8_decode_query_bits``)."""
    step = q.abs().amax(-1, keepdim=True) / 32767
    step = torch.where(step > 0, step, torch.ones_like(step))
    return (q / step).round().clamp(-32767, 32767) * step


@pytest.mark.parametrize("quant", list(KVQuant), ids=lambda q: q.value)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
@pytest.mark.parametrize("window", [None, 20])
def test_quantized_decode_kernel_matches_torch_path(kernels, quant, dtype, tol, head_dim, window):
    """The kernel against the torch path over the same rows, read as stored (unrotated: the
    kernel's query rotation is checked through ``paged_attention`` below); the reference runs
    in float32 (the torch path's bfloat16 matmuls round more than the kernel's float32 math),
    with the query the kernel scores int8 keys against (``int16_query``) where it quantizes
    one."""
    num_blocks, num_layers, kv_heads, group = 64, 2, 2, 3
    cache = quantized_cache(quant, dtype, num_blocks, num_layers, kv_heads, head_dim, head_dim)
    reference = PagedKVCache(cache.tensor, quant, torch.float32)
    reference.key_rotation = None
    gen = torch.Generator().manual_seed(5)
    lens = torch.tensor([1, 15, 16, 17, 40, 95])
    max_blocks = -(-int(lens.max()) // 16)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:max_blocks] for _ in lens])
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    q_ref = q.float()
    if quant is KVQuant.INT8 and kernels.int8_decode_query_bits(head_dim) == 16:
        q_ref = int16_query(q_ref)
    for layer in range(num_layers):
        want = torch_reference(layer, q_ref, reference, tables, lens, window)
        got = kernels.paged_decode_quantized(
            q,
            cache.tensor,
            tables,
            lens,
            layer,
            head_dim**-0.5,
            window or -1,
            quant.kernel_id,
            False,
        )
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("quant", list(KVQuant), ids=lambda q: q.value)
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_decode_rows_of_one_sequence_equal_each_row_alone(
    kernels, quant, head_dim, window, dtype
):
    """A decode with draft tokens is one row per token: the same block table, context lengths
    n, n + 1, ... (the AVX-512 path computes such a run in one task, each block read once; with
    bfloat16 queries over int8 at head_dim 64, the AMX tiles, 4 blocks a step).
    Every row's result is bit for bit the row computed alone, across block edges and runs
    longer than a task holds (9 heads: 7 rows)."""
    num_blocks, kv_heads, group = 64, 3, 3
    cache = quantized_cache(quant, torch.float32, num_blocks, 1, kv_heads, head_dim, 11)
    gen = torch.Generator().manual_seed(12)
    table = torch.randperm(num_blocks, generator=gen)[:8]
    other = torch.randperm(num_blocks, generator=gen)[:8]
    # Runs of 4 (crossing the 16/17 edge), 1, 9 (split in tasks) and a lone row of another table.
    lens = [14, 15, 16, 17, 40, *range(100, 109), 101]
    tables = torch.stack([table] * (len(lens) - 1) + [other])
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    args = (0, head_dim**-0.5, window or -1, quant.kernel_id, False)
    got = kernels.paged_decode_quantized(q, cache.tensor, tables, torch.tensor(lens), *args)
    for i, n in enumerate(lens):
        alone = kernels.paged_decode_quantized(
            q[i : i + 1], cache.tensor, tables[i : i + 1], torch.tensor([n]), *args
        )
        assert torch.equal(got[i : i + 1], alone), (i, n)


@pytest.mark.parametrize("quant", list(KVQuant), ids=lambda q: q.value)
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float32, 2e-5)])
def test_prefill_over_a_quantized_cache_matches_sdpa(kernels, quant, dtype, atol):
    """The compiled prefill kernel reads a step's context blocks dequantized into a scratch
    cache (``PrefillBatch.context_blocks``); SDPA over the gathered context is the reference."""
    dtype_name = str(dtype).removeprefix("torch.")
    if not kernels.paged_prefill_supported(dtype_name, 64, 16, 3):
        pytest.skip(f"the paged prefill kernel is not built for {dtype_name} at this level")
    num_blocks, kv_heads, group, head_dim = 48, 2, 3, 64
    cache = quantized_cache(quant, dtype, num_blocks, 2, kv_heads, head_dim, 6)
    gen = torch.Generator().manual_seed(7)
    chunks = [(37, 37), (5, 100), (16, 32), (20, 53)]
    q_lens = torch.tensor([n for n, _ in chunks])
    context_lens = torch.tensor([ctx for _, ctx in chunks])
    q_starts = torch.cumsum(q_lens, 0) - q_lens
    max_blocks = -(-int(context_lens.max()) // 16)
    tables = torch.randperm(num_blocks, generator=gen)[: len(chunks) * max_blocks]
    tables = tables.view(len(chunks), max_blocks).contiguous()
    q = torch.randn(int(q_lens.sum()), kv_heads * group, head_dim, generator=gen).to(dtype)
    context_blocks, local_tables = torch.unique(tables, return_inverse=True)
    batch = PrefillBatch(
        local_tables, q_starts, q_lens, context_lens, kernels, None, context_blocks
    )
    for layer in range(2):
        want = sdpa_reference(layer, q, cache, tables, q_starts, q_lens, context_lens, None)
        got = torch.zeros_like(want)
        context = cache.dequantized_layer(layer, batch.context_blocks)
        kernels.paged_prefill(
            q, context, local_tables, q_starts, q_lens, context_lens, 0, head_dim**-0.5, -1, got
        )
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)


def test_paged_attention_writes_quantized_rows_then_reads_them_back(kernels):
    """One decode step through ``paged_attention``: the new token's K/V are quantized into the
    cache, and the kernel's output equals the torch path's over the same cache."""
    quant, dtype, head_dim = KVQuant.INT8, torch.float32, 64
    outs = []
    for kernel in (kernels, None):
        cache = quantized_cache(quant, dtype, 16, 1, 3, head_dim, 8)
        gen = torch.Generator().manual_seed(9)
        q = torch.randn(2, 9, head_dim, generator=gen)
        k, v = (
            torch.randn(2, 3, head_dim, generator=gen),
            torch.randn(2, 3, head_dim, generator=gen),
        )
        tables, lens = torch.tensor([[3, 4], [9, 0]]), torch.tensor([20, 5])
        decode = DecodeInputs(tables, lens, None, None, kernel, None)
        if kernel is None:
            decode = DecodeInputs(
                tables,
                lens,
                cache.tile_rows(tables),
                decode_bias(lens, 32, None, dtype),
                None,
                None,
            )
        meta = AttentionMetadata(
            slot_rows=cache.slot_rows(torch.tensor([4, 9]), torch.tensor([3, 4])),
            num_decode_tokens=2,
            decode=decode,
            prefills=(),
            prefill_batch=None,
            cos=torch.empty(0),
            sin=torch.empty(0),
        )
        outs.append(paged_attention(0, q, k, v, cache, meta))
        keys, _ = cache.gather(0, cache.tile_rows(torch.tensor([[4]])))
        torch.testing.assert_close(keys[0, :, 3], stored_key(k[0], quant), atol=1e-6, rtol=0)
    # An int16 query (int8_decode_query_bits) is within 2**-16 of each head's absmax.
    atol = 1e-4 if kernels.int8_decode_query_bits(head_dim) == 16 else 1e-5
    torch.testing.assert_close(outs[0], outs[1], atol=atol, rtol=0)


@pytest.mark.parametrize("quant", list(KVQuant), ids=lambda q: q.value)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 80])
def test_compiled_write_and_dequantize_match_the_torch_reference(kernels, quant, dtype, head_dim):
    """``kv_write_quantized`` and ``dequantize_kv_blocks`` against ``PagedKVCache``'s torch
    writes and gathers: the same scales, codes at most one step apart (the Hadamard transform
    and the division round differently from torch's matmul), and the same dequantized values
    to within that step."""
    shape = (12, 2, 2, 3, 16, head_dim + 4)
    compiled = PagedKVCache(torch.zeros(shape, dtype=torch.uint8), quant, dtype, kernels)
    reference = PagedKVCache(torch.zeros(shape, dtype=torch.uint8), quant, dtype)
    gen = torch.Generator().manual_seed(head_dim)
    k = torch.randn(40, 3, head_dim, generator=gen) * torch.logspace(-2, 1, 40)[:, None, None]
    v = torch.randn(40, 3, head_dim, generator=gen)
    k[0] = 0.0
    blocks = torch.randperm(12, generator=gen)[:3].repeat_interleave(16)[:40]
    slots = compiled.slot_rows(blocks, torch.arange(40) % 16)
    for cache in (compiled, reference):
        cache.write(1, slots, k.to(dtype), v.to(dtype))
    got, want = compiled.tensor, reference.tensor
    torch.testing.assert_close(
        got[..., head_dim:].contiguous().view(torch.float32),
        want[..., head_dim:].contiguous().view(torch.float32),
        rtol=1e-5,
        atol=0,
    )
    codes_got = got[..., :head_dim].contiguous().view(quant.code_dtype).float()
    codes_want = want[..., :head_dim].contiguous().view(quant.code_dtype).float()
    step = 1.0 if quant is KVQuant.INT8 else codes_want.abs() * 2**-3 + 2**-9
    assert torch.all((codes_got - codes_want).abs() <= step * 1.0001)
    used = torch.unique(blocks)
    layer = compiled.dequantized_layer(1, used)
    assert layer.dtype == dtype and layer.shape == (3, 1, 2, 3, 16, head_dim)
    # Dequantizing the same rows: the compiled path against the torch one over ``got``.
    torch.testing.assert_close(
        layer.float(),
        PagedKVCache(got, quant, dtype).dequantized_layer(1, used).float(),
        atol=1e-5 if dtype == torch.float32 else 2e-2,
        rtol=1e-5 if dtype == torch.float32 else 1e-2,
    )


@pytest.mark.parametrize("quant", list(KVQuant), ids=lambda q: q.value)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_with_compiled_kernels_matches_the_torch_gather(kernels, quant, dtype):
    """``PagedKVCache.gather`` widens 8-bit rows with the compiled kernel when it has one: the
    same [B, KVH, tokens, D] keys and values as the torch gather of the same rows, for
    several sequences of several blocks each."""
    rows = quantized_cache(quant, torch.float32, 12, 3, 3, 64, 11).tensor
    compiled = PagedKVCache(rows, quant, dtype, kernels)
    reference = PagedKVCache(rows, quant, dtype)
    tile_rows = compiled.tile_rows(torch.tensor([[7, 2, 11], [0, 5, 5]]))
    for layer in (0, 2):
        got = compiled.gather(layer, tile_rows)
        want = reference.gather(layer, tile_rows)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape == (2, 3, 48, 64) and g.dtype == dtype
            torch.testing.assert_close(
                g.float(), w.float(), atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-2
            )
