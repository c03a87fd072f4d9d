"""LoRA adapters in PEFT's saved format, read and checked against the model they adapt.

An adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``, ...) and ``adapter_model.safetensors`` (or PEFT's older ``adapter_model.bin``)
with one ``lora_A`` ``[r, in]`` and one ``lora_B`` ``[out, r]`` per adapted projection, named
``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight``. A projection's
output gains ``lora_B(lora_A(x)) * scaling`` with ``scaling = lora_alpha / r`` (``/ sqrt(r)``
with rsLoRA), as PEFT computes it.

What is not served is refused by name, never silently ignored: DoRA, trained biases,
``modules_to_save``, per-module rank or alpha patterns, and targets other than the decoder's
seven projections (the embeddings and the LM head).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.lora.names import check_adapter_name
from engine.model.config import ModelConfig

# The projections an adapter may target, by Hugging Face name (module path inside a layer).
TARGET_MODULES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
_WEIGHT_KEY = re.compile(r"layers\.(\d+)\.((?:self_attn|mlp)\.\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
_UNSERVED_OPTIONS = {
    "use_dora": "DoRA adapters",
    "modules_to_save": "modules_to_save (fully trained copies of modules)",
    "rank_pattern": "rank_pattern (per-module ranks)",
    "alpha_pattern": "alpha_pattern (per-module alphas)",
    "layers_to_transform": "layers_to_transform",
    "fan_in_fan_out": "fan_in_fan_out weights",
    "lora_bias": "lora_bias (trained biases of lora_B)",
    "layer_replication": "layer_replication",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows)",
    "target_parameters": "target_parameters",
}


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """One adapter's weights, ready to install: ``weights[(layer, module)] = (A, B)`` with
    ``A`` ``[rank, in]`` and ``B`` ``[out, rank]`` already multiplied by the scaling, in the
    model's dtype. Modules the adapter does not target are absent."""

    name: str
    path: str
    rank: int
    # sha256 of the weights file: blocks computed with other weights under the same name (an
    # adapter reloaded after retraining) never give prefix hits to this one.
    fingerprint: str
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def block_key(self) -> str:
        """What the adapter puts into its requests' block hashes (``block_extra_key``)."""
        return adapter_block_key(self.name, self.fingerprint)


def adapter_block_key(name: str, fingerprint: str) -> str:
    """The block key of adapter ``name`` whose weights file has sha256 ``fingerprint``."""
    return f"{name}@{fingerprint[:32]}"


def weights_fingerprint(path: str | Path) -> str:
    """The sha256 of the weights file of the PEFT adapter at ``path``; ``ValueError`` if it
    has none."""
    return hashlib.sha256(_weights_file(Path(path)).read_bytes()).hexdigest()


def load_lora_adapter(
    name: str, path: str | Path, model: ModelConfig, dtype: torch.dtype, max_rank: int
) -> LoraAdapter:
    """Read the PEFT adapter at ``path`` for ``model``; ``ValueError`` saying what is wrong
    (a missing file, an option not served, a rank over ``max_rank``, shapes that do not fit
    the model)."""
    check_adapter_name(name)
    directory = Path(path)
    config = _read_config(directory)
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r}: rank {rank} is over --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", 8)
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    tensors, fingerprint = _read_tensors(directory)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _WEIGHT_KEY.search(key)
        if match is None:
            raise ValueError(f"LoRA adapter {name!r}: unexpected tensor {key!r}")
        layer, module, side = int(match[1]), match[2], match[3]
        if module not in TARGET_MODULES:
            raise ValueError(
                f"LoRA adapter {name!r}: targets {module}, only {', '.join(TARGET_MODULES)} "
                "are served"
            )
        if layer >= model.num_layers:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} is not in the model")
        pairs.setdefault((layer, module), {})[side] = tensor
    if not pairs:
        raise ValueError(f"LoRA adapter {name!r}: no lora_A/lora_B weights in {directory}")
    weights = {}
    for (layer, module), sides in sorted(pairs.items()):
        if set(sides) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} lacks A or B")
        a, b = sides["A"], sides["B"]
        in_features, out_features = projection_shape(model, module)
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise ValueError(
                f"LoRA adapter {name!r}: layer {layer} {module} has lora_A {tuple(a.shape)} and "
                f"lora_B {tuple(b.shape)}; the model needs ({rank}, {in_features}) and "
                f"({out_features}, {rank})"
            )
        weights[(layer, module)] = (a.to(dtype), (b.float() * scaling).to(dtype))
    return LoraAdapter(
        name=name, path=str(directory), rank=rank, fingerprint=fingerprint, weights=weights
    )


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / "adapter_config.json"
    if not path.is_file():
        raise ValueError(f"LoRA adapter: no adapter_config.json in {directory}")
    config = json.loads(path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter: peft_type {config['peft_type']!r} is not LORA")
    for option, what in _UNSERVED_OPTIONS.items():
        if config.get(option):
            raise ValueError(f"LoRA adapter at {directory}: {what} are not served")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter at {directory}: trained biases are not served")
    targets = config.get("target_modules") or []
    served = {module.rpartition(".")[2] for module in TARGET_MODULES}
    if isinstance(targets, list):
        unserved = [t for t in targets if t.rpartition(".")[2] not in served]
        if unserved:
            raise ValueError(
                f"LoRA adapter at {directory}: targets {', '.join(unserved)}; only "
                f"{', '.join(sorted(served))} are served"
            )
    return config


def _weights_file(directory: Path) -> Path:
    for name in ("adapter_model.safetensors", "adapter_model.bin"):
        if (directory / name).is_file():
            return directory / name
    raise ValueError(f"LoRA adapter: no adapter_model.safetensors in {directory}")


def _read_tensors(directory: Path) -> tuple[dict[str, torch.Tensor], str]:
    """The weights file's tensors and its sha256."""
    path = _weights_file(directory)
    data = path.read_bytes()
    if path.suffix == ".safetensors":
        from safetensors.torch import load

        return load(data), hashlib.sha256(data).hexdigest()
    tensors = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    return tensors, hashlib.sha256(data).hexdigest()


def projection_shape(model: ModelConfig, module: str) -> tuple[int, int]:
    """``(in_features, out_features)`` of a projection of ``model``."""
    hidden, q_size = model.hidden_size, model.num_heads * model.head_dim
    kv_size = model.num_kv_heads * model.head_dim
    return {
        "self_attn.q_proj": (hidden, q_size),
        "self_attn.k_proj": (hidden, kv_size),
        "self_attn.v_proj": (hidden, kv_size),
        "self_attn.o_proj": (q_size, hidden),
        "mlp.gate_proj": (hidden, model.intermediate_size),
        "mlp.up_proj": (hidden, model.intermediate_size),
        "mlp.down_proj": (model.intermediate_size, hidden),
    }[module]
