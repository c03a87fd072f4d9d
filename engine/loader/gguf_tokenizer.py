"""Rebuild a Hugging Face tokenizer from a GGUF file's `tokenizer.*` metadata.

llama.cpp keeps a byte-level BPE vocabulary as token, token-type and merge arrays plus the name
of its pre-tokenizer (`tokenizer.ggml.pre`); this module turns those into a `tokenizers`
tokenizer that splits text the way llama.cpp does, and into the HF tokenizer/generation configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

_TOKEN_TYPE_CONTROL = int(gguf.TokenType.CONTROL)
_TOKEN_TYPE_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)

# llama.cpp's pre-tokenizer splits (llama-vocab.cpp), keyed by `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE = frozenset({"default", "gpt2", "gpt-2", "mpt", "olmo"})
# GPT-2's split after isolating every digit (HF: Digits(individual_digits=True) + ByteLevel).
_DIGITS_THEN_GPT2_PRE = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
)
_SPLIT_PRE = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
SUPPORTED_PRE_TOKENIZERS = tuple(sorted(_GPT2_PRE | _DIGITS_THEN_GPT2_PRE | set(_SPLIT_PRE)))


@dataclass(frozen=True, slots=True)
class GGUFVocab:
    """The `tokenizer.*` metadata of a byte-level BPE vocabulary."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    pre: str
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    unk_token_id: int | None
    eog_token_ids: tuple[int, ...]
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens[token_id]


_MISSING: Any = object()


def read_field(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """The metadata value under `key` as Python data; `default` (else `ValueError`) if absent."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata has no {key!r}")
        return default
    return field.contents()


def read_vocab(reader: gguf.GGUFReader) -> GGUFVocab:
    """Read the vocabulary; `ValueError` unless it is byte-level BPE with a known pre-tokenizer."""
    model = read_field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')"
        )
    pre = read_field(reader, "tokenizer.ggml.pre", "default")
    if pre not in SUPPORTED_PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)})"
        )
    tokens = list(read_field(reader, "tokenizer.ggml.tokens"))
    eos_token_id = read_field(reader, "tokenizer.ggml.eos_token_id", None)
    eog_token_ids = tuple(
        dict.fromkeys(
            token_id
            for token_id in (
                eos_token_id,
                read_field(reader, "tokenizer.ggml.eot_token_id", None),
                read_field(reader, "tokenizer.ggml.eom_token_id", None),
            )
            if token_id is not None
        )
    )
    return GGUFVocab(
        tokens=tokens,
        token_types=list(read_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))),
        merges=list(read_field(reader, "tokenizer.ggml.merges")),
        pre=pre,
        bos_token_id=read_field(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=eos_token_id,
        pad_token_id=read_field(reader, "tokenizer.ggml.padding_token_id", None),
        unk_token_id=read_field(reader, "tokenizer.ggml.unknown_token_id", None),
        eog_token_ids=eog_token_ids,
        add_bos_token=bool(read_field(reader, "tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(read_field(reader, "tokenizer.ggml.add_eos_token", False)),
        chat_template=read_field(reader, "tokenizer.chat_template", None),
    )


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLIT_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _post_processor(vocab: GGUFVocab) -> processors.PostProcessor:
    byte_level = processors.ByteLevel(trim_offsets=False)
    prefix = [vocab.token(vocab.bos_token_id)] if vocab.add_bos_token else []
    suffix = [vocab.token(vocab.eos_token_id)] if vocab.add_eos_token else []
    if None in prefix + suffix:
        raise ValueError("GGUF asks to add BOS/EOS but defines no such token id")
    if not prefix and not suffix:
        return byte_level
    single = [*prefix, "$A:0", *suffix]
    pair = [*single, *(f"{t}:1" for t in prefix), "$B:1", *(f"{t}:1" for t in suffix)]
    special_ids = {
        vocab.tokens[token_id]: token_id
        for token_id in (vocab.bos_token_id, vocab.eos_token_id)
        if token_id is not None
    }
    template = processors.TemplateProcessing(
        single=single,
        pair=pair,
        special_tokens=[(token, token_id) for token, token_id in special_ids.items()],
    )
    return processors.Sequence([byte_level, template])


def build_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    """A `tokenizers` byte-level BPE equivalent to llama.cpp's reading of the vocabulary.

    Invariant: every id keeps its GGUF meaning; CONTROL tokens become special added tokens and
    USER_DEFINED ones plain added tokens, so both are matched whole in text.
    """
    bpe = models.BPE(
        vocab={token: token_id for token_id, token in enumerate(vocab.tokens)},
        merges=[(left, right) for left, right in (m.split(" ", 1) for m in vocab.merges)],
        fuse_unk=False,
        byte_fallback=False,
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(vocab.pre)
    tokenizer.decoder = decoders.ByteLevel()
    typed = list(zip(vocab.tokens, vocab.token_types, strict=True))
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, token_type in typed
            if token_type == _TOKEN_TYPE_CONTROL
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, token_type in typed
            if token_type == _TOKEN_TYPE_USER_DEFINED
        ]
    )
    tokenizer.post_processor = _post_processor(vocab)
    return tokenizer


def tokenizer_config(vocab: GGUFVocab, model_max_length: int) -> dict[str, Any]:
    """`tokenizer_config.json`: special tokens, BOS/EOS flags and the chat template."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": vocab.add_bos_token,
        "add_eos_token": vocab.add_eos_token,
        "bos_token": vocab.token(vocab.bos_token_id),
        "eos_token": vocab.token(vocab.eos_token_id),
        "pad_token": vocab.token(vocab.pad_token_id),
        "unk_token": vocab.token(vocab.unk_token_id),
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if vocab.chat_template is not None:
        config["chat_template"] = vocab.chat_template
    return config


def generation_config(vocab: GGUFVocab) -> dict[str, Any]:
    """`generation_config.json`; `eos_token_id` lists end-of-turn/message ids too, if any."""
    eog = list(vocab.eog_token_ids)
    return {
        "bos_token_id": vocab.bos_token_id,
        "eos_token_id": eog if len(eog) > 1 else vocab.eos_token_id,
        "pad_token_id": vocab.pad_token_id,
    }
