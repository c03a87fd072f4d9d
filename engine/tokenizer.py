"""Tokenizer and chat template from a Hugging Face model directory, without transformers.

Torch-free (the router tokenizes): ``tokenizers`` for the vocabulary, a sandboxed Jinja2
environment for the chat template, as Hugging Face renders it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


class Tokenizer:
    """Encode/decode text and render chat messages for one model.

    ``eos_token_ids`` joins the tokenizer's eos token and ``generation_config.json``'s
    ``eos_token_id`` (an int or a list), which is what stops generation by default.
    """

    def __init__(self, model_dir: Path) -> None:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        self.backend = BackendTokenizer.from_file(str(path))
        config = _read_json(model_dir / "tokenizer_config.json")
        generation = _read_json(model_dir / "generation_config.json")
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.chat_template = config.get("chat_template")
        template_file = model_dir / "chat_template.jinja"
        if self.chat_template is None and template_file.is_file():
            self.chat_template = template_file.read_text()
        eos_ids = generation.get("eos_token_id")
        ids = set(
            eos_ids if isinstance(eos_ids, list) else [eos_ids] if eos_ids is not None else []
        )
        if (
            self.eos_token is not None
            and (eos := self.backend.token_to_id(self.eos_token)) is not None
        ):
            ids.add(eos)
        self.eos_token_ids = frozenset(ids)
        self.bos_token_id = (
            self.backend.token_to_id(self.bos_token) if self.bos_token is not None else None
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render ``messages`` (OpenAI's shape: role, content, tool_calls...) and ``tools``
        (OpenAI's function tools; None: no tools) with the model's chat template."""
        return self._compiled_template.render(
            messages=list(messages),
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the rendered conversation; the template supplies special tokens."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        return self.encode(text, add_special_tokens=False)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}
