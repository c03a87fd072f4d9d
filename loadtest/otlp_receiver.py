"""An OTLP/gRPC trace receiver in process: what a collector would get, kept as plain spans.

It serves ``opentelemetry.proto.collector.trace.v1.TraceService`` (the service every OTLP
exporter speaks) on a loopback port, so that tests and the tracing benchmark point
``--otlp-traces-endpoint`` at it instead of at a Jaeger or an OpenTelemetry Collector.
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    """One exported span; ids as lowercase hex ("" for a root's parent)."""

    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: tuple[str, ...] = field(default=())
    status_code: int = 0


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects every span exported to it; thread-safe. ``start`` returns the endpoint."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None

    def start(self, host: str = "127.0.0.1") -> str:
        # Off as on every server of ours (services.common.grpc_server): never share a port.
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4), options=(("grpc.so_reuseport", 0),)
        )
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port(f"{host}:0")
        self._server.start()
        return f"http://{host}:{port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            service = str(resource.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            service=service,
                            name=span.name,
                            kind=span.kind,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes=_attributes(span.attributes),
                            events=tuple(event.name for event in span.events),
                            status_code=span.status.code,
                        )
                    )
        with self._lock:
            self._spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self, trace_id: str | None = None) -> list[ReceivedSpan]:
        """The spans received so far (of ``trace_id`` only, when given)."""
        with self._lock:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def _value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None
