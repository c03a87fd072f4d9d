"""convert_gguf against references: the transformers model and tokenizer a GGUF was written
from, `gguf.quants` for quantized data, and transformers' own GGUF reader for SmolLM2.

The converter stores bfloat16, so each reference's weights are rounded to bfloat16 the same way
(torch's float32 -> bfloat16, round to nearest even) and compared exactly; logits are computed
in float32 on both sides from those same weights.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

from engine.loader.gguf import convert_gguf
from tests.engine.loader.tiny_gguf import (
    BOS_TOKEN_ID,
    CHAT_TEMPLATE,
    EOS_TOKEN_ID,
    SAMPLE_TEXTS,
    needs_smollm2,
    smollm2_gguf_path,
    tiny_llama,
    tiny_qwen2,
    train_tokenizer,
    write_gguf,
)

PROMPT_IDS = torch.tensor([[1, 5, 17, 42, 99, 7, 3, 250]])


def _convert(gguf_path: Path) -> Path:
    out_dir = gguf_path.parent / "hf"
    convert_gguf(gguf_path, out_dir)
    return out_dir


def _bf16(tensor: torch.Tensor) -> torch.Tensor:
    """What the converter stores for `tensor`: its nearest bfloat16."""
    return tensor.detach().to(torch.bfloat16)


def _bf16_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: _bf16(t) for name, t in model.state_dict().items()}


def _with_bf16_weights(model: PreTrainedModel) -> PreTrainedModel:
    """A float32 copy of `model` whose weights are rounded to bfloat16: the reference the
    converted model (loaded in float32) must match exactly."""
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for param in rounded.parameters():
            param.copy_(_bf16(param).float())
    return rounded


def _load_float32(out_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(PROMPT_IDS).logits


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_f32_llama_tensors_config_and_logits_match_source(
    tmp_path: Path, trained_tokenizer: Tokenizer
) -> None:
    model = tiny_llama(trained_tokenizer.get_vocab_size())
    out_dir = _convert(write_gguf(tmp_path / "m.gguf", model, trained_tokenizer))

    tensors = load_file(out_dir / "model.safetensors")
    expected = _bf16_state_dict(model)
    assert tensors.keys() == expected.keys()
    for name, tensor in expected.items():
        assert tensors[name].dtype == torch.bfloat16, name
        assert torch.equal(tensors[name], tensor), name
    # bfloat16 on disk: half of what float32 would take (plus the header).
    float32_bytes = sum(t.numel() * 4 for t in expected.values())
    assert (out_dir / "model.safetensors").stat().st_size < 0.51 * float32_bytes

    raw = _read_json(out_dir / "config.json")
    assert raw["architectures"] == ["LlamaForCausalLM"]
    assert raw["rope_theta"] == 10000.0
    assert raw["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert raw["torch_dtype"] == "bfloat16"
    config = AutoConfig.from_pretrained(out_dir)
    for field in (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_parameters",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert getattr(config, field) == getattr(model.config, field), field

    converted = _load_float32(out_dir)
    torch.testing.assert_close(
        _logits(converted), _logits(_with_bf16_weights(model)), rtol=0, atol=0
    )
    assert not list(tmp_path.glob(".hf.*")), "temp dir left behind"


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "llama-bpe"])
def test_tokenizer_encodes_like_the_trained_one(tmp_path: Path, pre: str) -> None:
    reference = train_tokenizer(pre)
    model = tiny_llama(reference.get_vocab_size())
    out_dir = _convert(write_gguf(tmp_path / "m.gguf", model, reference, pre=pre))

    converted = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    assert converted.get_vocab_size() == reference.get_vocab_size()
    for text in SAMPLE_TEXTS:
        expected = reference.encode(text).ids
        assert converted.encode(text).ids == expected, text
        assert converted.decode(expected, skip_special_tokens=False) == text
    assert converted.encode("<|im_start|>").ids == [BOS_TOKEN_ID]
    assert converted.encode("<think>").ids == [reference.token_to_id("<think>")]
    # CONTROL tokens are special (dropped by skip_special_tokens), USER_DEFINED ones are not.
    ids = converted.encode("<|im_end|><think>").ids
    assert converted.decode(ids, skip_special_tokens=True) == "<think>"

    tokenizer_config = _read_json(out_dir / "tokenizer_config.json")
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE
    assert tokenizer_config["bos_token"] == "<|im_start|>"
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert tokenizer_config["add_bos_token"] is False
    generation_config = _read_json(out_dir / "generation_config.json")
    assert generation_config["bos_token_id"] == BOS_TOKEN_ID
    assert generation_config["eos_token_id"] == EOS_TOKEN_ID


def test_add_bos_token_and_end_of_turn(tmp_path: Path, trained_tokenizer: Tokenizer) -> None:
    model = tiny_llama(trained_tokenizer.get_vocab_size())
    gguf_path = write_gguf(
        tmp_path / "m.gguf", model, trained_tokenizer, add_bos_token=True, eot_token_id=0
    )
    out_dir = _convert(gguf_path)

    converted = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    text = SAMPLE_TEXTS[1]
    assert converted.encode(text).ids == [BOS_TOKEN_ID, *trained_tokenizer.encode(text).ids]
    assert converted.encode(text, add_special_tokens=False).ids == (
        trained_tokenizer.encode(text).ids
    )
    assert _read_json(out_dir / "tokenizer_config.json")["add_bos_token"] is True
    assert _read_json(out_dir / "config.json")["eos_token_id"] == EOS_TOKEN_ID
    assert _read_json(out_dir / "generation_config.json")["eos_token_id"] == [EOS_TOKEN_ID, 0]


def test_q8_0_weights_equal_gguf_dequantization(
    tmp_path: Path, trained_tokenizer: Tokenizer
) -> None:
    model = tiny_llama(trained_tokenizer.get_vocab_size())
    qtype = gguf.GGMLQuantizationType.Q8_0
    out_dir = _convert(write_gguf(tmp_path / "m.gguf", model, trained_tokenizer, qtype=qtype))

    tensors = load_file(out_dir / "model.safetensors")
    for name, tensor in model.state_dict().items():
        original = tensor.numpy()
        if original.ndim == 1:
            assert torch.equal(tensors[name], _bf16(tensor)), name
            continue
        # Q8_0 blocks run along a row and llama.cpp's q/k permutation moves whole rows, so
        # the unpermuted result must be the plain round trip of the unpermuted weights.
        round_trip = gguf.quants.dequantize(gguf.quants.quantize(original, qtype), qtype)
        assert torch.equal(tensors[name], _bf16(torch.from_numpy(round_trip))), name
        # Within one quantization step of the source, bfloat16 rounding included.
        step = np.abs(original).max() / 127
        converted = tensors[name].float().numpy()
        np.testing.assert_allclose(converted, original, rtol=0, atol=step, err_msg=name)


def test_tied_embeddings_have_no_lm_head(tmp_path: Path, trained_tokenizer: Tokenizer) -> None:
    model = tiny_llama(trained_tokenizer.get_vocab_size(), tied=True)
    out_dir = _convert(write_gguf(tmp_path / "m.gguf", model, trained_tokenizer))

    assert "lm_head.weight" not in load_file(out_dir / "model.safetensors")
    assert _read_json(out_dir / "config.json")["tie_word_embeddings"] is True
    converted = _load_float32(out_dir)
    torch.testing.assert_close(
        _logits(converted), _logits(_with_bf16_weights(model)), rtol=0, atol=0
    )


def test_qwen2_keeps_qkv_biases_unpermuted(tmp_path: Path, trained_tokenizer: Tokenizer) -> None:
    model = tiny_qwen2(trained_tokenizer.get_vocab_size())
    out_dir = _convert(write_gguf(tmp_path / "m.gguf", model, trained_tokenizer))

    tensors = load_file(out_dir / "model.safetensors")
    expected = _bf16_state_dict(model)
    assert tensors.keys() == expected.keys()
    assert "model.layers.0.self_attn.q_proj.bias" in tensors
    for name, tensor in expected.items():
        assert torch.equal(tensors[name], tensor), name
    config = _read_json(out_dir / "config.json")
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["model_type"] == "qwen2"
    converted = _load_float32(out_dir)
    torch.testing.assert_close(
        _logits(converted), _logits(_with_bf16_weights(model)), rtol=0, atol=0
    )


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    gguf_path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(gguf_path, "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    with pytest.raises(ValueError, match=r"'mamba'.*supported: llama, qwen2"):
        convert_gguf(gguf_path, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_existing_output_dir_is_refused(tmp_path: Path, tiny_llama_gguf: Path) -> None:
    out_dir = tmp_path / "hf"
    out_dir.mkdir()
    with pytest.raises(FileExistsError):
        convert_gguf(tiny_llama_gguf, out_dir)


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    gguf_path = smollm2_gguf_path()
    assert gguf_path is not None
    out_dir = tmp_path_factory.mktemp("smollm2") / "hf"
    convert_gguf(gguf_path, out_dir)
    yield out_dir
    shutil.rmtree(out_dir)  # 270 MB; pytest keeps old temp dirs around


@needs_smollm2
def test_smollm2_config(smollm2_dir: Path) -> None:
    config = _read_json(smollm2_dir / "config.json")
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["rms_norm_eps"] == 1e-05
    assert config["rope_theta"] == 100000.0
    assert config["max_position_embeddings"] == 8192
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


@needs_smollm2
def test_smollm2_tokenizer_matches_transformers(smollm2_dir: Path) -> None:
    gguf_path = smollm2_gguf_path()
    assert gguf_path is not None
    reference = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    ours = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    tokenizer_config = _read_json(smollm2_dir / "tokenizer_config.json")
    assert tokenizer_config["chat_template"] == reference.chat_template
    assert tokenizer_config["add_bos_token"] is False

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n")
    texts = [*SAMPLE_TEXTS, "Hello world 2024!", "3.14159 and 1,000,000", "x 12345 y", prompt]
    # Whitespace runs before a digit are where the two legitimately differ; see below.
    for text in (t for t in texts if not re.search(r"\s\s\d", t)):
        assert ours.encode(text).ids == reference(text).input_ids, text
    # llama.cpp's "smollm" pre-tokenizer (like SmolLM2's own tokenizer.json) isolates every
    # digit before the GPT-2 split, so two spaces before a digit stay one "ĠĠ" token;
    # transformers' GGUF tokenizer omits that step and yields "Ġ", "Ġ" here.
    assert ours.encode("a  1").tokens == ["a", "ĠĠ", "1"]


@needs_smollm2
def test_smollm2_weights_and_logits_match_transformers_gguf_reader(smollm2_dir: Path) -> None:
    # transformers' GGUF model loading needs `accelerate`; load_gguf_checkpoint is its
    # dequantize + reverse-permute path without it. The meta model only supplies tensor names.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path = smollm2_gguf_path()
    assert gguf_path is not None
    ours = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.device("meta"):
        names_only = LlamaForCausalLM(ours.config)
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=names_only)

    our_config = _read_json(smollm2_dir / "config.json")
    shared_fields = [key for key in parsed["config"] if key in our_config]
    assert len(shared_fields) >= 12
    for field in shared_fields:
        assert parsed["config"][field] == pytest.approx(our_config[field]), field
    our_state = ours.state_dict()
    rounded = {name: _bf16(tensor).float() for name, tensor in parsed["tensors"].items()}
    for name, tensor in rounded.items():
        assert torch.equal(our_state[name], tensor), name

    reference = LlamaForCausalLM.from_pretrained(
        None, config=LlamaConfig(**parsed["config"]), state_dict=rounded, dtype=torch.float32
    ).eval()
    torch.testing.assert_close(_logits(ours), _logits(reference), rtol=0, atol=1e-4)


@needs_smollm2
def test_smollm2_greedy_chat_answer(smollm2_dir: Path) -> None:
    model = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(prompt_ids, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(out[0, prompt_ids.shape[1] :], skip_special_tokens=True)
    assert answer.startswith("The capital of France is Paris.")
