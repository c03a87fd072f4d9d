"""The router's one line per finished request: what an SRE greps for first.

``req_id``, the client's ``request_id``, the trace id (when traced), prompt / cached / output
tokens, TTFT and end-to-end milliseconds, the prefill worker and the decode workers it used
(several after a failover), and how it ended: ``outcome`` (``stop``, ``length``, ``abort``,
``cancelled`` or ``error``), the ``finish_reason`` (empty when it ended without one) and the
call's ``status`` (the gRPC status code's name: ``OK``, ``CANCELLED``, ``UNAVAILABLE``, ...).
Under ``--log-format json`` each is a key of the line.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

import grpc

from services.common.convert import FINISH_REASON_NAMES, field_values
from services.common.logs import log_fields
from splitserve.v1 import router_pb2

logger = logging.getLogger("splitserve.requests")


class Outcome(enum.StrEnum):
    """How a request ended: its finish reason, or why it has none. The value is the label of
    ``splitserve_router_requests_total`` and the log line's ``outcome``."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    TOOL_CALLS = "tool_calls"  # the turn ended with tool calls
    INVALID = "invalid"  # refused as bad input
    REJECTED = "rejected"  # refused for capacity: --max-inflight-requests, no decode worker yet
    CANCELLED = "cancelled"  # the caller went away
    ERROR = "error"  # the server failed it

    @classmethod
    def of_finish_reason(cls, finish_reason: router_pb2.FinishReason) -> Outcome:
        """The outcome of a ``router_pb2.FinishReason`` other than UNSPECIFIED."""
        return cls(FINISH_REASON_NAMES[finish_reason])

    @property
    def finished(self) -> bool:
        """Whether the generation reached a finish reason."""
        return self in _FINISHED


_FINISHED = frozenset({Outcome.STOP, Outcome.LENGTH, Outcome.ABORT, Outcome.TOOL_CALLS})


def call_status(outcome: Outcome, aborted_with: grpc.StatusCode | None) -> str:
    """The status name a request's call ended with: the code it was aborted with, else
    ``CANCELLED`` for a caller that went away, ``OK`` after a finish reason, and ``UNKNOWN``
    for an error raised without a status."""
    if aborted_with is not None:
        return aborted_with.name
    if outcome is Outcome.CANCELLED:
        return grpc.StatusCode.CANCELLED.name
    return grpc.StatusCode.OK.name if outcome.finished else grpc.StatusCode.UNKNOWN.name


@dataclass(slots=True)
class RequestLog:
    """Filled in as the request goes; ``emit`` writes the line once it is over."""

    req_id: str
    request_id: str
    prompt_tokens: int
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    prefill_worker: str = ""
    decode_workers: list[str] = field(default_factory=list)
    trace_id: str = ""

    def emit(self, outcome: Outcome, status: str) -> None:
        """Write the line: the request ended with ``outcome`` and its call with ``status``."""
        logger.info(
            "req_id=%s finished (%s, %s): %d prompt tokens (%d cached), %d output tokens, "
            "TTFT %s ms, E2E %s ms, prefill %s, decode %s%s",
            self.req_id,
            outcome,
            status,
            self.prompt_tokens,
            self.cached_tokens,
            self.output_tokens,
            _ms(self.ttft_ms),
            _ms(self.e2e_ms),
            self.prefill_worker or "-",
            ",".join(self.decode_workers) or "-",
            f", trace_id {self.trace_id}" if self.trace_id else "",
            extra=log_fields(
                **field_values(self, RequestLog),
                outcome=outcome.value,
                finish_reason=outcome.value if outcome.finished else "",
                status=status,
            ),
        )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
