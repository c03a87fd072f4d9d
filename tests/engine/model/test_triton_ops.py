"""The Triton elementwise ops against the torch reference ops they replace (``TorchOps``), in
bfloat16 and float32: under Triton's interpreter here, on CUDA in tests/gpu.

The interpreter converts float32 to bfloat16 by truncation, not to nearest as GPUs do, so on
CPU a value may sit one bfloat16 ulp off; on a GPU nearly all bits must agree.
"""

from __future__ import annotations

import pytest
import torch

from engine.model.ops import TorchOps
from engine.model.rotary import RotaryEmbedding

pytest.importorskip("triton")

from engine.model.triton_kernels.elementwise import TritonOps

BF16 = torch.bfloat16
ONE_ULP = 2**-7
TWO_ULPS = 2 * ONE_ULP
DTYPES = [BF16, torch.float32]


def randn(*shape: int, seed: int, dtype: torch.dtype, device: str, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)


def assert_close(got: torch.Tensor, want: torch.Tensor, ulps: float = ONE_ULP) -> None:
    """float32: to float32 precision. bfloat16: within ``ulps`` (one more on the interpreter,
    whose conversions truncate), and on a GPU nearly all bits equal."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        return
    on_gpu = got.device.type == "cuda"
    tol = ulps if on_gpu else ulps + 2 * ONE_ULP
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=1e-6 if on_gpu else 1e-2)
    if on_gpu:
        assert (got != want).float().mean().item() < 1e-3


def check_rms_norm(device: str, dtype: torch.dtype, num_tokens: int) -> None:
    x = randn(num_tokens, 576, seed=0, dtype=dtype, device=device, scale=3.0)
    weight = randn(576, seed=1, dtype=dtype, device=device)
    got = TritonOps().rms_norm(x, weight, 1e-5)
    assert_close(got, TorchOps().rms_norm(x, weight, 1e-5), TWO_ULPS)


def check_add_rms_norm(device: str, dtype: torch.dtype) -> None:
    residual = randn(37, 576, seed=2, dtype=dtype, device=device)
    x = randn(37, 576, seed=3, dtype=dtype, device=device)
    weight = randn(576, seed=4, dtype=dtype, device=device)
    want_residual, got_residual = residual.clone(), residual.clone()
    want = TorchOps().add_rms_norm(want_residual, x, weight, 1e-6)
    got = TritonOps().add_rms_norm(got_residual, x, weight, 1e-6)
    assert_close(got_residual, want_residual, 0.0)  # one rounding of a float32 sum
    assert_close(got, want, TWO_ULPS)


def check_silu_and_mul(device: str, dtype: torch.dtype, num_tokens: int) -> None:
    # Wide range: large negative gates (exp overflow side) and positive ones.
    gate_up = randn(num_tokens, 2 * 1536, seed=5, dtype=dtype, device=device, scale=20.0)
    assert_close(TritonOps().silu_and_mul(gate_up), TorchOps().silu_and_mul(gate_up))


def check_rotary(device: str, dtype: torch.dtype) -> None:
    """q (9 heads) and k (3) rotate in place, v (3) stays: the fused qkv projection's layout."""
    config = type("Config", (), {"head_dim": 64, "rope_theta": 10000.0, "rope_scaling": {}})()
    rope = RotaryEmbedding(config, 4096, dtype, torch.device(device))
    positions = torch.randint(0, 4096, (40,), generator=torch.Generator()).to(device)
    cos, sin = rope.cos_sin(positions)
    qkv = randn(40, 15 * 64, seed=6, dtype=dtype, device=device).view(40, 15, 64)
    want, got = qkv.clone(), qkv.clone()
    TorchOps().rotary_(want, cos, sin, 12)
    TritonOps().rotary_(got, cos, sin, 12)
    assert_close(got, want)
    assert torch.equal(got[:, 12:], qkv[:, 12:])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_rms_norm(dtype, num_tokens):
    check_rms_norm("cpu", dtype, num_tokens)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm_updates_the_residual_in_place(dtype):
    check_add_rms_norm("cpu", dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul(dtype):
    check_silu_and_mul("cpu", dtype, 3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_in_place_matches_and_leaves_other_heads(dtype):
    check_rotary("cpu", dtype)
