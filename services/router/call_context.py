"""What a generation needs from the call it serves, whichever API the call came through.

``grpc.aio.ServicerContext`` is one; the HTTP API's ``HttpCallContext`` is the other. The
router's request path (``RouterServicer.generate``) sees only this protocol, so a request's
admission, validation, routing, failover and metrics are the same code for both APIs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn, Protocol

import grpc


class CallContext(Protocol):
    """The caller's deadline and metadata, and how to refuse or fail the call."""

    def invocation_metadata(self) -> Sequence[tuple[str, str]] | None:
        """The call's metadata (gRPC) or headers (HTTP) as lowercase (key, value) pairs."""

    def time_remaining(self) -> float | None:
        """Seconds until the caller's deadline; None without one."""

    def set_trailing_metadata(self, trailing_metadata: Sequence[tuple[str, str]]) -> None:
        """Metadata to end the call with (gRPC trailers; the HTTP API's error headers)."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        """End the call with ``code`` and ``details``; always raises."""


class CallAborted(Exception):
    """Raised by ``HttpCallContext.abort``: the call ended with ``code``, ``details`` and the
    trailing metadata set before."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        trailing_metadata: Sequence[tuple[str, str]] = (),
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.trailing_metadata = trailing_metadata


class HttpCallContext:
    """A ``CallContext`` for a call that is not gRPC: no deadline, its ``headers`` as the
    metadata, and ``abort`` raises ``CallAborted`` for the caller to turn into its own error
    response."""

    def __init__(self, headers: Sequence[tuple[str, str]] = ()) -> None:
        self._headers = headers
        self._trailing: Sequence[tuple[str, str]] = ()

    def invocation_metadata(self) -> Sequence[tuple[str, str]]:
        return self._headers

    def time_remaining(self) -> float | None:
        return None

    def set_trailing_metadata(self, trailing_metadata: Sequence[tuple[str, str]]) -> None:
        self._trailing = trailing_metadata

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise CallAborted(code, details, self._trailing)


class StatusRecorder:
    """A ``CallContext`` that remembers the status its call was ended with, for the request's
    log line: ``code`` is None until ``abort`` is called. Everything else is ``context``'s."""

    __slots__ = ("_context", "code")

    def __init__(self, context: CallContext) -> None:
        self._context = context
        self.code: grpc.StatusCode | None = None

    def invocation_metadata(self) -> Sequence[tuple[str, str]] | None:
        return self._context.invocation_metadata()

    def time_remaining(self) -> float | None:
        return self._context.time_remaining()

    def set_trailing_metadata(self, trailing_metadata: Sequence[tuple[str, str]]) -> None:
        self._context.set_trailing_metadata(trailing_metadata)

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        self.code = code
        await self._context.abort(code, details)
