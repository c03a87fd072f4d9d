"""The fused CPU ops, at every level up to the host's (the ``kernels`` fixture), against the
torch reference ops they replace, in bfloat16 and float32."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from engine.model.ops import FusedCpuOps, TorchOps
from engine.model.rotary import RotaryEmbedding

BF16 = torch.bfloat16
# One bfloat16 ulp, relative: the fused kernels may round a value the other way where their
# float32 sum of squares or exp differs from torch's in the last bit.
ONE_ULP = 2**-7
# RMSNorm rounds twice (normalized, then times the weight): a normalized value on a bf16 tie
# that the sum order flips is one ulp off before the multiply, up to |weight| ulps after it.
TWO_ULPS = 2 * ONE_ULP


@pytest.fixture
def ops(kernels: ModuleType) -> tuple[TorchOps, FusedCpuOps]:
    return TorchOps(), FusedCpuOps(kernels)


@pytest.fixture(params=[BF16, torch.float32], ids=["bfloat16", "float32"])
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    return request.param


def randn(*shape: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def assert_within_one_ulp(got: torch.Tensor, want: torch.Tensor, ulps: float = ONE_ULP) -> None:
    """bfloat16: within ``ulps`` and nearly all bits equal. float32 (no rounding to the dtype
    between ops, so sums and exp differ in the last bits throughout): to float32 precision."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        return
    torch.testing.assert_close(got.float(), want.float(), rtol=ulps, atol=1e-6)
    assert (got != want).float().mean().item() < 1e-3  # nearly all bits equal


@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_rms_norm(ops, dtype, num_tokens):
    ref, fused = ops
    x = randn(num_tokens, 576, seed=0, dtype=dtype, scale=3.0)
    weight = randn(576, seed=1, dtype=dtype)
    got, want = fused.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5)
    assert_within_one_ulp(got, want, TWO_ULPS)


def test_add_rms_norm_updates_the_residual_in_place(ops, dtype):
    ref, fused = ops
    residual, x = randn(300, 576, seed=2, dtype=dtype), randn(300, 576, seed=3, dtype=dtype)
    weight = randn(576, seed=4, dtype=dtype)
    want_residual, got_residual = residual.clone(), residual.clone()
    want = ref.add_rms_norm(want_residual, x, weight, 1e-6)
    got = fused.add_rms_norm(got_residual, x, weight, 1e-6)
    assert torch.equal(got_residual, want_residual)  # one rounding of a float32 sum: exact
    assert_within_one_ulp(got, want, TWO_ULPS)


@pytest.mark.parametrize("num_tokens", [1, 300])
def test_silu_and_mul(ops, dtype, num_tokens):
    ref, fused = ops
    # Wide range: large negative gates (exp overflow side) and positive ones.
    gate_up = randn(num_tokens, 2 * 1536, seed=5, dtype=dtype, scale=20.0)
    assert_within_one_ulp(fused.silu_and_mul(gate_up), ref.silu_and_mul(gate_up))


def test_rotary_in_place_matches_and_leaves_other_heads(ops, dtype):
    """Bit-exact in bfloat16 (each product is rounded, as torch's ops do); in float32 the
    compiler may fuse a multiply and the add."""
    ref, fused = ops
    config = type("Config", (), {"head_dim": 64, "rope_theta": 10000.0, "rope_scaling": {}})()
    rope = RotaryEmbedding(config, 4096, dtype, torch.device("cpu"))
    cos, sin = rope.cos_sin(torch.randint(0, 4096, (300,), generator=torch.Generator()))
    # q (9 heads) and k (3) rotate, v (3) stays: the layout of the fused qkv projection.
    qkv = randn(300, 15 * 64, seed=6, dtype=dtype).view(300, 15, 64)
    want, got = qkv.clone(), qkv.clone()
    ref.rotary_(want, cos, sin, 12)
    fused.rotary_(got, cos, sin, 12)
    if dtype == BF16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[:, 12:], qkv[:, 12:])
