"""Packed linears against F.linear: bitwise in bfloat16, to float32 rounding in float32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.cpu_isa import CpuIsa, host_isa
from engine.model.packed_linear import (
    PackedLinear,
    pack_linears,
    pack_lm_head,
    packing_supported,
)

BF16_PACKS = packing_supported(torch.bfloat16, host_isa())
needs_bf16_packing = pytest.mark.skipif(
    not BF16_PACKS, reason=f"oneDNN packs bfloat16 from avx512 up; host is {host_isa().value}"
)
pytestmark = pytest.mark.skipif(
    not packing_supported(torch.float32, host_isa()), reason="oneDNN packing unavailable"
)


@needs_bf16_packing
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
def test_packed_bfloat16_equals_f_linear(bias, num_tokens):
    torch.manual_seed(num_tokens)
    linear = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    x = torch.randn(num_tokens, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(PackedLinear(linear.weight, linear.bias)(x), linear(x))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
def test_packed_float32_matches_f_linear(bias, num_tokens):
    torch.manual_seed(num_tokens)
    linear = nn.Linear(576, 160, bias=bias)
    x = torch.randn(num_tokens, 576)
    with torch.inference_mode():
        got = PackedLinear(linear.weight, linear.bias)(x)
        torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)


def test_bfloat16_packs_only_from_avx512():
    assert not packing_supported(torch.bfloat16, CpuIsa.AVX2)
    assert not packing_supported(torch.bfloat16, CpuIsa.PORTABLE)
    assert packing_supported(torch.float32, CpuIsa.PORTABLE)
    assert not packing_supported(torch.float16, host_isa())


def test_pack_linears_replaces_the_linears_the_level_packs():
    model = nn.Sequential(
        nn.Linear(8, 8).to(torch.bfloat16), nn.Sequential(nn.Linear(8, 8)), nn.ReLU()
    )
    assert pack_linears(model, CpuIsa.AVX2) == 1
    assert isinstance(model[0], nn.Linear)  # bfloat16 below avx512: F.linear
    assert isinstance(model[1][0], PackedLinear)


@needs_bf16_packing
def test_pack_linears_packs_bfloat16_at_the_host_level():
    model = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8))
    assert pack_linears(model, host_isa()) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_lm_head_equals_f_linear_where_it_packs(dtype):
    torch.manual_seed(0)
    weight = torch.randn(1000, 64, dtype=dtype)
    x = torch.randn(5, 64, dtype=dtype)
    head = pack_lm_head(weight, host_isa())
    if not packing_supported(dtype, host_isa()):
        assert head is None
        return
    with torch.inference_mode():
        want = torch.nn.functional.linear(x, weight)
        if dtype == torch.bfloat16:
            assert torch.equal(head(x), want)
        else:
            torch.testing.assert_close(head(x), want, rtol=1e-5, atol=1e-5)
    assert pack_lm_head(weight.half(), host_isa()) is None
