"""``Tracing``: the sampling decision, the W3C context across a call, and what reaches a real
OTLP receiver (the exporter's own gRPC path, flushed by ``shutdown``)."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from loadtest.fixtures.otlp_receiver import OtlpReceiver
from services.common.tracing import (
    Tracing,
    TracingConfig,
    call_metadata,
    ending,
    extract,
    trace_id_hex,
)

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
SAMPLED = (("traceparent", f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"),)
NOT_SAMPLED = (("traceparent", f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-00"),)


@pytest.fixture
def receiver():
    receiver = OtlpReceiver()
    endpoint = receiver.start()
    yield receiver, endpoint
    receiver.stop()


def test_sample_ratio_must_be_a_share():
    with pytest.raises(ValueError, match="otlp_traces_sample_ratio"):
        TracingConfig("http://127.0.0.1:4317", 1.5)


def test_disabled_tracing_records_nothing_and_sends_no_context():
    tracing = Tracing(TracingConfig(), "splitserve-router")
    span = tracing.start_request_span("generate", SAMPLED, {})
    assert not tracing.enabled and span is trace.INVALID_SPAN
    assert call_metadata(span) == () and trace_id_hex(span) == ""
    assert tracing.start_child(span, "route") is trace.INVALID_SPAN


def test_a_clients_traceparent_is_continued_across_a_call(receiver):
    otlp, endpoint = receiver
    router = Tracing(TracingConfig(endpoint, 0.0), "splitserve-router")
    worker = Tracing(TracingConfig(endpoint), "splitserve-decode")
    request = router.start_request_span("generate", SAMPLED, {"splitserve.req_id": "r1"})
    assert trace_id_hex(request) == CLIENT_TRACE_ID  # sampled by the client despite ratio 0
    call = router.start_child(request, "decode_call", kind=SpanKind.CLIENT)
    served = worker.start_worker_span("decode", call_metadata(call), {})
    worker.record_phase(served, "kv_transfer", 1.0, 1.5, {"splitserve.kv_transfer.blocks": 3})
    for span in (served, call, request):
        span.end()
    asyncio.run(router.shutdown())
    asyncio.run(worker.shutdown())
    spans = {s.name: s for s in otlp.spans(CLIENT_TRACE_ID)}
    assert set(spans) == {"generate", "decode_call", "decode", "kv_transfer"}
    assert spans["generate"].parent_span_id == CLIENT_SPAN_ID
    assert spans["generate"].service == "splitserve-router"
    assert spans["decode_call"].parent_span_id == spans["generate"].span_id
    assert spans["decode"].parent_span_id == spans["decode_call"].span_id
    assert spans["decode"].service == "splitserve-decode"
    assert spans["kv_transfer"].parent_span_id == spans["decode"].span_id
    transfer = spans["kv_transfer"]
    assert transfer.attributes["splitserve.kv_transfer.blocks"] == 3
    assert transfer.end_ns - transfer.start_ns == pytest.approx(0.5e9, rel=1e-3)


def test_the_ratio_decides_without_a_traceparent_and_the_client_flag_with_one(receiver):
    _, endpoint = receiver
    never = Tracing(TracingConfig(endpoint, 0.0), "splitserve-router")
    always = Tracing(TracingConfig(endpoint, 1.0), "splitserve-router")
    assert not never.start_request_span("generate", (), {}).is_recording()
    assert always.start_request_span("generate", (), {}).is_recording()
    assert not always.start_request_span("generate", NOT_SAMPLED, {}).is_recording()
    # A malformed traceparent is dropped: a new trace starts (W3C).
    fresh = always.start_request_span("generate", (("traceparent", "00-zz-yy-01"),), {})
    assert fresh.is_recording() and trace_id_hex(fresh) not in ("", CLIENT_TRACE_ID)


def test_a_worker_traces_only_calls_that_carry_a_trace_context(receiver):
    _, endpoint = receiver
    worker = Tracing(TracingConfig(endpoint), "splitserve-prefill")
    assert worker.start_worker_span("prefill", (), {}) is trace.INVALID_SPAN
    assert worker.start_worker_span("prefill", SAMPLED, {}).is_recording()
    assert extract(()) == extract((("other", "x"),))


def test_ending_fails_the_span_on_an_error_but_not_on_a_cancel(receiver):
    otlp, endpoint = receiver
    tracing = Tracing(TracingConfig(endpoint), "splitserve-router")
    failed = tracing.start_request_span("failed", SAMPLED, {})
    with pytest.raises(ValueError), ending(failed):
        raise ValueError("bad")
    cancelled = tracing.start_request_span("cancelled", SAMPLED, {})
    with pytest.raises(asyncio.CancelledError), ending(cancelled):
        raise asyncio.CancelledError
    asyncio.run(tracing.shutdown())
    spans = {s.name: s for s in otlp.spans()}
    assert spans["failed"].status_code == trace.StatusCode.ERROR.value
    assert spans["cancelled"].status_code == trace.StatusCode.UNSET.value
    assert spans["cancelled"].events == ("cancelled",)
