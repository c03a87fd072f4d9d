"""Which implementation runs each part of the model on this host, chosen once at load.

``ModelRunner`` fills a ``KernelPlan`` from the device, the dtype and the CPU level
(``engine.cpu_isa``); the engine logs it at startup and workers report it in
``WorkerInfo.kernels`` (``splitserve status`` shows it per worker).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.cpu_isa import CpuIsa


class KernelImpl(enum.Enum):
    """One implementation of a model part."""

    TORCH = "torch"  # reference torch ops (any device and dtype)
    ONEDNN_PACKED = "onednn-packed"  # linears: weights pre-packed for oneDNN (packed_linear)
    CPP = "cpp"  # compiled CPU kernels (cpu_kernels, csrc/)
    SDPA = "sdpa"  # torch scaled_dot_product_attention (FlashAttention on CUDA)
    TRITON = "triton"  # Triton kernels over the paged cache (triton_kernels; GPUs)


@dataclass(frozen=True, slots=True)
class KernelPlan:
    """The implementation of each model part; ``cpu_isa`` is None off CPU."""

    cpu_isa: CpuIsa | None
    linear: KernelImpl
    decode_attention: KernelImpl
    prefill_attention: KernelImpl
    elementwise_ops: KernelImpl
    # Decode batch sizes replayed from CUDA graphs (``cuda_graphs``); 0: none, every step eager.
    decode_graphs: int = 0

    def describe(self) -> str:
        """One line, e.g. ``linear=onednn-packed decode=cpp prefill=sdpa ops=torch``, with
        `` graphs=N`` when decode steps replay CUDA graphs."""
        line = (
            f"linear={self.linear.value} decode={self.decode_attention.value} "
            f"prefill={self.prefill_attention.value} ops={self.elementwise_ops.value}"
        )
        return f"{line} graphs={self.decode_graphs}" if self.decode_graphs else line
