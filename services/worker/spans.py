"""What every worker adds to a request's trace: the engine's phases under the worker's span.

The phases are measured by the engine (``RequestOutput``'s ``time.perf_counter()`` stamps) and
become child spans once the request is over, so that the engine thread never touches the
tracer. The role-specific parts are ``services.prefill.spans`` and ``services.decode.spans``.
"""

from __future__ import annotations

from opentelemetry.trace import Span

from engine.outputs import RequestOutput
from services.common.tracing import Tracing


def record_engine_request(tracing: Tracing, span: Span, final: RequestOutput) -> None:
    """The request's tokens, prefix-cache hits and finish on ``span``, and its queue wait
    (arrival until the scheduler gave it blocks) as the child ``engine.queue``."""
    span.set_attributes(
        {
            "splitserve.prompt_tokens": len(final.prompt_token_ids),
            "splitserve.prefix_hit_tokens": final.num_cached_tokens,
            "splitserve.finish_reason": final.finish_reason or "",
        }
    )
    if final.scheduled_time_s is not None:
        queue_ms = (final.scheduled_time_s - final.arrival_time_s) * 1000
        span.set_attribute("splitserve.queue_wait_ms", queue_ms)
    tracing.record_phase(span, "engine.queue", final.arrival_time_s, final.scheduled_time_s)
