"""Convert a llama.cpp GGUF file into a Hugging Face-format model directory.

The output directory holds ``config.json``, ``model.safetensors`` (bfloat16, HF tensor names),
``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``, so the rest of the
engine only ever loads HF directories. Quantized tensors are dequantized with the ``gguf``
package in numpy; llama.cpp's rotary permutation of Llama q/k weights is undone. Every tensor is
then rounded to the nearest bfloat16 (ties to even), half the size of float32 (an 8B model: 16
instead of 32 GB). For quantized files, the usual GGUF, that rounding is below the
quantization error; float16 and float32 files lose the mantissa bits bfloat16 lacks, also when
the engine then runs in float32.

Supported: architectures ``llama`` and ``qwen2`` with a byte-level BPE (``gpt2``) vocabulary and
plain RoPE. Anything else raises ``ValueError`` naming what is unsupported.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from engine.loader.gguf_tokenizer import (
    GGUFVocab,
    build_tokenizer,
    generation_config,
    read_field,
    read_vocab,
    tokenizer_config,
)

logger = logging.getLogger(__name__)

# Bump when the output format changes so caches keyed on it are rebuilt (2: bfloat16 weights;
# a version 1 float32 directory is never reused, as if it were a version 2 one).
CONVERTER_VERSION = 2

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
_HF_ARCHITECTURE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True, slots=True)
class _ModelShape:
    """Hyperparameters read from `{arch}.*` metadata."""

    arch: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    context_length: int


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write the HF-format directory `out_dir` for the GGUF file `gguf_path`.

    Side effects: creates a temp directory next to `out_dir`, fills it, then renames it to
    `out_dir`, so readers never see a half-written directory. If another process creates
    `out_dir` first (a concurrent conversion of the same file), its result is kept and ours is
    discarded. Raises `FileExistsError` if `out_dir` exists on entry, `ValueError` for an
    unsupported architecture, tokenizer, pre-tokenizer or tensor.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists")
    reader = gguf.GGUFReader(gguf_path)
    arch = read_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    shape = _read_shape(reader, arch)
    vocab = read_vocab(reader)
    tokenizer = build_tokenizer(vocab)
    tensors = _read_tensors(reader, shape)
    vocab_size = tensors["model.embed_tokens.weight"].shape[0]
    tied = "lm_head.weight" not in tensors

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = out_dir.parent / f".{out_dir.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    tmp_dir.mkdir()
    try:
        _save_bfloat16(tensors, tmp_dir / "model.safetensors")
        tokenizer.save(str(tmp_dir / "tokenizer.json"))
        _write_json(tmp_dir / "config.json", _hf_config(shape, vocab, vocab_size, tied))
        _write_json(
            tmp_dir / "tokenizer_config.json", tokenizer_config(vocab, shape.context_length)
        )
        _write_json(tmp_dir / "generation_config.json", generation_config(vocab))
        try:
            os.replace(tmp_dir, out_dir)
        except OSError:
            if not (out_dir / "config.json").exists():
                raise
            logger.info("%s was written concurrently; keeping that copy", out_dir)
    finally:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir)


def _as_float(value: float) -> float:
    # GGUF stores float32; keep float32's shortest repr (1e-05, not 9.999999747378752e-06).
    return float(str(np.float32(value)))


def _read_shape(reader: gguf.GGUFReader, arch: str) -> _ModelShape:
    def key(name: str, *default: Any) -> Any:
        return read_field(reader, f"{arch}.{name}", *default)

    if key("expert_count", 0):
        raise ValueError(f"mixture-of-experts GGUF models ({arch}) are not supported")
    rope_scaling = key("rope.scaling.type", "none")
    if rope_scaling != "none":
        raise ValueError(f"RoPE scaling {rope_scaling!r} is not supported")
    hidden_size = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden_size // num_heads))
    rope_dims = int(key("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"partial rotary ({rope_dims} of {head_dim} dims) is not supported")
    return _ModelShape(
        arch=arch,
        num_layers=int(key("block_count")),
        hidden_size=hidden_size,
        intermediate_size=int(key("feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=_as_float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=_as_float(key("rope.freq_base", 10000.0)),
        context_length=int(key("context_length")),
    )


def _hf_tensor_name(gguf_name: str, num_layers: int) -> str:
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSORS and kind == "weight":
        return f"{_GLOBAL_TENSORS[base]}.weight"
    match = _LAYER_TENSOR_RE.fullmatch(gguf_name)
    if match and match[2] in _LAYER_TENSORS and int(match[1]) < num_layers:
        return f"model.layers.{match[1]}.{_LAYER_TENSORS[match[2]]}.{match[3]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} is not supported")


def _expected_tensor_names(shape: _ModelShape) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    for layer in range(shape.num_layers):
        prefix = f"model.layers.{layer}"
        names.update(f"{prefix}.{part}.weight" for part in _LAYER_TENSORS.values())
        if shape.arch == "qwen2":
            names.update(f"{prefix}.self_attn.{p}_proj.bias" for p in ("q", "k", "v"))
    return names


def _unpermute_rotary(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation.

    llama.cpp's converter reorders each head's output rows from HF's rotate-half layout
    (first half / second half of the head) to interleaved pairs (its GPT-J style RoPE): rows
    viewed as (head, half, pair) are stored as (head, pair, half). We swap them back.
    """
    head_rows = weights.shape[0] // num_heads
    grouped = weights.reshape(num_heads, head_rows // 2, 2, *weights.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weights.shape)


def _bfloat16_bits(weights: np.ndarray) -> np.ndarray:
    """`weights` rounded to the nearest bfloat16 (ties to even), as int16 bit patterns.

    gguf's BF16 quantizer is llama.cpp's float32 -> bfloat16 conversion; converting tensor by
    tensor keeps the peak memory near the bfloat16 model plus one float32 tensor.
    """
    as_float32 = np.ascontiguousarray(weights, dtype=np.float32)
    return gguf.quants.quantize(as_float32, gguf.GGMLQuantizationType.BF16).view(np.int16)


def _save_bfloat16(tensors: dict[str, np.ndarray], path: Path) -> None:
    """Write the bfloat16 bit patterns `tensors` as a bfloat16 safetensors file."""
    # Imported here: resolve_model imports this module in the router, which stays torch-free.
    import torch
    from safetensors.torch import save_file

    as_torch = {name: torch.from_numpy(bits).view(torch.bfloat16) for name, bits in tensors.items()}
    save_file(as_torch, str(path), metadata={"format": "pt"})


def _read_tensors(reader: gguf.GGUFReader, shape: _ModelShape) -> dict[str, np.ndarray]:
    """Every tensor under its HF name, as bfloat16 bit patterns (see `_bfloat16_bits`)."""
    tensors: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        hf_name = _hf_tensor_name(tensor.name, shape.num_layers)
        # ggml lists dims fastest-first; numpy wants them slowest-first.
        np_shape = tuple(int(dim) for dim in reversed(tensor.shape))
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(np_shape)
        if shape.arch == "llama" and ".attn_q." in tensor.name:
            weights = _unpermute_rotary(weights, shape.num_heads)
        elif shape.arch == "llama" and ".attn_k." in tensor.name:
            weights = _unpermute_rotary(weights, shape.num_kv_heads)
        tensors[hf_name] = _bfloat16_bits(weights)
    expected = _expected_tensor_names(shape)
    missing = sorted(expected - tensors.keys())
    unexpected = sorted(tensors.keys() - expected - {"lm_head.weight"})
    if missing or unexpected:
        raise ValueError(
            f"GGUF tensors do not match a {shape.arch} model: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return tensors


def _hf_config(shape: _ModelShape, vocab: GGUFVocab, vocab_size: int, tied: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": [_HF_ARCHITECTURE[shape.arch]],
        "model_type": shape.arch,
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "max_position_embeddings": shape.context_length,
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "bos_token_id": vocab.bos_token_id,
        "eos_token_id": vocab.eos_token_id,
        "pad_token_id": vocab.pad_token_id,
        "attention_dropout": 0.0,
        "torch_dtype": "bfloat16",
    }
    if shape.arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(
            use_sliding_window=False, sliding_window=None, max_window_layers=shape.num_layers
        )
    return config


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
