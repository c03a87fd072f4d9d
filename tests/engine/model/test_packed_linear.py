"""Packed bfloat16 linears must be bitwise equal to F.linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.model.packed_linear import (
    PackedLinear,
    pack_linears,
    pack_lm_head,
    packing_available,
)

pytestmark = pytest.mark.skipif(not packing_available(), reason="oneDNN packing unavailable")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
def test_packed_equals_f_linear(bias, num_tokens):
    torch.manual_seed(num_tokens)
    linear = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    x = torch.randn(num_tokens, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(PackedLinear(linear.weight, linear.bias)(x), linear(x))


def test_pack_linears_replaces_only_bfloat16_linears():
    model = nn.Sequential(
        nn.Linear(8, 8).to(torch.bfloat16), nn.Sequential(nn.Linear(8, 8)), nn.ReLU()
    )
    assert pack_linears(model) == 1
    assert isinstance(model[0], PackedLinear)
    assert isinstance(model[1][0], nn.Linear)


def test_packed_lm_head_equals_f_linear_and_needs_bfloat16_cpu():
    torch.manual_seed(0)
    weight = torch.randn(1000, 64, dtype=torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    head = pack_lm_head(weight)
    with torch.inference_mode():
        assert torch.equal(head(x), torch.nn.functional.linear(x, weight))
    assert pack_lm_head(weight.float()) is None
