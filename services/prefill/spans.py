"""The prefill worker's part of a request's trace (see ``services.worker.spans``)."""

from __future__ import annotations

from opentelemetry.trace import Span

from engine.outputs import RequestOutput
from services.common.tracing import Tracing
from services.worker.spans import record_engine_request


def record_prefill(tracing: Tracing, span: Span, final: RequestOutput) -> None:
    """The queue wait, then the compute (admission until the first token) as ``engine.prefill``,
    and the prefix-hit tokens."""
    if not span.is_recording():
        return
    record_engine_request(tracing, span, final)
    if final.scheduled_time_s is not None and final.first_token_time_s is not None:
        compute_ms = (final.first_token_time_s - final.scheduled_time_s) * 1000
        span.set_attribute("splitserve.compute_ms", compute_ms)
    tracing.record_phase(span, "engine.prefill", final.scheduled_time_s, final.first_token_time_s)
