"""The request bodies of ``/v1/chat/completions`` and ``/v1/completions``.

Fields follow OpenAI's API plus vLLM's sampling extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``cache_salt``) and its structured
output ones (``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``,
``structured_outputs``; see ``structured``), OpenAI's tool calling (``tools``,
``tool_choice``, ``parallel_tool_calls``; assistant ``tool_calls`` and ``role: tool`` messages in
the history), and the prompt's own logprobs (completions' ``echo``; vLLM's ``prompt_logprobs``
on both). Unknown fields are ignored, as OpenAI-compatible
servers do; a value this server cannot honour (``logit_bias``, ``suffix``...) is refused by
``unsupported()`` with a 400 naming the field rather than silently dropped. Ranges that the
engine checks anyway (temperature, top_p, penalties...) are left to it, so both APIs say the
same thing.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
# Prompts x choices of one completions request: each is a generation of its own in the
# cluster. Choices (n) and logprobs are bounded by the router's flags (``RequestBudget``).
MAX_GENERATIONS = 128

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class Body(BaseModel):
    """A request body: unknown fields are ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="ignore")


class StreamUsage(enum.Enum):
    """Where a stream reports usage (``stream_options``)."""

    NONE = "none"
    LAST_CHUNK = "last_chunk"  # include_usage: a last chunk with no choices
    EVERY_CHUNK = "every_chunk"  # and vLLM's continuous_usage_stats: each chunk's, so far


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False

    @property
    def usage(self) -> StreamUsage:
        if not self.include_usage:
            return StreamUsage.NONE
        return StreamUsage.EVERY_CHUNK if self.continuous_usage_stats else StreamUsage.LAST_CHUNK


class ContentPart(Body):
    type: str
    text: str | None = None


class FunctionCall(Body):
    name: str
    arguments: str  # a JSON object, as JSON text (OpenAI's)


class ToolCall(Body):
    """A call the assistant made, as the history gives it back."""

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool


class FunctionDefinition(Body):
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: ToolChoiceFunction


class _Sampling(Body):
    """The fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int = Field(1, ge=1, le=INT32_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions.
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    cache_salt: str | None = None
    # Structured output: OpenAI's, then vLLM's (at most one of them per request).
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's: N top alternatives of each prompt token (-1: the whole vocabulary, which
    # --max-logprobs refuses unless it allows that many).
    prompt_logprobs: int | None = Field(None, ge=-1, le=INT32_MAX)
    # vLLM's: lower runs first (never better than the key's tenant's, which is the default).
    priority: int | None = Field(None, ge=-INT32_MAX - 1, le=INT32_MAX)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for a value this server cannot honour; None when it can."""
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        if self.stream and self.prompt_logprobs is not None and self.prompt_logprobs != 0:
            return "prompt_logprobs", "prompt_logprobs are not available when stream is true"
        return None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=INT32_MAX)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs to be true"
        return super().unsupported()


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    # 0 only with echo: the prompt alone, nothing generated (as vLLM).
    max_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    logprobs: int | None = Field(None, ge=0, le=INT32_MAX)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens: 0 needs echo (the prompt alone, nothing generated)"
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of is not supported (other than equal to n)"
        return super().unsupported()
