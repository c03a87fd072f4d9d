"""What ``--device``, ``--dtype`` and ``--kv-cache-dtype`` resolve to on this host."""

from __future__ import annotations

import torch

from engine.cpu_isa import CpuIsa, cpu_auto_dtype
from engine.kv_cache_spec import QUANTIZED_KV_DTYPES


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, level: CpuIsa) -> str:
    """``--dtype``, with ``auto`` made concrete: on CUDA bfloat16 where supported, else
    float16; on CPU ``cpu_isa.cpu_auto_dtype`` (bfloat16 from AVX512_BF16, else float32)."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return cpu_auto_dtype(level)


def resolve_kv_cache_dtype(name: str, dtype: str, device: torch.device) -> str:
    """``--kv-cache-dtype`` made concrete for a model running in ``dtype`` on ``device``.

    ``auto``: int8 for a bfloat16 model on CPU, else the model's dtype. The rule comes from
    ``loadtest.bench.kv_cache_quality`` (BENCHMARKS.md): int8's distance from a bfloat16 cache is
    bfloat16's own distance from float32 (greedy agreement, top-1, NLL), so it costs nothing a
    bfloat16 model had not already given up; a float32 model keeps its exactness (token for
    token with Hugging Face); on CUDA the Triton kernels read 8-bit rows too, but their speed
    there is not measured yet. ``fp8`` is ``fp8_e4m3``; an unquantized cache must have the
    model's dtype.
    """
    if name == "auto":
        return "int8" if dtype == "bfloat16" and device.type == "cpu" else dtype
    if name == "fp8":
        return "fp8_e4m3"
    if name in QUANTIZED_KV_DTYPES or name == dtype:
        return name
    raise ValueError(
        f"--kv-cache-dtype {name} with --dtype {dtype}: an unquantized KV cache has the model's "
        f"dtype ({dtype}); choose auto, int8 or fp8_e4m3"
    )
