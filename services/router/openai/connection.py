"""The HTTP API's connections, with limits of their own: uvicorn's httptools protocol plus
what it does not bound.

Each connection is in one of three phases, each bounded:

    head (request line + headers)   body                     response
    |-- http_header_timeout_s --|   |-- http_body_timeout_s --|   a send blocked for
    |-- http_max_header_bytes --|                                  stream_idle_timeout_s

- **Head**: from the connection (or the first byte of a kept-alive connection's next request)
  until the headers are complete; over the time limit it is closed with 408, over the size limit
  with 431, counted as it arrives, so that a huge header costs at most one read beyond the limit.
- **Body**: from the end of the head until the body is complete: a client that stops half-way
  (or trickles) is closed with 408 (the route reading it sees a disconnect).
- **Response**: the kernel's send buffer is ``http_send_buffer_bytes``, not the megabytes its
  autotuning grows to, so that a client that stops reading stops its stream within about a
  thousand tokens (SSE chunks of ~150 bytes) and backpressure reaches the engine. A client that
  reads nothing, so that the transport's buffer stays over its high water mark for
  ``stream_idle_timeout_s``, is cut off (the buffer dropped); the route sees a disconnect and
  cancels the request's generations, as when the client closes.
- Idle kept-alive connections close after ``http_keep_alive_timeout_s`` (uvicorn's timer) and a
  connection beyond ``http_max_connections`` is answered 503 and closed at once.

Each cut is one log line; a client that leaves during its upload too (not a traceback).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from services.router.openai.errors import OpenAIError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """The router's HTTP flags (``--http-max-header-bytes``, ...; see ``RouterConfig``)."""

    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    keep_alive_timeout_s: float
    max_connections: int
    stream_idle_timeout_s: float
    send_buffer_bytes: int


def limited_protocol(limits: HttpLimits) -> type[HttpToolsProtocol]:
    """The protocol class of a server with ``limits`` (uvicorn builds one per connection)."""
    return type("LimitedHttpProtocol", (LimitedHttpProtocol,), {"limits": limits})


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the module's limits (``limits``: set by
    ``limited_protocol``). Runs on the event loop only."""

    limits: ClassVar[HttpLimits]

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.timeout_keep_alive = self.limits.keep_alive_timeout_s  # type: ignore[assignment]
        # In the head of a request (also before its first byte): its bytes count.
        self._in_head = True
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._cut = False  # closed by a limit, already logged

    # ----------------------------------------------------------------------------- connection
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.limits.send_buffer_bytes)
        if len(self.connections) > self.limits.max_connections:
            logger.debug("HTTP connection from %s refused: at the connection cap", self._peer)
            self._refuse(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"more than {self.limits.max_connections} open connections "
                "(http_max_connections); retry later",
            )
            return
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_late)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._body_timer is not None and not self._cut:
            logger.info("HTTP client %s went away during its request body", self._peer)
        for timer in (self._head_timer, self._body_timer, self._write_timer):
            _cancel(timer)
        self._head_timer = self._body_timer = self._write_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(
                    self.limits.header_timeout_s, self._head_late
                )
        super().data_received(data)
        if (
            self._in_head
            and self._head_bytes > self.limits.max_header_bytes
            and not self.transport.is_closing()
        ):
            logger.info(
                "HTTP client %s sent a request head over %d bytes; connection closed",
                self._peer,
                self.limits.max_header_bytes,
            )
            self._refuse(
                HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                f"the request head is larger than {self.limits.max_header_bytes} bytes "
                "(http_max_header_bytes)",
            )

    # ----------------------------------------------------------------------------- parser
    def on_headers_complete(self) -> None:
        self._in_head = False
        _cancel(self._head_timer)
        self._head_timer = None
        super().on_headers_complete()
        self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_late)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        _cancel(self._body_timer)
        self._body_timer = None
        self._in_head = True
        self._head_bytes = 0

    # ----------------------------------------------------------------------------- writing
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(
                self.limits.stream_idle_timeout_s, self._write_stalled
            )

    def resume_writing(self) -> None:
        super().resume_writing()
        _cancel(self._write_timer)
        self._write_timer = None

    # ----------------------------------------------------------------------------- limits
    def _head_late(self) -> None:
        self._head_timer = None
        # A connection that never sent a byte (a preconnect, a TCP probe) is not news.
        quiet = not self._head_bytes
        self._late("head", self.limits.header_timeout_s, "http_header_timeout_s", quiet)

    def _body_late(self) -> None:
        self._body_timer = None
        self._late("body", self.limits.body_timeout_s, "http_body_timeout_s")

    def _late(self, part: str, timeout_s: float, flag: str, quiet: bool = False) -> None:
        """The request's ``part`` (head or body) did not arrive within ``timeout_s`` (the
        router's ``flag``): answer 408 and close."""
        log = logger.debug if quiet else logger.info
        log(
            "HTTP client %s sent no complete request %s within %.1f s; connection closed",
            self._peer,
            part,
            timeout_s,
        )
        self._refuse(
            HTTPStatus.REQUEST_TIMEOUT,
            f"the request {part} took longer than {timeout_s:g} s ({flag})",
        )

    def _write_stalled(self) -> None:
        self._write_timer = None
        self._cut = True
        logger.info(
            "HTTP client %s read nothing for %.1f s; connection closed and its request "
            "cancelled (stream_idle_timeout_s)",
            self._peer,
            self.limits.stream_idle_timeout_s,
        )
        # close() would wait for the unread buffer to drain: never, from this client.
        self.transport.abort()

    def _refuse(self, status: HTTPStatus, message: str) -> None:
        """Answer ``status`` when no response has begun on the connection, then close it; the
        request being read (if any) sees a disconnect at once."""
        self._cut = True
        cycle = self.cycle
        if cycle is None or cycle.response_complete or not cycle.response_started:
            body = json.dumps(OpenAIError(status, message).body()).encode()
            head = (
                f"HTTP/1.1 {status.value} {status.phrase}\r\n"
                "content-type: application/json\r\n"
                f"content-length: {len(body)}\r\n"
                "connection: close\r\n\r\n"
            )
            self.transport.write(head.encode() + body)
        if cycle is not None and not cycle.response_complete:
            # Its route must not write after this response (the transport closes once flushed).
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    @property
    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "?"


def _cancel(timer: asyncio.TimerHandle | None) -> None:
    if timer is not None:
        timer.cancel()
