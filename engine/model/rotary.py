"""Rotary position embeddings (rotate-half convention, as in Hugging Face Llama)."""

from __future__ import annotations

import math

import torch

from engine.model.config import ModelConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = dict(config.rope_scaling)
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by ``factor``, a smooth band between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by position; applied in place of the model's dtype."""

    def __init__(
        self, config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        inv_freq = _inv_freq(config)
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim/2]
        cos = freqs.cos().to(dtype=dtype, device=device)
        sin = freqs.sin().to(dtype=dtype, device=device)
        # Whole rows, so that a step's tables are one gather each (see ``cos_sin``).
        self.cos = torch.cat((cos, cos), dim=-1)
        self.sin = torch.cat((-sin, sin), dim=-1)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables [T, 1, D] for token ``positions`` [T]; gathered once per step.

        Returned as ``[cos, cos]`` and ``[-sin, sin]`` so that rotating is two multiplies and
        an add: ``x * cos + cat(x2, x1) * sin`` equals ``(x1 cos - x2 sin, x2 cos + x1 sin)``
        bit for bit (negation is exact).
        """
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate heads ``x`` [T, heads, D] with tables from ``cos_sin``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin
