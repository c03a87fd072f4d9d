"""The decoder's elementwise ops: the torch reference and the fused CPU kernels.

``TorchOps`` composes torch ops with Hugging Face's numerics (RMSNorm in float32 then rounded
and scaled, rotary as two multiplies and an add, SiLU then multiply). ``FusedCpuOps`` runs each
as one pass of a compiled kernel (``csrc/fused_ops.cpp``, float32 and bfloat16) with the same
rounding points; ``tests/engine/model/test_ops.py`` holds them to the reference.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from engine.model.rotary import apply_rotary


class TorchOps:
    """Reference ops, any dtype and device."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Hugging Face's RMSNorm bit for bit: normalize in float32, round, then scale.

        (``F.rms_norm`` straight on bfloat16 is both slower on CPU and rounds differently.)
        """
        return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight

    def add_rms_norm(
        self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``residual += x`` in place (the decoder's residual add), then its RMSNorm."""
        return self.rms_norm(residual.add_(x), weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for rows ``[gate | up]``."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int
    ) -> None:
        """Rotate heads ``[0, num_heads)`` of ``x`` [T, heads, D] in place (see ``cos_sin``)."""
        x[:, :num_heads] = apply_rotary(x[:, :num_heads], cos, sin)


class FusedCpuOps(TorchOps):
    """The compiled kernels of ``cpu_kernels`` for float32 and bfloat16 on CPU."""

    def __init__(self, kernels: ModuleType) -> None:
        self._kernels = kernels

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._kernels.rms_norm(x, weight, eps, None)

    def add_rms_norm(
        self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return self._kernels.rms_norm(x, weight, eps, residual)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._kernels.silu_and_mul(gate_up)

    def rotary_(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int
    ) -> None:
        self._kernels.rotary_(x, cos, sin, num_heads)
