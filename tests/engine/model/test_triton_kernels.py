"""The Triton decode and KV-write kernels against the torch reference paths (``attention``).

Without a GPU they run under Triton's interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET``); ``tests/gpu`` runs the same checks on CUDA tensors. Shapes are small:
the interpreter runs each program in Python.
"""

from __future__ import annotations

import pytest
import torch

from engine.model.attention import (
    AttentionMetadata,
    DecodeInputs,
    PagedKVCache,
    _decode,
    decode_bias,
)
from engine.model.kv_quant import KVQuant, dequantize_rows, quantize_rows

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from engine.model.triton_attention import compile_kernels, quant_code  # noqa: E402
from engine.model.triton_kernels.decode import paged_decode  # noqa: E402
from engine.model.triton_kernels.kv_rows import float_to_fp8_e4m3, fp8_e4m3_to_float  # noqa: E402
from engine.model.triton_kernels.kv_write import kv_write  # noqa: E402

QUANTS = [None, KVQuant.INT8, KVQuant.FP8_E4M3]
NUM_LAYERS, NUM_KV_HEADS, BLOCK_SIZE, NUM_BLOCKS = 2, 2, 16, 48


def make_cache(
    quant: KVQuant | None, dtype: torch.dtype, head_dim: int, device: str, seed: int = 0
) -> PagedKVCache:
    """A cache of random rows (8-bit rows quantized from random values)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, NUM_LAYERS, 2, NUM_KV_HEADS, BLOCK_SIZE, head_dim)
    values = torch.randn(shape, generator=gen)
    tensor = values.to(dtype) if quant is None else quantize_rows(values, quant)
    return PagedKVCache(tensor.to(device), quant, dtype)


def reference_decode(
    cache: PagedKVCache,
    layer: int,
    q: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """``attention._decode``'s torch path (gathers, eager scores, float32 softmax)."""
    max_len = tables.shape[1] * cache.block_size
    inputs = DecodeInputs(
        tables,
        lens,
        cache.tile_rows(tables),
        decode_bias(lens, max_len, window, q.dtype),
        None,
        window,
    )
    empty = torch.empty(0)
    meta = AttentionMetadata(empty, len(q), inputs, (), None, empty, empty)
    return _decode(layer, q, cache, meta)


def check_decode(
    device: str,
    dtype: torch.dtype,
    quant: KVQuant | None,
    window: int | None,
    num_heads: int = 4,
    head_dim: int = 32,
) -> None:
    """Rows of several context lengths (one past a piece of the context split, one of a
    single token) over shuffled block tables, and a padding row of length 0 (zeros)."""
    cache = make_cache(quant, dtype, head_dim, device)
    gen = torch.Generator().manual_seed(1)
    lens = [1, 17, 300, 45, 0]
    max_blocks = -(-max(lens) // BLOCK_SIZE)
    tables = torch.stack([torch.randperm(NUM_BLOCKS, generator=gen)[:max_blocks] for _ in lens]).to(
        device
    )
    lens_t = torch.tensor(lens, device=device)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    want = reference_decode(cache, 1, q, tables, lens_t, window)
    rotated = q
    if cache.key_rotation is not None:
        rotated = (q.float() @ cache.key_rotation).to(dtype)
    got = paged_decode(
        rotated,
        cache.tensor,
        1,
        tables.to(torch.int32),
        lens_t.to(torch.int32),
        512,
        head_dim**-0.5,
        window,
        quant_code(quant),
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[:-1].float(), want[:-1].float(), atol=tol, rtol=tol)
    assert torch.count_nonzero(got[-1]) == 0


def check_kv_write(device: str, dtype: torch.dtype, quant: KVQuant | None) -> None:
    """The kernel's rows equal ``PagedKVCache.write``'s bit for bit (same codes, same
    scales), other rows untouched; a slot of -1 writes nothing."""
    want = make_cache(quant, dtype, 32, device)
    got = make_cache(quant, dtype, 32, device)
    gen = torch.Generator().manual_seed(2)
    num_tokens = 12
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:num_tokens]
    slot_rows = want.slot_rows(slots // BLOCK_SIZE, slots % BLOCK_SIZE).to(device)
    k = (torch.randn(num_tokens, NUM_KV_HEADS, 32, generator=gen) * 3).to(dtype).to(device)
    v = torch.randn(num_tokens, NUM_KV_HEADS, 32, generator=gen).to(dtype).to(device)
    want.write(1, slot_rows[:-1], k[:-1], v[:-1])
    skipped = slot_rows.clone()
    skipped[-1] = -1
    keys = k if want.key_rotation is None else k.float() @ want.key_rotation
    max_code = 0.0 if quant is None else quant.max_code
    kv_write(got.tensor, 1, skipped, keys, v, quant_code(quant), max_code)
    if device == "cpu" or quant is None:
        assert torch.equal(got.tensor, want.tensor)
        return
    # CUDA's float32 division may round a scaled value across a code's half step: only the
    # written rows may differ, and by at most one code step (their scale) once dequantized.
    row_bytes = got.tensor.shape[-1]
    got_rows, want_rows = got.tensor.view(-1, row_bytes), want.tensor.view(-1, row_bytes)
    key_rows = (slot_rows[:-1] + 2 * NUM_KV_HEADS * BLOCK_SIZE).flatten()
    written = torch.cat([key_rows, key_rows + NUM_KV_HEADS * BLOCK_SIZE])
    changed = (got_rows != want_rows).any(dim=-1).nonzero().flatten()
    assert set(changed.tolist()) <= set(written.tolist())
    got_values = dequantize_rows(got_rows[written], quant, torch.float32)
    want_values = dequantize_rows(want_rows[written], quant, torch.float32)
    step = want_rows[written, -4:].contiguous().view(torch.float32)
    assert ((got_values - want_values).abs() <= step * 1.001).all()


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.value if q else "unquantized")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [None, 20])
def test_decode_matches_the_torch_path(quant, dtype, window):
    check_decode("cpu", dtype, quant, window)


@pytest.mark.parametrize("num_heads", [2, 6])
def test_decode_with_mqa_and_wider_groups(num_heads):
    check_decode("cpu", torch.float32, None, None, num_heads=num_heads, head_dim=16)


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.value if q else "unquantized")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kv_write_matches_the_torch_path(quant, dtype):
    check_kv_write("cpu", dtype, quant)


def test_fp8_codes_round_trip_every_value():
    """Every finite fp8 e4m3 code decodes to torch's value, and torch's encoding of those
    values and of midpoints between them (ties to even) is the kernel's."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float()
    finite = values.isfinite()
    decoded = _decode_codes(codes)
    assert torch.equal(decoded[finite], values[finite])
    sorted_values = values[finite].unique()
    midpoints = (sorted_values[1:] + sorted_values[:-1]) / 2
    samples = torch.cat([sorted_values, midpoints, torch.linspace(-448, 448, 1001)])
    assert torch.equal(_encode_values(samples), samples.to(torch.float8_e4m3fn).view(torch.uint8))


@triton.jit
def _decode_kernel(src, dst, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(dst + i, fp8_e4m3_to_float(tl.load(src + i)))


@triton.jit
def _encode_kernel(src, dst, n, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(dst + i, float_to_fp8_e4m3(tl.load(src + i, mask=i < n)), mask=i < n)


def _decode_codes(codes: torch.Tensor) -> torch.Tensor:
    out = torch.empty(len(codes), dtype=torch.float32, device=codes.device)
    _decode_kernel[(1,)](codes, out, N=len(codes))
    return out


def _encode_values(values: torch.Tensor) -> torch.Tensor:
    out = torch.empty(len(values), dtype=torch.uint8, device=values.device)
    _encode_kernel[(1,)](values, out, len(values), N=triton.next_power_of_2(len(values)))
    return out


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.value if q else "unquantized")
def test_compiling_every_variant_leaves_the_cache_as_it_was(quant):
    cache = make_cache(quant, torch.float32, 32, "cpu")
    before = cache.tensor.clone()
    compile_kernels(cache.tensor, quant, 4, 32, torch.float32, 20)
    assert torch.equal(cache.tensor, before)
