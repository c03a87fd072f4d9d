"""OpenAI's response bodies and stream chunks, built from the router's messages.

Chat: ``chat.completion`` / ``chat.completion.chunk`` with ``message`` / ``delta`` and
``logprobs.content``; completions: ``text_completion`` with ``text`` and the legacy
``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset). Each choice also carries
vLLM's ``stop_reason`` (the stop string or stop token id hit; null at eos or a length stop).
``usage`` counts each prompt once, every choice's tokens, and the prompt tokens served from a
prefix cache (``prompt_tokens_details.cached_tokens``, as the first choice of each prompt saw
them).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.tokenizer import Tokenizer
from services.common.convert import FINISH_REASON_NAMES
from services.router.openai.choices import ChoiceMessage
from services.router.openai.requests import Endpoint, GenerationPlan
from splitserve.v1 import router_pb2, worker_pb2

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


@dataclass(slots=True)
class ChoiceState:
    """What one choice has produced so far."""

    index: int
    # The model's eos ids that are not the request's stop_token_ids: vLLM's stop_reason is
    # null at them, as at any eos.
    eos_only_ids: frozenset[int] = frozenset()
    text: list[str] = field(default_factory=list)
    logprobs: list[worker_pb2.TokenLogprob] = field(default_factory=list)
    num_tokens: int = 0
    last_token_id: int | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: router_pb2.Usage | None = None
    # Characters of token text so far (completions' text_offset).
    num_token_chars: int = 0

    def add(self, message: router_pb2.GenerateResponse) -> None:
        self.text.append(message.text)
        self.logprobs.extend(message.logprobs)
        self.num_tokens += len(message.token_ids)
        if message.token_ids:
            self.last_token_id = message.token_ids[-1]
        if message.finish_reason:
            self.finish_reason = FINISH_REASON_NAMES[message.finish_reason]
            self.stop_reason = self._stop_reason(message.stop_reason)
            self.usage = message.usage

    def _stop_reason(self, stop_reason: str) -> str | int | None:
        """vLLM's ``stop_reason``: a stop token id of the request (an int), the stop string,
        or None (eos, a length stop)."""
        if not stop_reason:
            return None
        if stop_reason.isdigit() and int(stop_reason) == self.last_token_id:
            token_id = int(stop_reason)
            return None if token_id in self.eos_only_ids else token_id
        return stop_reason


class ResponseBuilder:
    """Shapes one HTTP request's response (or its chunks): ids, model and choices."""

    def __init__(
        self,
        plan: GenerationPlan,
        response_id: str,
        model: str,
        created_s: int,
        token_texts: TokenTexts,
    ) -> None:
        self.plan = plan
        self.endpoint = plan.endpoint
        self.response_id = response_id
        self.model = model
        self.created_s = created_s
        self._texts = token_texts
        requests = [request for choices in plan.requests for request in choices]
        self.choices = [
            ChoiceState(i, token_texts.eos_token_ids - set(request.sampling.stop_token_ids))
            for i, request in enumerate(requests)
        ]
        self._num_choices_per_prompt = [len(choices) for choices in plan.requests]

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
    def chunk(self, item: ChoiceMessage, include_usage: bool) -> dict[str, Any] | None:
        """The stream chunk for one router message (None when it adds nothing to send)."""
        state = self.choices[item.index]
        first = not state.text
        message = item.message
        state.add(message)
        finished = bool(message.finish_reason)
        if not (message.text or message.logprobs or finished or first):
            return None
        choice: dict[str, Any]
        if self.endpoint is Endpoint.CHAT:
            delta: dict[str, Any] = {"content": message.text}
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": item.index, "delta": delta}
            choice["logprobs"] = self._chat_logprobs(message.logprobs) if message.logprobs else None
        else:
            choice = {"index": item.index, "text": message.text}
            choice["logprobs"] = (
                self._completion_logprobs(message.logprobs, state) if message.logprobs else None
            )
        choice["finish_reason"] = state.finish_reason if finished else None
        choice["stop_reason"] = state.stop_reason if finished else None
        chunk = {**self._envelope(self._chunk_object), "choices": [choice]}
        if include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk of a stream with ``stream_options.include_usage``."""
        return {**self._envelope(self._chunk_object), "choices": [], "usage": self.usage()}

    # ---------------------------------------------------------------------------- whole
    def add(self, item: ChoiceMessage) -> None:
        self.choices[item.index].add(item.message)

    def response(self) -> dict[str, Any]:
        """The non-streaming body, once every choice has finished."""
        choices = []
        for state in self.choices:
            text = "".join(state.text)
            choice: dict[str, Any] = {"index": state.index}
            if self.endpoint is Endpoint.CHAT:
                choice["message"] = {"role": "assistant", "content": text}
                choice["logprobs"] = self._chat_logprobs(state.logprobs) if state.logprobs else None
            else:
                choice["text"] = text
                replay = ChoiceState(state.index)
                choice["logprobs"] = (
                    self._completion_logprobs(state.logprobs, replay) if state.logprobs else None
                )
            choice["finish_reason"] = state.finish_reason
            choice["stop_reason"] = state.stop_reason
            choices.append(choice)
        return {**self._envelope(self.endpoint.value), "choices": choices, "usage": self.usage()}

    def usage(self) -> dict[str, int | dict[str, int]]:
        prompt_tokens = cached_tokens = 0
        first = 0
        for num_choices in self._num_choices_per_prompt:
            usage = self.choices[first].usage
            if usage is not None:
                prompt_tokens += usage.prompt_tokens
                cached_tokens += usage.cached_tokens
            first += num_choices
        completion_tokens = sum(state.num_tokens for state in self.choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        }

    # ---------------------------------------------------------------------------- logprobs
    def _chat_logprobs(self, logprobs: Sequence[worker_pb2.TokenLogprob]) -> dict[str, Any]:
        text = self._texts.text
        return {
            "content": [
                {
                    **_chat_token(text(entry.token_id), entry.logprob),
                    "top_logprobs": [_chat_token(text(t.token_id), t.logprob) for t in entry.top],
                }
                for entry in logprobs
            ]
        }

    def _completion_logprobs(
        self, logprobs: Sequence[worker_pb2.TokenLogprob], state: ChoiceState
    ) -> dict[str, Any]:
        """The legacy shape; ``state.num_token_chars`` carries text_offset across chunks."""
        text = self._texts.text
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for entry in logprobs:
            token = text(entry.token_id)
            tokens.append(token)
            token_logprobs.append(entry.logprob)
            top = {text(t.token_id): t.logprob for t in entry.top}
            top.setdefault(token, entry.logprob)
            tops.append(top)
            offsets.append(state.num_token_chars)
            state.num_token_chars += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def _chat_token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
