"""Serving several LoRA adapters in one batch: the model's projections gain a stack of slots.

``LoraStack.install`` wraps each of the decoder's fused projections (``qkv_proj``,
``o_proj``, ``gate_up_proj``, ``down_proj``) in a ``LoraLinear`` holding ``max_loras`` slots
of low-rank weights, ``A`` ``[slots, parts * max_rank, in]`` and ``B`` ``[slots, out, parts *
max_rank]``, where ``parts`` are the Hugging Face projections the fused one stands for (q, k
and v; gate and up): each part's ``A`` fills its own band of rows and its ``B`` the block of
the output it owns, zeros elsewhere, so one pair of matmuls serves every part and a smaller
rank or an untargeted part contributes exact zeros.

Each step, ``select`` says which slot each token's rows use (``-1``: none) and orders the rows
that use one by slot. A projection then gathers those rows once, computes ``(x_s @ A[s].T) @
B[s].T`` for each slot's segment ``x_s`` of them, and adds the result back once: a segmented
(grouped) low-rank matmul with one pair of matmuls per distinct adapter, whatever the number of
requests, run by torch's matmuls (oneDNN or MKL at the level the engine caps them to on CPU,
cuBLAS on a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.lora.adapter import LoraAdapter, projection_shape
from engine.model.config import ModelConfig
from engine.model.llama import LlamaForCausalLM

# A fused projection -> the Hugging Face projections it stands for, in output order.
FUSED_PARTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
RowSelector = slice | torch.Tensor


@dataclass(slots=True)
class StepSelection:
    """The current step's adapter rows: ``rows`` selects the rows that use an adapter, ordered
    by slot (a slice when they are one run already), and ``segments`` gives each slot its
    ``(slot, start, end)`` range within that order."""

    rows: RowSelector = field(default_factory=lambda: slice(0, 0))
    segments: list[tuple[int, int, int]] = field(default_factory=list)


class LoraLinear(nn.Module):
    """A projection plus its adapters' low-rank terms for the rows the step selects. The base
    projection (``base``, possibly packed for oneDNN later) is computed as before."""

    def __init__(
        self,
        base: nn.Module,
        part_sizes: Sequence[int],
        in_features: int,
        max_loras: int,
        max_rank: int,
        selection: StepSelection,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.part_sizes = tuple(part_sizes)
        self.max_rank = max_rank
        self._selection = selection
        bands = len(part_sizes) * max_rank
        self.lora_a = nn.Parameter(
            torch.zeros(max_loras, bands, in_features, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.lora_b = nn.Parameter(
            torch.zeros(max_loras, sum(part_sizes), bands, dtype=dtype, device=device),
            requires_grad=False,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x)
        selection = self._selection
        if not selection.segments:
            return out
        rows = selection.rows
        xs = x[rows]
        delta = out.new_empty((xs.shape[0], out.shape[1]))
        for slot, start, end in selection.segments:
            torch.matmul(
                xs[start:end] @ self.lora_a[slot].T, self.lora_b[slot].T, out=delta[start:end]
            )
        if isinstance(rows, slice):
            out[rows] += delta
        else:
            out.index_add_(0, rows, delta)
        return out

    def write(self, slot: int, parts: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Fill ``slot`` with one ``(A, B)`` per part (None: the part is not adapted)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        out_start = 0
        for index, (size, weights) in enumerate(zip(self.part_sizes, parts, strict=True)):
            if weights is not None:
                a, b = weights
                band = index * self.max_rank
                self.lora_a[slot, band : band + a.shape[0]] = a
                self.lora_b[slot, out_start : out_start + size, band : band + a.shape[0]] = b
            out_start += size


class LoraStack:
    """The adapters resident in a model, one slot each, and the step's row selection.

    Invariants: a name holds exactly one slot; a free slot's weights are zeros. Engine thread
    only (``select`` and the forward pass it precedes must not interleave with ``add``).
    """

    def __init__(
        self,
        layers: list[dict[str, LoraLinear]],
        selection: StepSelection,
        max_loras: int,
        max_rank: int,
    ) -> None:
        self._layers = layers
        self._selection = selection
        self.max_loras = max_loras
        self.max_rank = max_rank
        self._slots: dict[str, int] = {}

    @classmethod
    def install(
        cls, model: LlamaForCausalLM, config: ModelConfig, max_loras: int, max_rank: int
    ) -> LoraStack:
        """Wrap ``model``'s projections (a ``LlamaForCausalLM``; before its linears are packed)
        in ``LoraLinear``s sharing one selection; the stack that fills them."""
        selection = StepSelection()
        # A fused projection's input is its parts' (shared) input; its output, theirs in order.
        shapes = {
            fused: (
                [projection_shape(config, part)[1] for part in parts],
                projection_shape(config, parts[0])[0],
            )
            for fused, parts in FUSED_PARTS.items()
        }
        layers = []
        for decoder_layer in model.model.layers:
            wrapped = {}
            for fused, (part_sizes, in_features) in shapes.items():
                owner_name, attr = fused.split(".")
                owner = getattr(decoder_layer, owner_name)
                base = getattr(owner, attr)
                weight = base.weight
                assert isinstance(weight, torch.Tensor)
                lora = LoraLinear(
                    base, part_sizes, in_features, max_loras, max_rank, selection,
                    weight.dtype, weight.device,
                )  # fmt: skip
                setattr(owner, attr, lora)
                wrapped[fused] = lora
            layers.append(wrapped)
        return cls(layers, selection, max_loras, max_rank)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._slots)

    def add(self, adapter: LoraAdapter) -> None:
        """Install ``adapter`` in a free slot; ``ValueError`` when its name is taken or every
        slot is in use."""
        if adapter.name in self._slots:
            raise ValueError(f"LoRA adapter {adapter.name!r} is already loaded")
        free = sorted(set(range(self.max_loras)) - set(self._slots.values()))
        if not free:
            raise ValueError(f"LoRA adapter {adapter.name!r}: every slot is in use")
        slot = free[0]
        for layer, wrapped in enumerate(self._layers):
            for fused, lora in wrapped.items():
                lora.write(slot, [adapter.weights.get((layer, p)) for p in FUSED_PARTS[fused]])
        self._slots[adapter.name] = slot

    def remove(self, name: str) -> None:
        """Free ``name``'s slot (its weights become zeros); ``KeyError`` if not loaded."""
        slot = self._slots.pop(name)
        for wrapped in self._layers:
            for fused, lora in wrapped.items():
                lora.write(slot, [None] * len(FUSED_PARTS[fused]))

    def slot(self, name: str) -> int:
        """The slot of a loaded adapter (``KeyError`` if not loaded)."""
        return self._slots[name]

    def select(self, token_slots: Sequence[int], device: torch.device) -> None:
        """Set which slot each of the next forward pass's token rows uses (-1: none)."""
        order = sorted((s, i) for i, s in enumerate(token_slots) if s >= 0)
        segments: list[tuple[int, int, int]] = []
        for position, (slot, _) in enumerate(order):
            if segments and segments[-1][0] == slot:
                segments[-1] = (slot, segments[-1][1], position + 1)
            else:
                segments.append((slot, position, position + 1))
        rows = [i for _, i in order]
        selection = self._selection
        if rows and rows == list(range(rows[0], rows[0] + len(rows))):
            selection.rows = slice(rows[0], rows[-1] + 1)
        else:
            selection.rows = torch.tensor(rows, dtype=torch.long, device=device)
        selection.segments = segments
