"""Which worker failures the router retries on another worker, and which fail the request.

Retried: the worker went away (UNAVAILABLE, a reset stream's INTERNAL / UNKNOWN, CANCELLED by a
worker shutting down, a deadline the router set for a worker that stopped answering). Failed
with the worker's status: the worker rejected the request (INVALID_ARGUMENT, ...) or reported it
failed on its own (``FailureKind.REQUEST``), since any worker would fail it again. A request that
was running on ``max_engine_deaths`` engines that each died is failed too: it may be what kills
them, and retrying it would take the pool down one engine at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from services.common.failures import FailureKind, failure_kind
from services.common.roles import Role

_RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
    }
)


@dataclass(frozen=True, slots=True)
class Failure:
    """The status a request fails with."""

    code: grpc.StatusCode
    details: str


@dataclass(slots=True)
class FailurePolicy:
    """One request's retry decisions (``judge`` once per failed worker call)."""

    max_engine_deaths: int = 2
    num_engine_deaths: int = 0

    def judge(
        self, error: grpc.aio.AioRpcError, role: Role, deadline_was_ours: bool = False
    ) -> Failure | None:
        """None: retry on another worker. Else the status to fail the request with."""
        code = error.code()
        details = error.details() or f"{role} worker failed"
        kind = failure_kind(error)
        if kind is FailureKind.REQUEST:
            return Failure(code, details)
        if kind is FailureKind.ENGINE_DEAD:
            self.num_engine_deaths += 1
            if self.num_engine_deaths >= self.max_engine_deaths:
                return Failure(
                    grpc.StatusCode.INTERNAL,
                    f"the request was running on {self.num_engine_deaths} engines that died; "
                    f"not retried (last: {details})",
                )
            return None
        if code in _RETRYABLE or (code is grpc.StatusCode.DEADLINE_EXCEEDED and deadline_was_ours):
            return None
        return Failure(code, details)
