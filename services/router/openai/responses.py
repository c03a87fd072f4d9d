"""OpenAI's response bodies and stream chunks, built from the router's messages.

Chat: ``chat.completion`` / ``chat.completion.chunk`` with ``message`` / ``delta`` and
``logprobs.content``; completions: ``text_completion`` with ``text`` and the legacy
``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset; see ``logprob_shapes``), and
the prompt's own part when asked for (``echo``, ``prompt_logprobs``: see ``prompt_echo``).
Each choice also carries
vLLM's ``stop_reason`` (the stop string or stop token id hit; null at eos or a length stop).
``usage`` counts each prompt once, every choice's tokens, and the prompt tokens served from a
prefix cache (``prompt_tokens_details.cached_tokens``, as the first choice of each prompt saw
them).

A non-streaming response holds each choice's text as UTF-8 and its logprobs as flat arrays
(``LogprobColumns``, 8 bytes per top alternative and 16 per token) while it waits for every
choice, then writes its JSON in pieces (``streaming.JsonPiecesResponse``): a body of hundreds
of MB is never held whole, nor as Python objects per token, and its serialization does not
stall the event loop.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.tokenizer import Tokenizer
from services.common.convert import FINISH_REASON_NAMES
from services.router.openai.choices import ChoiceMessage
from services.router.openai.logprob_columns import LogprobColumns, LogprobEntry
from services.router.openai.logprob_shapes import (
    ENTRIES_PER_PIECE,
    batches,
    chat_entries,
    completion_columns,
    completion_logprobs,
    proto_entries,
)
from services.router.openai.prompt_echo import PromptRecord
from services.router.openai.protocol import StreamUsage
from services.router.openai.requests import Endpoint, GenerationPlan
from services.router.openai.streaming import json_array, json_text
from splitserve.v1 import router_pb2

logger = logging.getLogger(__name__)

_TOKEN_TEXT_CACHE = 1 << 16


class TokenTexts:
    """Each token id's text, as logprobs show it (cached: the same ids recur), and the ids
    that end a generation by default (eos)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.eos_token_ids = tokenizer.eos_token_ids
        backend = tokenizer.backend
        self.text = functools.lru_cache(maxsize=_TOKEN_TEXT_CACHE)(
            lambda token_id: backend.decode([token_id], skip_special_tokens=False)
        )
        self.decode: Callable[[Sequence[int]], str] = lambda token_ids: backend.decode(
            token_ids, skip_special_tokens=False
        )


@dataclass(slots=True)
class ChoiceState:
    """What one choice has produced so far."""

    index: int
    # The model's eos ids that are not the request's stop_token_ids: vLLM's stop_reason is
    # null at them, as at any eos.
    eos_only_ids: frozenset[int] = frozenset()
    # Kept only for a whole response (a stream sends each message's own).
    text: bytearray = field(default_factory=bytearray)
    logprobs: LogprobColumns = field(default_factory=LogprobColumns)
    num_messages: int = 0
    num_tokens: int = 0
    last_token_id: int | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: router_pb2.Usage | None = None
    # Characters of token text so far (completions' text_offset).
    num_token_chars: int = 0
    # The whole body's tool calls, each's pieces joined (OpenAI's message.tool_calls).
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def add(self, message: router_pb2.GenerateResponse, keep: bool = True) -> None:
        """Count ``message`` in; ``keep``: hold its text, logprobs and calls for the whole
        body."""
        if keep:
            self.text += message.text.encode()
            self.logprobs.extend(message.logprobs)
            for piece in message.tool_calls:
                if piece.index == len(self.tool_calls):
                    self.tool_calls.append(_tool_call(piece))
                else:
                    self.tool_calls[piece.index]["function"]["arguments"] += piece.arguments
        self.num_messages += 1
        self.num_tokens += len(message.token_ids)
        if message.token_ids:
            self.last_token_id = message.token_ids[-1]
        if message.HasField("usage"):
            self.usage = message.usage
        if message.finish_reason:
            self.finish_reason = FINISH_REASON_NAMES[message.finish_reason]
            self.stop_reason = self._stop_reason(message.stop_reason)

    def _stop_reason(self, stop_reason: str) -> str | int | None:
        """vLLM's ``stop_reason``: a stop token id of the request (an int), the stop string,
        or None (eos, a length stop)."""
        if not stop_reason:
            return None
        if stop_reason.isdigit() and int(stop_reason) == self.last_token_id:
            token_id = int(stop_reason)
            return None if token_id in self.eos_only_ids else token_id
        return stop_reason


@dataclass(slots=True)
class ResponseBuilder:
    """Shapes one HTTP request's response (or its chunks): ids, model and choices. ``choices``
    holds one state per generation, in the plan's order (prompt by prompt, ``n`` each)."""

    plan: GenerationPlan
    response_id: str
    model: str
    created_s: int
    token_texts: TokenTexts
    choices: list[ChoiceState] = field(init=False)
    # Each choice's prompt (its index in plan.requests), and each prompt's record once its
    # first choice's first message came (with prompt logprobs only).
    _prompt_of: list[int] = field(init=False)
    _prompts: list[PromptRecord | None] = field(init=False)

    def __post_init__(self) -> None:
        requests = [request for choices in self.plan.requests for request in choices]
        eos_ids = self.token_texts.eos_token_ids
        self.choices = [
            ChoiceState(i, eos_ids - set(request.sampling.stop_token_ids))
            for i, request in enumerate(requests)
        ]
        self._prompt_of = [p for p, choices in enumerate(self.plan.requests) for _ in choices]
        self._prompts = [None] * len(self.plan.requests)

    @property
    def endpoint(self) -> Endpoint:
        return self.plan.endpoint

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.endpoint is Endpoint.CHAT else "text_completion"

    def _envelope(self, object_name: str) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": object_name,
            "created": self.created_s,
            "model": self.model,
        }

    # ---------------------------------------------------------------------------- streaming
    def chunk(self, item: ChoiceMessage, usage: StreamUsage) -> dict[str, Any] | None:
        """The stream chunk for one router message (None when it adds nothing to send); with
        ``EVERY_CHUNK``, its usage is the prompt's and this choice's tokens so far, as vLLM's."""
        state = self.choices[item.index]
        first = not state.num_messages
        message = self._take(item)
        state.add(message, keep=False)
        finished = bool(message.finish_reason)
        if not (message.text or message.logprobs or message.tool_calls or finished or first):
            return None
        choice: dict[str, Any]
        if self.endpoint is Endpoint.CHAT:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if message.text or not message.tool_calls:
                delta["content"] = message.text
            if message.tool_calls:
                delta["tool_calls"] = [_tool_call_delta(piece) for piece in message.tool_calls]
            choice = {"index": item.index, "delta": delta}
            choice["logprobs"] = (
                {"content": chat_entries(proto_entries(message.logprobs), self.token_texts.text)}
                if message.logprobs
                else None
            )
        else:
            choice = {"index": item.index, "text": message.text}
            entries: Iterable[LogprobEntry] = proto_entries(message.logprobs)
            echo, prompt = self.plan.echo, self._prompts[self._prompt_of[item.index]]
            head = None
            if first and echo.prompt:
                choice["text"] = self._echo_text(item.index) + message.text
                if echo.num_logprobs is not None and prompt is not None:
                    head = prompt.token_ids[0]
                    echoed = prompt.echo_batches(echo.num_logprobs, ENTRIES_PER_PIECE)
                    entries = itertools.chain(itertools.chain.from_iterable(echoed), entries)
            choice["logprobs"] = None
            if message.logprobs or head is not None:
                choice["logprobs"], state.num_token_chars = completion_logprobs(
                    entries, self.token_texts.text, state.num_token_chars, head
                )
        choice["finish_reason"] = state.finish_reason if finished else None
        choice["stop_reason"] = state.stop_reason if finished else None
        chunk = {**self._envelope(self._chunk_object), "choices": [choice]}
        if usage is StreamUsage.LAST_CHUNK:
            chunk["usage"] = None
        elif usage is StreamUsage.EVERY_CHUNK:
            num_prompt_tokens = state.usage.prompt_tokens if state.usage is not None else 0
            chunk["usage"] = {
                "prompt_tokens": num_prompt_tokens,
                "completion_tokens": state.num_tokens,
                "total_tokens": num_prompt_tokens + state.num_tokens,
            }
        return chunk

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk of a stream with ``stream_options.include_usage``."""
        return {**self._envelope(self._chunk_object), "choices": [], "usage": self.usage()}

    # ---------------------------------------------------------------------------- whole
    def add(self, item: ChoiceMessage) -> None:
        self.choices[item.index].add(self._take(item))

    def _take(self, item: ChoiceMessage) -> router_pb2.GenerateResponse:
        """``item``'s message as the response shows it: its prompt's record kept when it
        carries one, and without what was generated when the prompt is asked for alone."""
        message = item.message
        if message.prompt_token_ids:
            columns = LogprobColumns()
            columns.extend(message.prompt_logprobs)
            prompt = PromptRecord(list(message.prompt_token_ids), columns)
            self._prompts[self._prompt_of[item.index]] = prompt
        if not self.plan.echo.without_generation:
            return message
        usage = message.usage
        alone = router_pb2.GenerateResponse(
            request_id=message.request_id,
            usage=router_pb2.Usage(
                prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens
            ),
        )
        if message.finish_reason:
            alone.finish_reason = router_pb2.FINISH_REASON_LENGTH
        return alone

    def _echo_text(self, index: int) -> str:
        """The prompt text choice ``index`` echoes: the prompt as sent, or its token ids'."""
        request = self.plan.requests[self._prompt_of[index]][0]
        if request.HasField("prompt"):
            return request.prompt
        return self.token_texts.decode(request.token_ids)

    def body(self) -> Iterator[str]:
        """The non-streaming body, once every choice has finished: in pieces whose
        concatenation is ``json.dumps`` of the whole object (as ``JSONResponse`` renders it),
        each built from at most ``_ENTRIES_PER_PIECE`` logprob entries."""
        yield json_text(self._envelope(self.endpoint.value))[:-1] + ',"choices":['
        for i, state in enumerate(self.choices):
            yield "," if i else ""
            yield from self._choice(state)
        yield "]"
        num_prompt_logprobs = self.plan.echo.num_prompt_logprobs
        if self.endpoint is Endpoint.CHAT and num_prompt_logprobs is not None:
            yield ',"prompt_logprobs":'
            yield from self._prompt_logprobs(0, num_prompt_logprobs)
        yield ',"usage":' + json_text(self.usage()) + "}"

    def _choice(self, state: ChoiceState) -> Iterator[str]:
        text = state.text.decode()
        echo = self.plan.echo
        head: dict[str, Any] = {"index": state.index}
        if self.endpoint is Endpoint.CHAT:
            head["message"] = {"role": "assistant", "content": text}
            if state.tool_calls:
                head["message"] = {
                    "role": "assistant",
                    "content": text or None,
                    "tool_calls": state.tool_calls,
                }
        else:
            head["text"] = (self._echo_text(state.index) if echo.prompt else "") + text
        yield json_text(head)[:-1] + ',"logprobs":'
        columns = state.logprobs
        prompt = self._prompts[self._prompt_of[state.index]]
        if not (echo.prompt and echo.num_logprobs is not None):
            prompt = None
        if not columns and prompt is None:
            yield "null"
        elif self.endpoint is Endpoint.CHAT:
            text_of = self.token_texts.text
            yield '{"content":'
            yield from json_array(chat_entries(batch, text_of) for batch in batches(columns))
            yield "}"
        else:
            yield from self._completion_columns(columns, prompt)
        if self.endpoint is Endpoint.COMPLETIONS and echo.num_prompt_logprobs is not None:
            yield ',"prompt_logprobs":'
            yield from self._prompt_logprobs(state.index, echo.num_prompt_logprobs)
        yield (
            f',"finish_reason":{json_text(state.finish_reason)}'
            f',"stop_reason":{json_text(state.stop_reason)}}}'
        )

    def _completion_columns(
        self, columns: LogprobColumns, prompt: PromptRecord | None
    ) -> Iterator[str]:
        """A choice's legacy logprobs, echoed ``prompt``'s tokens first."""
        num_top = self.plan.echo.num_logprobs or 0

        def entry_batches() -> Iterator[list[LogprobEntry]]:
            if prompt is not None:
                yield from prompt.echo_batches(num_top, ENTRIES_PER_PIECE)
            yield from batches(columns)

        head = None if prompt is None else prompt.token_ids[0]
        yield from completion_columns(entry_batches, self.token_texts.text, head)

    def _prompt_logprobs(self, index: int, num_top: int) -> Iterator[str]:
        """vLLM's ``prompt_logprobs`` of choice ``index``'s prompt, in pieces."""
        prompt = self._prompts[self._prompt_of[index]]
        if prompt is None:
            yield "null"
            return
        yield from json_array(
            prompt.field_batches(num_top, self.token_texts.text, ENTRIES_PER_PIECE)
        )

    def usage(self) -> dict[str, int | dict[str, int]]:
        prompt_tokens = cached_tokens = 0
        first = 0
        for choices in self.plan.requests:  # the prompt's usage is on its first choice
            usage = self.choices[first].usage
            if usage is not None:
                prompt_tokens += usage.prompt_tokens
                cached_tokens += usage.cached_tokens
            first += len(choices)
        completion_tokens = sum(state.num_tokens for state in self.choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        }


def _tool_call(piece: router_pb2.ToolCallDelta) -> dict[str, Any]:
    """A call's first piece as OpenAI's ``message.tool_calls`` entry."""
    function = {"name": piece.name, "arguments": piece.arguments}
    return {"id": piece.id, "type": "function", "function": function}


def _tool_call_delta(piece: router_pb2.ToolCallDelta) -> dict[str, Any]:
    """OpenAI's ``delta.tool_calls`` entry: id, type and name on a call's first piece only."""
    if not piece.id:
        return {"index": piece.index, "function": {"arguments": piece.arguments}}
    return {"index": piece.index, **_tool_call(piece)}
