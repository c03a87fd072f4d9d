"""Load a Hugging Face model directory (``config.json`` + ``*.safetensors``) into our model."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model.config import ModelConfig
from engine.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# HF checkpoint name fragment -> (our fused parameter fragment, shard index)
_STACKED = {
    ".self_attn.q_proj.": (".self_attn.qkv_proj.", 0),
    ".self_attn.k_proj.": (".self_attn.qkv_proj.", 1),
    ".self_attn.v_proj.": (".self_attn.qkv_proj.", 2),
    ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0),
    ".mlp.up_proj.": (".mlp.gate_up_proj.", 1),
}
_RENAMED = {
    ".input_layernorm.weight": ".input_layernorm",
    ".post_attention_layernorm.weight": ".post_attention_layernorm",
    "model.norm.weight": "model.norm",
}


def load_model(
    model_dir: Path, dtype: torch.dtype, device: torch.device, load_format: str = "auto"
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model for ``model_dir`` and fill every parameter from its safetensors files,
    or with ``load_format="dummy"`` (vLLM's name) with random values from ``config.json`` alone.

    Raises ``ValueError`` for an unsupported architecture and if a parameter is left unset.
    """
    config = ModelConfig.from_dir(model_dir)
    start_s = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    if load_format == "dummy":
        _fill_randomly(model)
        model.eval()
        logger.info("random weights (load format dummy) for %s", config.architecture)
        return model, config
    files = _weight_files(model_dir)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                _load_tensor(model, config, params, name, f.get_tensor(name), loaded)
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks parameters: {sorted(missing)[:8]}")
    model.eval()
    logger.info(
        "loaded %s (%s) in %.1f s", model_dir, config.architecture, time.perf_counter() - start_s
    )
    return model, config


def _fill_randomly(model: LlamaForCausalLM) -> None:
    """Weights as a freshly initialized checkpoint has them: norms at one, the rest normal
    with HF's default spread (what a step costs does not depend on the values)."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1 and param.shape[0] == model.config.hidden_size:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)


def _weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint as transformers reads it: the shards ``model.safetensors.index.json``
    lists, else ``model.safetensors``, else every ``*.safetensors`` file.

    Repos such as Mistral's also hold the same weights in another layout
    (``consolidated.safetensors``), which the index or the single file keeps out.
    """
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{model_dir} lacks shards its index lists: {missing[:4]}")
        return files
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors files")
    return files


def _shard_sizes(config: ModelConfig, fused: str) -> list[int]:
    if "qkv_proj" in fused:
        q = config.num_heads * config.head_dim
        kv = config.num_kv_heads * config.head_dim
        return [q, kv, kv]
    return [config.intermediate_size, config.intermediate_size]


def _load_tensor(
    model: LlamaForCausalLM,
    config: ModelConfig,
    params: dict[str, torch.nn.Parameter],
    name: str,
    tensor: torch.Tensor,
    loaded: set[str],
) -> None:
    if "rotary_emb.inv_freq" in name:
        return
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return
    for fragment, (fused, shard) in _STACKED.items():
        if fragment in name:
            target = name.replace(fragment, fused)
            sizes = _shard_sizes(config, fused)
            offset = sum(sizes[:shard])
            with torch.no_grad():
                params[target].narrow(0, offset, sizes[shard]).copy_(tensor)
            # The fused parameter counts as loaded once its last shard arrives.
            loaded.add(f"{target}#{shard}")
            if all(f"{target}#{i}" in loaded for i in range(len(sizes))):
                loaded.add(target)
            return
    for fragment, ours in _RENAMED.items():
        if name.endswith(fragment):
            name = name.replace(fragment, ours)
            break
    if name not in params:
        raise ValueError(f"unexpected checkpoint tensor {name!r} for {config.architecture}")
    with torch.no_grad():
        params[name].copy_(tensor)
    loaded.add(name)
