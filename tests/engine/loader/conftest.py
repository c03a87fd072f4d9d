"""Fixtures shared by the loader tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tests.engine.loader.tiny_gguf import tiny_llama, train_tokenizer, write_gguf


@pytest.fixture(scope="session")
def trained_tokenizer() -> Tokenizer:
    return train_tokenizer("gpt-2")


@pytest.fixture
def tiny_llama_gguf(tmp_path: Path, trained_tokenizer: Tokenizer) -> Path:
    model = tiny_llama(trained_tokenizer.get_vocab_size())
    return write_gguf(tmp_path / "tiny-llama.gguf", model, trained_tokenizer)
