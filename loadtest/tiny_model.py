"""Tiny random-weight Hugging Face models, built offline: the tests' models and the benchmarks'.

The tokenizer is a byte-level BPE trained in seconds, on a few fixed sentences (tests) or on the
Python standard library's sources (benchmarks: always present locally, a realistic vocabulary).
Special tokens follow SmolLM2's ChatML layout: ``<|endoftext|>`` = 0, ``<|im_start|>`` = 1,
``<|im_end|>`` = 2. Weights are float32 safetensors so every ``--dtype`` can load them. Every
build is deterministic: the same spec and seed give the same files.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import shutil
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN_ID, BOS_TOKEN_ID, IM_END_TOKEN_ID = 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ARCHITECTURES = ("llama", "qwen2", "mistral")
SENTENCES = [
    "The capital of France is Paris. The capital of Germany is Berlin.",
    "Paged attention stores the key and value cache in fixed-size blocks.",
    "Continuous batching lets new requests join a running batch at every step.",
    "A prefill worker computes the prompt, a decode worker streams the tokens.",
    "Hello world! Numbers 0123456789 and punctuation: ,.;:?!-_()[]{}",
    "Unicode: café, naïve, 東京, emoji 🙂 and more text for the tokenizer to learn.",
] * 20
_STDLIB_TEXT_BYTES = 12 * 1024 * 1024


class Corpus(enum.Enum):
    """What the tokenizer is trained on."""

    SENTENCES = "sentences"  # ``SENTENCES``: a small vocabulary, trained in milliseconds
    STDLIB = "stdlib"  # the standard library's sources: a realistic vocabulary


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """The shape of a tiny model and its tokenizer."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    vocab_size: int
    corpus: Corpus
    eos_token_id: int
    rms_norm_eps: float
    # None: no padding row in the embedding (HF zeroes that row at initialization).
    pad_token_id: int | None = None
    # None: HF's default (0.02). Larger spreads the logits out, so that greedy comparisons
    # against HF do not hinge on last-bit float differences between near-ties.
    initializer_range: float | None = None
    tie_word_embeddings: bool = False
    # Write config.json and the tokenizer only (a shape whose random weights would take
    # minutes to write): such a model runs with ``--load-format dummy``. Its tokenizer keeps
    # at most ``_CONFIG_ONLY_TOKENIZER_VOCAB`` tokens; ids past it decode to nothing.
    config_only: bool = False
    rope_theta: float = 10000.0


# What the tests check the engine against HF with: small enough to build in about a second.
TEST_SPEC = TinyModelSpec(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    vocab_size=512,
    corpus=Corpus.SENTENCES,
    eos_token_id=PAD_TOKEN_ID,
    rms_norm_eps=1e-5,
    initializer_range=0.25,
)
# What benchmarks and smoke runs serve: big enough that a step costs what a small model's does.
BENCH_SPEC = TinyModelSpec(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    vocab_size=32000,
    corpus=Corpus.STDLIB,
    eos_token_id=IM_END_TOKEN_ID,
    rms_norm_eps=1e-6,
    pad_token_id=PAD_TOKEN_ID,
)

# SmolLM2-135M's shape with random weights: what runs where the real weights cannot travel (a
# GPU machine reached with the working tree only). A step costs the same whatever the weights.
SMOLLM2_SHAPE_SPEC = TinyModelSpec(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    vocab_size=49152,
    corpus=Corpus.STDLIB,
    eos_token_id=IM_END_TOKEN_ID,
    rms_norm_eps=1e-5,
    pad_token_id=PAD_TOKEN_ID,
    tie_word_embeddings=True,
)
# Llama-3-8B's shape (GQA 32:8, head_dim 128, 128,256-token vocabulary): config only.
LLAMA3_8B_SHAPE_SPEC = TinyModelSpec(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    vocab_size=128256,
    corpus=Corpus.STDLIB,
    eos_token_id=IM_END_TOKEN_ID,
    rms_norm_eps=1e-5,
    pad_token_id=PAD_TOKEN_ID,
    config_only=True,
    rope_theta=500000.0,
)
SHAPES = {
    "bench": BENCH_SPEC,
    "smollm2-135m": SMOLLM2_SHAPE_SPEC,
    "llama3-8b": LLAMA3_8B_SHAPE_SPEC,
}
_CONFIG_ONLY_TOKENIZER_VOCAB = 32000
_CAUSAL_LM_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}


def _stdlib_text(limit_bytes: int) -> Iterator[str]:
    """Python stdlib sources in a fixed order, up to ``limit_bytes`` (deterministic corpus)."""
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield text
        total += len(text)
        if total >= limit_bytes:
            return


def train_tokenizer(vocab_size: int, corpus: Corpus) -> Tokenizer:
    """Train a byte-level BPE tokenizer with the ChatML special tokens at ids 0..2."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = SENTENCES if corpus is Corpus.SENTENCES else _stdlib_text(_STDLIB_TEXT_BYTES)
    tokenizer.train_from_iterator(text, trainer=trainer)
    return tokenizer


def hf_config(arch: str, vocab_size: int, spec: TinyModelSpec = TEST_SPEC, **overrides: Any) -> Any:
    """The HF config of a ``spec``-shaped ``arch`` model (``overrides`` win)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    values: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=spec.eos_token_id,
        pad_token_id=spec.pad_token_id,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_theta=spec.rope_theta,
    )
    if spec.initializer_range is not None:
        values["initializer_range"] = spec.initializer_range
    values.update(overrides)
    if arch == "llama":
        return LlamaConfig(**values)
    if arch == "qwen2":
        return Qwen2Config(**values)
    if arch == "mistral":
        values.setdefault("sliding_window", None)
        return MistralConfig(**values)
    raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")


def make_tiny_model(
    out_dir: Path,
    arch: str = "llama",
    seed: int = 0,
    spec: TinyModelSpec = TEST_SPEC,
    **overrides: Any,
) -> Path:
    """Write a random ``arch`` model of ``spec`` (``overrides``: HF config fields) and its
    tokenizer to ``out_dir``. Side effect: creates or overwrites files there. Returns it."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    if spec.config_only:
        tokenizer = train_tokenizer(min(spec.vocab_size, _CONFIG_ONLY_TOKENIZER_VOCAB), spec.corpus)
        config = hf_config(arch, spec.vocab_size, spec, **overrides)
        config.architectures = [_CAUSAL_LM_CLASSES[arch]]  # what a saved model would record
        config.save_pretrained(out_dir)
        _write_tokenizer(out_dir, tokenizer, spec)
        return out_dir
    tokenizer = train_tokenizer(spec.vocab_size, spec.corpus)
    config = hf_config(arch, tokenizer.get_vocab_size(), spec, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "qwen2":
        # HF initializes biases to zero; random biases make the comparisons exercise them.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0.0, 0.5)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_TOKEN_ID, eos_token_id=spec.eos_token_id, pad_token_id=spec.pad_token_id
    )
    model.save_pretrained(out_dir)
    _write_tokenizer(out_dir, tokenizer, spec)
    return out_dir


def _write_tokenizer(out_dir: Path, tokenizer: Tokenizer, spec: TinyModelSpec) -> None:
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_TOKEN_ID],
        "eos_token": SPECIAL_TOKENS[spec.eos_token_id],
        "pad_token": SPECIAL_TOKENS[PAD_TOKEN_ID],
        "unk_token": SPECIAL_TOKENS[PAD_TOKEN_ID],
        "add_bos_token": False,
        "model_max_length": spec.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def make_tiny_llama(out_dir: Path, vocab_size: int | None = None, seed: int = 0) -> Path:
    """The benchmarks' model: a ``BENCH_SPEC`` Llama (hidden 256, 4 layers, GQA 8:4), with a
    smaller vocabulary if ``vocab_size`` is given (a quicker tokenizer to train)."""
    spec = (
        BENCH_SPEC if vocab_size is None else dataclasses.replace(BENCH_SPEC, vocab_size=vocab_size)
    )
    return make_tiny_model(out_dir, "llama", seed, spec)


def make_poisoned_model(src_dir: Path, out_dir: Path, poison_token_id: int) -> Path:
    """A copy of the tiny model at ``src_dir`` whose input embedding of ``poison_token_id`` is
    NaN: any request with that token gets non-finite logits, every other one is unchanged."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src_dir, out_dir)
    weights_path = out_dir / "model.safetensors"
    weights = load_file(weights_path)
    weights["model.embed_tokens.weight"][poison_token_id] = float("nan")
    save_file(weights, weights_path, metadata={"format": "pt"})
    return out_dir
