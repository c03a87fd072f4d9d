"""Request traces over OpenTelemetry: one trace per request across router, prefill and decode.

Off unless ``--otlp-traces-endpoint`` is set (vLLM's flag). The router continues a client's W3C
``traceparent`` (gRPC metadata or HTTP header) or starts the trace, and hands its context to
each worker call as ``traceparent`` metadata; a worker traces only requests that arrive with
one, so the router's sampling decision (``--otlp-traces-sample-ratio``, a client's sampled flag
winning) holds for the whole trace.

Each service owns its ``TracerProvider`` rather than the process-global one: a test or an
embedding process can run a router and workers side by side, each under its own
``service.name``. Spans are exported in batches over OTLP/gRPC from a background thread;
nothing is recorded per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from engine.flags import flag

logger = logging.getLogger(__name__)

# The W3C trace context headers / metadata keys.
TRACE_HEADERS = ("traceparent", "tracestate")
_SHUTDOWN_TIMEOUT_S = 5.0
_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """Where a service sends its spans, and which share of requests it traces."""

    otlp_traces_endpoint: str = flag(
        "",
        "OTLP/gRPC collector that receives request traces (host:port, http://host:port, or "
        "https://host:port for TLS; empty: no tracing)",
    )
    otlp_traces_sample_ratio: float = flag(
        1.0,
        "share of requests the router traces when the client sends no traceparent (0 to 1); "
        "a client's traceparent decides for its own request",
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.otlp_traces_sample_ratio <= 1.0:
            raise ValueError(
                "otlp_traces_sample_ratio must be within [0, 1], got "
                f"{self.otlp_traces_sample_ratio}"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.otlp_traces_endpoint)


class Tracing:
    """One service's tracer. Disabled (``TracingConfig.enabled`` false), every span it starts
    is the no-op ``INVALID_SPAN``, so callers need no branches; ``shutdown`` flushes what is
    still buffered (for ``_SHUTDOWN_TIMEOUT_S`` at most)."""

    def __init__(
        self,
        config: TracingConfig,
        service_name: str,
        attributes: Mapping[str, str] | None = None,
    ) -> None:
        self._provider: TracerProvider | None = None
        self._endpoint = config.otlp_traces_endpoint
        self.tracer: trace.Tracer = trace.NoOpTracer()
        if not config.enabled:
            return
        endpoint = self._endpoint
        resource = Resource.create({"service.name": service_name, **(attributes or {})})
        sampler = ParentBased(TraceIdRatioBased(config.otlp_traces_sample_ratio))
        self._provider = TracerProvider(resource=resource, sampler=sampler)
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self._provider.get_tracer("splitserve")

    @property
    def enabled(self) -> bool:
        return self._provider is not None

    def start_request_span(
        self, name: str, metadata: Iterable[tuple[str, str]], attributes: dict[str, Any]
    ) -> Span:
        """The router's span of one request: a child of the caller's ``traceparent`` when it
        sent one, else the root of a new trace (sampled by ratio)."""
        if not self.enabled:
            return trace.INVALID_SPAN
        parent = extract(metadata)
        return self.tracer.start_span(
            name, context=parent, kind=SpanKind.SERVER, attributes=attributes
        )

    def start_worker_span(
        self, name: str, metadata: Iterable[tuple[str, str]], attributes: dict[str, Any]
    ) -> Span:
        """A worker's span of one call: a child of the router's call span, or no span (the
        no-op one) when the call carries no trace context."""
        if not self.enabled:
            return trace.INVALID_SPAN
        parent = extract(metadata)
        if not trace.get_current_span(parent).get_span_context().is_valid:
            return trace.INVALID_SPAN
        return self.tracer.start_span(
            name, context=parent, kind=SpanKind.SERVER, attributes=attributes
        )

    def start_child(
        self,
        parent: Span,
        name: str,
        *,
        kind: SpanKind = SpanKind.INTERNAL,
        start_time_s: float | None = None,
        attributes: dict[str, Any] | None = None,
    ) -> Span:
        """A child of ``parent`` (none when ``parent`` records nothing). ``start_time_s`` is a
        ``time.perf_counter()`` stamp, for a phase measured before its span is made."""
        if not parent.is_recording():
            return trace.INVALID_SPAN
        return self.tracer.start_span(
            name,
            context=trace.set_span_in_context(parent),
            kind=kind,
            attributes=attributes,
            start_time=None if start_time_s is None else epoch_ns(start_time_s),
        )

    def record_phase(
        self,
        parent: Span,
        name: str,
        start_s: float | None,
        end_s: float | None,
        attributes: dict[str, Any] | None = None,
    ) -> None:
        """A child of ``parent`` over ``[start_s, end_s]`` (``time.perf_counter()`` stamps),
        made after the fact; nothing when either end is unknown."""
        if start_s is None or end_s is None or not parent.is_recording():
            return
        span = self.start_child(parent, name, start_time_s=start_s, attributes=attributes)
        span.end(end_time=epoch_ns(end_s))

    async def shutdown(self) -> None:
        """Export what is buffered and stop the exporter (off the event loop), waiting at most
        ``_SHUTDOWN_TIMEOUT_S``: an unreachable collector must not hold up a process's exit."""
        if self._provider is None:
            return
        try:
            await asyncio.wait_for(asyncio.to_thread(self._provider.shutdown), _SHUTDOWN_TIMEOUT_S)
        except TimeoutError:
            logger.warning(
                "spans still unexported after %.0f s are dropped (collector %s unreachable?)",
                _SHUTDOWN_TIMEOUT_S,
                self._endpoint,
            )


def extract(metadata: Iterable[tuple[str, str]]) -> Context:
    """The trace context in a call's ``traceparent`` / ``tracestate`` metadata (an empty
    context when there is none, or it is malformed: the W3C spec says to start afresh)."""
    carrier = {key.lower(): value for key, value in metadata if key.lower() in TRACE_HEADERS}
    return _PROPAGATOR.extract(carrier)


def call_metadata(span: Span) -> tuple[tuple[str, str], ...]:
    """The metadata that makes ``span`` the parent of the callee's spans (none when ``span``
    records nothing)."""
    if not span.is_recording():
        return ()
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items())


def trace_id_hex(span: Span) -> str:
    """``span``'s trace id as 32 hex digits (the form trace UIs search by); "" for none."""
    context = span.get_span_context()
    return trace.format_trace_id(context.trace_id) if context.is_valid else ""


# One anchor for the process: converting each stamp against fresh clock reads would jitter by
# the time between the two reads, and put phases that touch (a transfer's end, the decode's
# start) out of order.
_ANCHOR_EPOCH_NS, _ANCHOR_PERF_S = time.time_ns(), time.perf_counter()


def epoch_ns(perf_counter_s: float) -> int:
    """A ``time.perf_counter()`` stamp as nanoseconds since the epoch (what spans carry); the
    same stamp always gives the same value, and the order of stamps is kept."""
    return _ANCHOR_EPOCH_NS + round((perf_counter_s - _ANCHOR_PERF_S) * 1e9)


@contextlib.contextmanager
def ending(span: Span) -> Iterator[Span]:
    """End ``span`` when the block exits; an exception marks it failed (and propagates), a
    cancellation (the caller went away, or moved the request elsewhere) only noted."""
    try:
        yield span
    except (asyncio.CancelledError, GeneratorExit):
        span.add_event("cancelled")
        raise
    except BaseException as exc:
        if span.is_recording():
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        span.end()
