from __future__ import annotations

import pytest

from engine.tokenizer import Tokenizer

TEXTS = ["Hello world!", "The capital of France is Paris.", "café 東京 🙂", "  spaces  "]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def both(tiny_llama_dir):
    from transformers import AutoTokenizer

    return Tokenizer(tiny_llama_dir), AutoTokenizer.from_pretrained(tiny_llama_dir)


def test_encode_decode_match_transformers(both):
    ours, hf = both
    for text in TEXTS:
        assert ours.encode(text) == hf(text)["input_ids"]
        ids = ours.encode(text)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_chat_template_matches_transformers(both):
    ours, hf = both
    rendered = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(MESSAGES) == rendered
    assert ours.encode_chat(MESSAGES) == hf.encode(rendered, add_special_tokens=False)


def test_eos_ids_include_generation_config(both):
    ours, _ = both
    assert 0 in ours.eos_token_ids
