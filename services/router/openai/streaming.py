"""Responses that end their work when the client goes away.

A client that disconnects (closes the stream, times out, dies) cancels what its request runs:
the generations abort on every worker and free their blocks, as a gRPC cancel does. Both the
streamed and the whole responses watch the connection for ``http.disconnect`` while they work.
A whole body is written as its JSON pieces come (``JsonPiecesResponse``; ``json_text`` and
``json_array`` make the pieces), never held whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Iterable, Iterator
from typing import Any, TypeVar

from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from services.router.openai.errors import OpenAIError

logger = logging.getLogger(__name__)

T = TypeVar("T")

_DONE = b"data: [DONE]\n\n"
# The bytes of a whole body sent per write.
_SEND_BYTES = 1 << 16
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # proxies must not buffer the stream
]


class ClientDisconnected(Exception):
    """The client closed the connection before its response was complete."""


async def _wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has gone (the request body is already read)."""
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """``work``'s result; ``ClientDisconnected`` (``work`` cancelled) if the client goes first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watcher):
            pending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(task, watcher, return_exceptions=True)
    if task.done() and not task.cancelled():
        return task.result()
    raise ClientDisconnected


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def sse_event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class _WrittenResponse(Response):
    """A response that ``_write``-s its body as it is produced and stops, quietly, when the
    client goes (its write is cancelled)."""

    _gone: str  # the debug line once the client went

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await until_disconnect(receive, self._write(send))
        except ClientDisconnected:
            logger.debug(self._gone)

    async def _write(self, send: Send) -> None:
        raise NotImplementedError


class EventStreamResponse(_WrittenResponse):
    """Server-sent events from ``events`` (JSON chunks), ending with ``data: [DONE]``.

    The status line waits for the first chunk: a request the router refuses (validation,
    admission, no worker) gets its error status and body, not a 200 stream. A failure after
    that is an ``{"error": ...}`` event before ``[DONE]``.
    """

    _gone = "client disconnected; request cancelled"

    def __init__(self, events: AsyncGenerator[dict[str, Any], None]) -> None:
        super().__init__()
        self._events = events

    async def _write(self, send: Send) -> None:
        events = self._events
        try:
            try:
                first = await anext(events)
            except OpenAIError as error:
                await error_response(error)({"type": "http"}, _no_receive, send)
                return
            except StopAsyncIteration:
                first = None
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            if first is not None:
                await _send_body(send, sse_event(first))
                try:
                    async for event in events:
                        await _send_body(send, sse_event(event))
                except OpenAIError as error:
                    await _send_body(send, sse_event(error.body()))
            await _send_body(send, _DONE, more_body=False)
        finally:
            await events.aclose()


async def _send_body(send: Send, body: bytes, more_body: bool = True) -> None:
    await send({"type": "http.response.body", "body": body, "more_body": more_body})


async def _no_receive() -> Message:
    raise AssertionError("an error response reads nothing")


class JsonPiecesResponse(_WrittenResponse):
    """A 200 ``application/json`` body written as ``pieces`` come (chunked, without a
    content-length), giving the event loop back between writes; it stops, quietly, when the
    client goes."""

    _gone = "client disconnected while its response was written"

    def __init__(self, pieces: Iterable[str]) -> None:
        super().__init__()
        self._pieces = pieces

    async def _write(self, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        buffer = bytearray()
        for piece in self._pieces:
            buffer += piece.encode()
            if len(buffer) >= _SEND_BYTES:
                await send({"type": "http.response.body", "body": bytes(buffer), "more_body": True})
                buffer.clear()
                # A send that does not block does not yield: let the loop run other requests.
                await asyncio.sleep(0)
        await send({"type": "http.response.body", "body": bytes(buffer), "more_body": False})


def json_text(value: Any) -> str:
    """``value`` as JSON text, exactly as ``JSONResponse`` renders it."""
    return json.dumps(
        value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    )


def json_array(batches: Iterable[list[Any]]) -> Iterator[str]:
    """A JSON array of every item of ``batches``, in one piece per batch."""
    yield "["
    separator = ""
    for batch in batches:
        if batch:
            yield separator + json_text(batch)[1:-1]
            separator = ","
    yield "]"
