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
    """A frozen ``nn.Linear`` (``weight`` [out, in], optional ``bias``) whose weight lives in
    oneDNN's blocked layout: a packed copy, the given tensors are not kept."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
            weight.detach(), _DECODE_BATCH_HINT
        )
        self.bias = None if bias is None else bias.detach()

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
                setattr(module, name, PackedLinear(child.weight, child.bias))
                count += 1
        else:
            count += pack_linears(child)
    return count


def pack_lm_head(weight: torch.Tensor) -> PackedLinear | None:
    """A packed copy of the LM head ``weight`` (also when tied to the embeddings, which keep
    their own: about 2 bytes x vocab x hidden more memory), or None without packing."""
    if not packing_available() or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    return PackedLinear(weight)
