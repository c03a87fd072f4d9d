"""How a worker says why a call failed, so that the router knows whether retrying can help.

A worker attaches ``FailureKind`` to the trailing metadata of a failed call. The status code
alone cannot tell: a worker dying mid-stream shows up as UNAVAILABLE, INTERNAL or CANCELLED
depending on timing, all worth retrying elsewhere, while a request that fails inside the engine
(non-finite logits, an exception of its own) would fail again on every worker.
"""

from __future__ import annotations

import enum
from typing import NoReturn

import grpc

FAILURE_KEY = "splitserve-failure"
# Seconds until a refused call may succeed (the name and meaning of HTTP's Retry-After).
RETRY_AFTER = "retry-after"


class FailureKind(enum.Enum):
    """Why a worker ended a call with an error."""

    # The request failed in the engine on its own: retrying elsewhere repeats the failure.
    REQUEST = "request"
    # The worker's engine died while the request ran: retry elsewhere, but a request that
    # was running on every engine that died may be the cause (see the router's retries).
    ENGINE_DEAD = "engine-dead"
    # The worker is shutting down or draining and cut the stream: retry elsewhere.
    SHUTDOWN = "shutdown"


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    """End the call with ``code`` and ``details`` (``context.abort``, typed: it always raises)."""
    await context.abort(code, details)
    raise AssertionError("unreachable: abort raises")


async def abort_retry_after(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str, retry_after_s: int
) -> NoReturn:
    """End the call with ``code`` and ``details``, telling the caller when to try again
    (``retry-after`` seconds, in the trailing metadata; the HTTP API's header)."""
    context.set_trailing_metadata(((RETRY_AFTER, str(retry_after_s)),))
    await context.abort(code, details)
    raise AssertionError("unreachable: abort raises")


async def abort_with(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, kind: FailureKind, details: str
) -> NoReturn:
    """End the call with ``code`` and ``details``, marked with ``kind``."""
    context.set_trailing_metadata(((FAILURE_KEY, kind.value),))
    await context.abort(code, details)
    raise AssertionError("unreachable: abort raises")


def failure_kind(error: grpc.aio.AioRpcError) -> FailureKind | None:
    """The kind a worker attached to ``error``; None for failures it did not report itself
    (it died, the network failed, the call timed out)."""
    for key, value in error.trailing_metadata() or ():
        if key == FAILURE_KEY:
            try:
                return FailureKind(value)
            except ValueError:
                return None
    return None
