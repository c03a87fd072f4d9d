"""Linear layers with weights pre-packed for oneDNN, on CPU (float32 and bfloat16).

``F.linear`` on CPU hands its backend a plain ``[out, in]`` weight, which is reordered into a
blocked layout on every call; with a small batch (decode) that reorder is a sizeable share of
the matmul. Packing once at load removes it. In bfloat16 results are bitwise equal to
``F.linear`` (both run oneDNN); in float32 ``F.linear`` runs MKL, so sums are ordered
differently (checked to float32 rounding in ``tests/engine/model/test_packed_linear.py``).

Where packing runs (``packing_supported``): oneDNN's bfloat16 reorder needs AVX-512 (BW, VL,
DQ), so bfloat16 packs from ``CpuIsa.AVX512`` up; float32 packs at every level.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.cpu_isa import CpuIsa

logger = logging.getLogger(__name__)

_DECODE_BATCH_HINT = 64
PACKED_DTYPES = (torch.float32, torch.bfloat16)


def packing_supported(dtype: torch.dtype, level: CpuIsa) -> bool:
    """Whether weights of ``dtype`` can be packed on a CPU of ``level`` with this torch."""
    if dtype not in PACKED_DTYPES or (dtype == torch.bfloat16 and level < CpuIsa.AVX512):
        return False
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


def pack_linears(module: nn.Module, level: CpuIsa) -> int:
    """Replace every CPU ``nn.Linear`` under ``module`` whose dtype packs at ``level``, in
    place; returns the count.

    Shared (tied) weights are left alone so they keep serving their other users.
    """
    count = 0
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            weight = child.weight
            if weight.device.type == "cpu" and packing_supported(weight.dtype, level):
                setattr(module, name, PackedLinear(weight, child.bias))
                count += 1
        else:
            count += pack_linears(child, level)
    return count


def pack_lm_head(weight: torch.Tensor, level: CpuIsa) -> PackedLinear | None:
    """A packed copy of the LM head ``weight`` (also when tied to the embeddings, which keep
    their own: vocab x hidden x element size more memory), or None where it does not pack."""
    if weight.device.type != "cpu" or not packing_supported(weight.dtype, level):
        return None
    return PackedLinear(weight)
