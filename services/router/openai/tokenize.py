"""vLLM's ``/tokenize`` and ``/detokenize``: the router's own tokenizer, with no worker involved.

``/tokenize`` takes a ``prompt`` (tokenized as ``/v1/completions`` tokenizes it) or chat
``messages`` and their ``tools`` (rendered by the model's chat template exactly as
``/v1/chat/completions`` renders them, so ``count`` is the chat request's
``usage.prompt_tokens``) and answers
``{count, max_model_len, tokens, token_strs}``. ``/detokenize`` turns ``tokens`` back into
text, special tokens included, so that ``detokenize(tokenize(x))`` gives the rendered prompt.
Both run off the event loop.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from engine.tokenizer import Tokenizer
from services.router.openai.errors import bad_request
from services.router.openai.protocol import Body, ChatMessage, TokenId, Tool
from services.router.openai.requests import add_tools, chat_messages
from services.router.request_prep import chat_or_prompt_token_ids
from services.router.tool_calls.parsers import ToolCallFormat
from services.router.tool_calls.tool_use import tool_use
from splitserve.v1 import router_pb2


class TokenizeRequest(Body):
    """A ``prompt`` or chat ``messages`` (exactly one), with vLLM's options."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = None
    # vLLM's defaults: True for a prompt; for messages the chat template adds its own.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[TokenId]


def tokenize(
    body: TokenizeRequest, tokenizer: Tokenizer, max_model_len: int | None
) -> dict[str, Any]:
    """``/tokenize``'s answer; ``OpenAIError`` 400 naming the field for bad input."""
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("prompt: exactly one of prompt and messages is required", "prompt")
    if body.prompt is not None:
        add_special_tokens = body.add_special_tokens is not False
        token_ids = tokenizer.encode(body.prompt, add_special_tokens=add_special_tokens)
    else:
        assert body.messages is not None
        if body.add_special_tokens:
            raise bad_request(
                "add_special_tokens: the chat template adds the special tokens of messages",
                "add_special_tokens",
            )
        request = router_pb2.GenerateRequest(messages=chat_messages(body.messages))
        add_tools(request, body.tools)
        try:
            # The format shapes only the parsing of calls, not their rendering.
            tools = tool_use(request, ToolCallFormat.HERMES)
            token_ids = chat_or_prompt_token_ids(
                request, tokenizer, body.add_generation_prompt, tools
            )
        except ValueError as exc:
            field = str(exc).split(":", 1)[0]
            param = field if field.startswith(("tools", "messages")) else "messages"
            raise bad_request(str(exc), param) from None
    token_strs = None
    if body.return_token_strs:
        token_strs = [tokenizer.backend.id_to_token(token_id) for token_id in token_ids]
    return {
        "count": len(token_ids),
        "max_model_len": max_model_len,
        "tokens": token_ids,
        "token_strs": token_strs,
    }


def detokenize(body: DetokenizeRequest, tokenizer: Tokenizer) -> dict[str, Any]:
    """``/detokenize``'s answer; ``OpenAIError`` 400 for an id outside the vocabulary."""
    vocab_size = tokenizer.vocab_size
    for i, token_id in enumerate(body.tokens):
        if token_id >= vocab_size:
            raise bad_request(
                f"tokens[{i}]: {token_id} is outside the vocabulary ({vocab_size} tokens)",
                f"tokens[{i}]",
            )
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}
