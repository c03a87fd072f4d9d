"""``--load-format dummy``: a model from its ``config.json`` alone, with random weights, runs
like a loaded one (the shapes' benchmarks on machines the weights cannot reach)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.loader.hf import load_model
from loadtest.fixtures.tiny_model import TEST_SPEC, make_tiny_model


def test_a_config_only_model_loads_random_weights_and_generates(tmp_path: Path) -> None:
    spec = dataclasses.replace(TEST_SPEC, config_only=True, vocab_size=700)
    model_dir = make_tiny_model(tmp_path / "shape", "llama", spec=spec)
    assert not list(model_dir.glob("*.safetensors"))
    model, config = load_model(model_dir, torch.float32, torch.device("cpu"), "dummy")
    # The config's vocabulary, not the (smaller) trained tokenizer's.
    assert config.vocab_size == 700
    assert model.model.embed_tokens.weight.shape == (700, TEST_SPEC.hidden_size)
    norm = model.model.layers[0].input_layernorm
    assert torch.equal(norm, torch.ones_like(norm))
    weight = model.model.layers[0].self_attn.qkv_proj.weight
    assert 0.015 < weight.std().item() < 0.025
    llm = LLM(str(model_dir), load_format="dummy", dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    out = llm.generate([[5, 6, 7, 8]], params)[0]
    assert len(out.token_ids) == 5 and all(0 <= t < 700 for t in out.token_ids)
