"""OpenAI's response bodies and stream chunks, built from the router's messages.

Chat: ``chat.completion`` / ``chat.completion.chunk`` with ``message`` / ``delta`` and
``logprobs.content``; completions: ``text_completion`` with ``text`` and the legacy
``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset). Each choice also carries
vLLM's ``stop_reason`` (the stop string or stop token id hit; null at eos or a length stop).
``usage`` counts each prompt once, every choice's tokens, and the prompt tokens served from a
prefix cache (``prompt_tokens_details.cached_tokens``, as the first choice of each prompt saw
them).

A non-streaming response holds each choice's text as UTF-8 and its logprobs as flat arrays
(``LogprobColumns``, 8 bytes per top alternative and 12 per token) while it waits for every
choice, then writes its JSON in pieces (``streaming.JsonPiecesResponse``): a body of hundreds
of MB is never held whole, nor as Python objects per token, and its serialization does not
stall the event loop.
"""

from __future__ import annotations

import functools
import logging
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.tokenizer import Tokenizer
from services.common.convert import FINISH_REASON_NAMES
from services.router.openai.choices import ChoiceMessage
from services.router.openai.protocol import StreamUsage
from services.router.openai.requests import Endpoint, GenerationPlan
from services.router.openai.streaming import json_array, json_text
from splitserve.v1 import router_pb2, worker_pb2

logger = logging.getLogger(__name__)

_TOKEN_TEXT_CACHE = 1 << 16
# Logprob entries serialized per piece of a whole body (about 1 KB each at top_logprobs=20):
# each piece takes the loop for a millisecond or so.
_ENTRIES_PER_PIECE = 64

# One logprob entry: its token id, its logprob, and its top alternatives' (id, logprob).
LogprobEntry = tuple[int, float, Iterable[tuple[int, float]]]


class TokenTexts:
    """Each token id's text, as logprobs show it (cached: the same ids recur), and the ids
    that end a generation by default (eos)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.eos_token_ids = tokenizer.eos_token_ids
        backend = tokenizer.backend
        self.text = functools.lru_cache(maxsize=_TOKEN_TEXT_CACHE)(
            lambda token_id: backend.decode([token_id], skip_special_tokens=False)
        )


class LogprobColumns:
    """One choice's logprob entries as flat arrays: ids as int32 and logprobs as float32 (the
    worker's own types, so every value reads back as it came)."""

    __slots__ = ("logprobs", "token_ids", "top_ends", "top_ids", "top_logprobs")

    def __init__(self) -> None:
        self.token_ids = array("i")
        self.logprobs = array("f")
        # Entry i's top alternatives are top_*[top_ends[i - 1]:top_ends[i]].
        self.top_ends = array("I")
        self.top_ids = array("i")
        self.top_logprobs = array("f")

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, entries: Iterable[worker_pb2.TokenLogprob]) -> None:
        for entry in entries:
            self.token_ids.append(entry.token_id)
            self.logprobs.append(entry.logprob)
            for top in entry.top:
                self.top_ids.append(top.token_id)
                self.top_logprobs.append(top.logprob)
            self.top_ends.append(len(self.top_ids))

    def entries(self, start: int, stop: int) -> Iterator[LogprobEntry]:
        """Entries ``start`` to ``stop`` (exclusive)."""
        top_start = self.top_ends[start - 1] if start else 0
        for i in range(start, min(stop, len(self))):
            top_stop = self.top_ends[i]
            tops = zip(
                self.top_ids[top_start:top_stop],
                self.top_logprobs[top_start:top_stop],
                strict=True,
            )
            yield self.token_ids[i], self.logprobs[i], tops
            top_start = top_stop


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

    def __post_init__(self) -> None:
        requests = [request for choices in self.plan.requests for request in choices]
        eos_ids = self.token_texts.eos_token_ids
        self.choices = [
            ChoiceState(i, eos_ids - set(request.sampling.stop_token_ids))
            for i, request in enumerate(requests)
        ]

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
        message = item.message
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
                {"content": self._chat_entries(_proto_entries(message.logprobs))}
                if message.logprobs
                else None
            )
        else:
            choice = {"index": item.index, "text": message.text}
            choice["logprobs"] = (
                self._completion_logprobs(_proto_entries(message.logprobs), state)
                if message.logprobs
                else None
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
        self.choices[item.index].add(item.message)

    def body(self) -> Iterator[str]:
        """The non-streaming body, once every choice has finished: in pieces whose
        concatenation is ``json.dumps`` of the whole object (as ``JSONResponse`` renders it),
        each built from at most ``_ENTRIES_PER_PIECE`` logprob entries."""
        yield json_text(self._envelope(self.endpoint.value))[:-1] + ',"choices":['
        for i, state in enumerate(self.choices):
            yield "," if i else ""
            yield from self._choice(state)
        yield '],"usage":' + json_text(self.usage()) + "}"

    def _choice(self, state: ChoiceState) -> Iterator[str]:
        text = state.text.decode()
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
            head["text"] = text
        yield json_text(head)[:-1] + ',"logprobs":'
        columns = state.logprobs
        if not columns:
            yield "null"
        elif self.endpoint is Endpoint.CHAT:
            yield '{"content":'
            yield from json_array(self._chat_entries(batch) for batch in _batches(columns))
            yield "}"
        else:
            yield from self._completion_columns(columns)
        yield (
            f',"finish_reason":{json_text(state.finish_reason)}'
            f',"stop_reason":{json_text(state.stop_reason)}}}'
        )

    def _completion_columns(self, columns: LogprobColumns) -> Iterator[str]:
        """The legacy shape's four arrays, each in pieces."""
        text = self.token_texts.text
        yield '{"tokens":'
        yield from json_array(
            [text(token_id) for token_id, _, _ in batch] for batch in _batches(columns)
        )
        yield ',"token_logprobs":'
        yield from json_array([logprob for _, logprob, _ in batch] for batch in _batches(columns))
        yield ',"top_logprobs":'
        yield from json_array(
            [_completion_top(text(entry[0]), entry, text) for entry in batch]
            for batch in _batches(columns)
        )
        yield ',"text_offset":'
        yield from json_array(_text_offsets(columns, text))
        yield "}"

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

    # ---------------------------------------------------------------------------- logprobs
    def _chat_entries(self, entries: Iterable[LogprobEntry]) -> list[dict[str, Any]]:
        text = self.token_texts.text
        return [
            {
                **_chat_token(text(token_id), logprob),
                "top_logprobs": [_chat_token(text(t), t_logprob) for t, t_logprob in tops],
            }
            for token_id, logprob, tops in entries
        ]

    def _completion_logprobs(
        self, entries: Iterable[LogprobEntry], state: ChoiceState
    ) -> dict[str, Any]:
        """The legacy shape; ``state.num_token_chars`` carries text_offset across chunks."""
        text = self.token_texts.text
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for entry in entries:
            token = text(entry[0])
            tokens.append(token)
            token_logprobs.append(entry[1])
            tops.append(_completion_top(token, entry, text))
            offsets.append(state.num_token_chars)
            state.num_token_chars += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
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


def _batches(columns: LogprobColumns) -> Iterator[list[LogprobEntry]]:
    for start in range(0, len(columns), _ENTRIES_PER_PIECE):
        yield list(columns.entries(start, start + _ENTRIES_PER_PIECE))


def _text_offsets(columns: LogprobColumns, text: Callable[[int], str]) -> Iterator[list[int]]:
    """Each entry's text_offset (the characters of the token texts before it), in batches."""
    offset = 0
    for batch in _batches(columns):
        offsets = []
        for token_id, _, _ in batch:
            offsets.append(offset)
            offset += len(text(token_id))
        yield offsets


def _proto_entries(logprobs: Sequence[worker_pb2.TokenLogprob]) -> Iterator[LogprobEntry]:
    for entry in logprobs:
        yield entry.token_id, entry.logprob, ((t.token_id, t.logprob) for t in entry.top)


def _completion_top(
    token: str, entry: LogprobEntry, text: Callable[[int], str]
) -> dict[str, float]:
    """The legacy ``top_logprobs`` entry: text to logprob, the sampled token's included."""
    top = {text(token_id): logprob for token_id, logprob in entry[2]}
    top.setdefault(token, entry[1])
    return top


def _chat_token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
