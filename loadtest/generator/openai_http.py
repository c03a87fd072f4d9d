"""The router's OpenAI-compatible HTTP API as ``splitserve loadtest`` drives it (as ``vllm bench
serve`` does): streamed completions over aiohttp, and the model the server lists.

Timing (client clock): a request is sent at the POST; each server-sent event whose choice
carries non-empty text (``text`` for completions, ``delta.content`` for chat) is one arrival of
one token, stamped as its line is read; the request ends at ``data: [DONE]``. The server sends
one event per batch of tokens, and the last event's ``usage`` counts them all: when its
``completion_tokens`` exceeds the events counted, the difference is put on the last arrival, so
that output tokens match the server's.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import AsyncIterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import aiohttp

from loadtest.generator.backends import Backend
from loadtest.generator.metrics import RequestRecord
from loadtest.generator.synthetic import LoadRequest
from services.common.api_keys import BEARER_PREFIX
from services.startup import ClusterNotReady, WaitMessages

_POLL_S = 0.5
_PROBE_TIMEOUT_S = 5.0
_DATA = b"data:"
_DONE = b"[DONE]"


class ServerRefused(Exception):
    """The server answered a request of ``wait_for_model`` with an error no wait can cure
    (e.g. HTTP 401 for a wrong API key); the message names it."""


@dataclass(frozen=True, slots=True)
class ModelCard:
    """The first model of ``GET /v1/models``: its name for requests, what the workers loaded
    (a path or alias: where its tokenizer is) and its context length."""

    id: str
    root: str
    max_model_len: int


_IDLE_S = 4.0


def _session(api_key: str, ca_file: str) -> aiohttp.ClientSession:
    """A session sending ``Authorization: Bearer api_key``, with no cap on open connections
    (an open loop must not queue in the client), TLS verified against ``ca_file`` if given."""
    ssl_context: ssl.SSLContext | bool = (
        ssl.create_default_context(cafile=ca_file) if ca_file else True
    )
    headers = {"Authorization": BEARER_PREFIX + api_key} if api_key else {}
    # An idle connection is dropped before the router's --http-keep-alive-timeout-s (5 s) ends
    # it: a request sent on a connection as the server closes it fails (ClientOSError), which
    # users with think time between turns would otherwise meet.
    connector = aiohttp.TCPConnector(limit=0, ssl=ssl_context, keepalive_timeout=_IDLE_S)
    return aiohttp.ClientSession(connector=connector, headers=headers)


class OpenAIClient:
    """``POST base_url/v1/completions`` (``Backend.OPENAI_COMPLETIONS``: token ids, or the
    text when the request has one) or ``/v1/chat/completions`` (``Backend.OPENAI_CHAT``: one
    user message; requests must carry text) for ``model``, streamed."""

    def __init__(
        self, backend: Backend, base_url: str, model: str, api_key: str = "", ca_file: str = ""
    ) -> None:
        if backend is Backend.GRPC:
            raise ValueError("OpenAIClient speaks the HTTP API, not gRPC")
        self.backend: Backend = backend
        self.base_url = base_url
        self._model = model
        self._api_key = api_key
        self._ca_file = ca_file
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        self._session = _session(self._api_key, self._ca_file)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._session is not None
        await self._session.close()
        self._session = None

    def _body(self, request: LoadRequest) -> tuple[str, dict[str, Any]]:
        """The endpoint and the JSON body for ``request``."""
        if self.backend is Backend.OPENAI_CHAT:
            assert request.prompt_text is not None, "a chat API takes text prompts only"
            messages = [{"role": "user", "content": request.prompt_text}]
            return "/v1/chat/completions", self._chat_body(messages, request.max_tokens)
        prompt = (
            request.prompt_text
            if request.prompt_text is not None
            else list(request.prompt_token_ids)
        )
        body = {**self._common(), "prompt": prompt, "max_tokens": request.max_tokens}
        return "/v1/completions", body

    def _common(self) -> dict[str, Any]:
        """Every request's fields: greedy, no early stop, streamed with the usage."""
        return {
            "model": self._model,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def _chat_body(self, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        return {**self._common(), "messages": messages, "max_completion_tokens": max_tokens}

    async def send(self, request: LoadRequest, timeout_s: float) -> RequestRecord:
        path, body = self._body(request)
        record = RequestRecord(
            sent_s=time.perf_counter(), prompt_tokens=len(request.prompt_token_ids)
        )
        await self._post(path, body, record, timeout_s, None)
        return record

    async def send_messages(
        self, messages: list[dict[str, str]], max_tokens: int, timeout_s: float
    ) -> tuple[RequestRecord, str]:
        """One chat completion of a whole conversation so far (``Backend.OPENAI_CHAT``):
        its record (prompt tokens from the server's usage) and the reply's text."""
        if self.backend is not Backend.OPENAI_CHAT:
            raise ValueError("a conversation's messages go to the chat API")
        body = self._chat_body(messages, max_tokens)
        record = RequestRecord(sent_s=time.perf_counter(), prompt_tokens=0)
        reply: list[str] = []
        await self._post("/v1/chat/completions", body, record, timeout_s, reply)
        return record, "".join(reply)

    async def _post(
        self,
        path: str,
        body: dict[str, Any],
        record: RequestRecord,
        timeout_s: float,
        reply: list[str] | None,
    ) -> None:
        """Send ``body`` and read its stream into ``record`` (and the text into ``reply``)."""
        assert self._session is not None, "send outside `async with`"
        try:
            async with self._session.post(
                self.base_url + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as response:
                if response.status != 200:
                    record.error = f"HTTP {response.status}"
                    return
                record.error = await _read_stream(response.content, record, self.backend, reply)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            record.error = type(exc).__name__


def _text(choice: dict[str, Any], backend: Backend) -> str | None:
    if backend is Backend.OPENAI_CHAT:
        return (choice.get("delta") or {}).get("content")
    return choice.get("text")


async def _read_stream(
    lines: AsyncIterable[bytes],
    record: RequestRecord,
    backend: Backend,
    reply: list[str] | None = None,
) -> str | None:
    """Read a completion's server-sent events into ``record`` (token arrivals, ``end_s``,
    prompt and cached tokens from ``usage``) and their text into ``reply`` when given; return
    the error, None when it ends with ``data: [DONE]``. Raises ``ValueError`` for an event
    that is not JSON."""
    completion_tokens: int | None = None
    async for line in lines:
        now_s = time.perf_counter()
        line = line.strip()
        if not line.startswith(_DATA):
            continue  # blank separators, comments, event names
        data = line.removeprefix(_DATA).strip()
        if data == _DONE:
            record.end_s = now_s
            counted = record.output_tokens
            if completion_tokens is not None and completion_tokens > counted and counted:
                record.token_counts[-1] += completion_tokens - counted
            return None
        event = json.loads(data)
        if not isinstance(event, dict):
            raise ValueError(f"an event that is not a JSON object: {data[:80]!r}")
        if "error" in event:
            return "stream error"
        choices = event.get("choices") or []
        if choices and (text := _text(choices[0], backend)):
            record.token_times_s.append(now_s)
            record.token_counts.append(1)
            if reply is not None:
                reply.append(text)
        if usage := event.get("usage"):
            completion_tokens = usage.get("completion_tokens")
            record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
            details = usage.get("prompt_tokens_details") or {}
            record.cached_tokens = details.get("cached_tokens") or 0
    return "incomplete stream"


def _model_card(body: Any) -> ModelCard | None:
    """The first model listed, None while it has no context length yet."""
    data = body.get("data") if isinstance(body, dict) else None
    if not data or not isinstance(data[0], dict):
        return None
    entry = data[0]
    max_model_len, name = entry.get("max_model_len"), entry.get("id")
    if not isinstance(max_model_len, int) or max_model_len < 1 or not isinstance(name, str):
        return None
    root = entry.get("root")
    return ModelCard(name, root if isinstance(root, str) and root else name, max_model_len)


async def wait_for_model(
    base_url: str, deadline_s: float, messages: WaitMessages, api_key: str = "", ca_file: str = ""
) -> ModelCard:
    """Poll ``GET base_url/health`` until it answers 200, then ``GET /v1/models`` until it lists
    a model with its ``max_model_len``; return that model. A server not answering yet is waited
    for too; each reason to wait goes to ``messages``; ``ClusterNotReady`` (with the last
    reason) once ``deadline_s`` (``time.monotonic()``) passes; ``ServerRefused`` for HTTP 401,
    403 or 404."""
    async with _session(api_key, ca_file) as session:
        while True:
            try:
                reason = await _why_not_ready(session, base_url)
            except (aiohttp.ClientError, TimeoutError):
                reason = f"no server answers at {base_url} yet"
            if isinstance(reason, ModelCard):
                return reason
            if time.monotonic() + _POLL_S > deadline_s:
                raise ClusterNotReady(reason)
            messages.show(reason)
            await asyncio.sleep(_POLL_S)


async def _why_not_ready(session: aiohttp.ClientSession, base_url: str) -> ModelCard | str:
    """The model once the server serves it; else why not."""
    status, _ = await _get(session, base_url, "/health")
    if status != 200:
        return f"GET /health answers HTTP {status}"
    status, body = await _get(session, base_url, "/v1/models")
    if status != 200:
        return f"GET /v1/models answers HTTP {status}"
    return _model_card(body) or "GET /v1/models lists no model with its max_model_len yet"


async def _get(session: aiohttp.ClientSession, base_url: str, path: str) -> tuple[int, Any]:
    """The status of ``GET base_url + path`` and its JSON body (None if it is not JSON)."""
    timeout = aiohttp.ClientTimeout(total=_PROBE_TIMEOUT_S)
    async with session.get(base_url + path, timeout=timeout) as response:
        if response.status in (401, 403, 404):
            raise ServerRefused(f"GET {base_url}{path}: HTTP {response.status}")
        try:
            return response.status, await response.json(content_type=None)
        except ValueError:
            return response.status, None
