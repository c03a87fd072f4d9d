"""bfloat16 linear layers with weights pre-packed for oneDNN, on CPU.

``F.linear`` in bfloat16 on CPU hands oneDNN a plain ``[out, in]`` weight, which it reorders
into its blocked layout on every call; with a small batch (decode) that reorder is a sizeable
share of the matmul. Packing once at load removes it. Results are bitwise equal to
``F.linear`` (checked in ``tests/engine/model/test_packed_linear.py``).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

_DECODE_BATCH_HINT = 64


def packing_available() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """A frozen ``nn.Linear`` whose weight lives in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, _DECODE_BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def pack_linears(module: nn.Module) -> int:
    """Replace every bfloat16 CPU ``nn.Linear`` under ``module`` in place; returns the count.

    Shared (tied) weights are left alone so they keep serving their other users.
    """
    if not packing_available():
        logger.info("oneDNN weight packing unavailable; using F.linear")
        return 0
    count = 0
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16:
            if child.weight.device.type == "cpu":
                setattr(module, name, PackedLinear(child))
                count += 1
        else:
            count += pack_linears(child)
    return count
