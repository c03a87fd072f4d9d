"""The decode worker's part of a request's trace (see ``services.worker.spans``)."""

from __future__ import annotations

import time

from opentelemetry.trace import Span

from engine.outputs import RequestOutput
from services.common.tracing import Tracing
from services.worker.kv_puller import PullResult
from services.worker.spans import record_engine_request


def record_decode(
    tracing: Tracing,
    span: Span,
    final: RequestOutput,
    num_generated_tokens: int,
    pull: PullResult | None,
) -> None:
    """The queue wait (until admitted), the KV transfer (backend, blocks, bytes) as
    ``kv_transfer``, and the generation (from admission, or from the transfer's end, until
    now: the last token) as ``engine.decode`` with the tokens this worker generated."""
    if not span.is_recording():
        return
    end_s = time.perf_counter()
    record_engine_request(tracing, span, final)
    span.set_attribute("splitserve.generated_tokens", num_generated_tokens)
    generate_start_s = final.scheduled_time_s
    if pull is not None:
        span.set_attribute("splitserve.kv_transfer.failed", pull.failed)
        if pull.start_s is not None:
            tracing.record_phase(
                span,
                "kv_transfer",
                pull.start_s,
                pull.end_s,
                {
                    "splitserve.kv_transfer.backend": pull.backend,
                    "splitserve.kv_transfer.blocks": pull.num_transferred_blocks,
                    "splitserve.kv_transfer.bytes": pull.num_bytes,
                    "splitserve.kv_transfer.failed": pull.failed,
                },
            )
            generate_start_s = pull.end_s
    tracing.record_phase(
        span,
        "engine.decode",
        generate_start_s,
        end_s,
        {"splitserve.generated_tokens": num_generated_tokens},
    )
