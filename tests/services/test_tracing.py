"""One trace per request across a real cluster's processes, exported to an OTLP receiver that
the test runs: the client's ``traceparent`` (gRPC metadata, HTTP header) is continued, the
spans nest router -> worker call -> worker -> engine phase, and the transfer span counts the
blocks the prompt fills. Logs are JSON here: the router's request line carries the trace id."""

from __future__ import annotations

import contextlib
import json
import signal
from collections.abc import Iterator

import openai
import pytest

from engine.kv_cache_manager import cdiv
from loadtest.fixtures.otlp_receiver import OtlpReceiver, ReceivedSpan
from services.common.logs import LOG_FORMAT_ENV
from services.launcher import LocalCluster
from splitserve.v1 import router_pb2
from tests.services.conftest import Client, greedy, tiny_engine_config
from tests.waiting import wait_until

PROMPT = list(range(40, 107))  # 67 tokens: 4 full blocks of 16 and a partial one
SPAN_KIND_SERVER, SPAN_KIND_CLIENT = 2, 3


def traceparent(trace_id: str, parent_id: str = "00f067aa0ba902b7") -> str:
    return f"00-{trace_id}-{parent_id}-01"


@contextlib.contextmanager
def traced_cluster(
    tiny_llama_dir, **cluster_fields
) -> Iterator[tuple[LocalCluster, Client, OtlpReceiver]]:
    """A cluster whose every process traces to an OTLP receiver run here, logging JSON."""
    receiver = OtlpReceiver()
    tracing = ("--otlp-traces-endpoint", receiver.start())
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within 0.1 s, not 5 s
        env.setenv(LOG_FORMAT_ENV, "json")
        cluster = LocalCluster(
            engine=tiny_engine_config(tiny_llama_dir),
            log_level="INFO",
            extra_worker_flags=tracing,
            extra_router_flags=("--local-prefill-max-tokens", "0", *tracing),
            **cluster_fields,
        )
        try:
            cluster.start(timeout_s=180)
            client = Client(cluster.router_address)
            yield cluster, client, receiver
            client.close()
        finally:
            cluster.stop()
            receiver.stop()


@pytest.fixture(scope="module")
def traced(tiny_llama_dir):
    with traced_cluster(tiny_llama_dir) as cluster:
        yield cluster


def wait_for_trace(receiver: OtlpReceiver, trace_id: str, names: set[str]) -> dict:
    """The trace's spans by name, once every one of ``names`` has arrived."""

    def complete() -> dict[str, ReceivedSpan] | None:
        spans = {s.name: s for s in receiver.spans(trace_id)}
        return spans if names <= set(spans) else None

    return wait_until(
        complete, 60, lambda: f"spans {names} of {trace_id}: {receiver.spans(trace_id)}"
    )


def test_one_trace_spans_router_prefill_transfer_and_decode(traced):
    cluster, client, receiver = traced
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    request = router_pb2.GenerateRequest(token_ids=PROMPT, sampling=greedy(5))
    messages = list(
        client.stub.Generate(
            request, timeout=120, metadata=(("traceparent", traceparent(trace_id)),)
        )
    )
    usage = messages[-1].usage
    names = {"generate", "route", "prefill_call", "prefill", "engine.queue", "engine.prefill"}
    names |= {"decode_call", "decode", "kv_transfer", "engine.decode"}
    spans = wait_for_trace(receiver, trace_id, names)
    every = receiver.spans(trace_id)
    assert len([s for s in every if s.name == "generate"]) == 1

    generate = spans["generate"]
    assert generate.service == "splitserve-router" and generate.kind == SPAN_KIND_SERVER
    assert generate.parent_span_id == "00f067aa0ba902b7"  # the client's span
    assert generate.attributes["gen_ai.usage.prompt_tokens"] == usage.prompt_tokens
    assert generate.attributes["gen_ai.usage.completion_tokens"] == usage.completion_tokens == 5
    assert generate.attributes["splitserve.outcome"] == "length"
    prefill_address = cluster.workers("prefill")[0].address
    decode_address = cluster.workers("decode")[0].address
    route = spans["route"]
    assert route.parent_span_id == generate.span_id
    assert route.attributes["splitserve.route.prefill_worker"] == prefill_address
    assert route.attributes["splitserve.route.decode_worker"] == decode_address
    assert route.attributes["splitserve.route.prefill_candidates"][0].startswith(prefill_address)
    assert route.attributes["splitserve.route.ledger"] == "in_process"
    assert route.attributes["splitserve.route.ledger_ms"] >= 0

    for call, worker, service in (
        ("prefill_call", "prefill", "splitserve-prefill"),
        ("decode_call", "decode", "splitserve-decode"),
    ):
        assert spans[call].kind == SPAN_KIND_CLIENT
        assert spans[call].parent_span_id == generate.span_id
        assert spans[worker].parent_span_id == spans[call].span_id
        assert spans[worker].service == service and spans[worker].kind == SPAN_KIND_SERVER
        assert spans[call].start_ns <= spans[worker].start_ns <= spans[worker].end_ns
    assert spans["prefill"].attributes["splitserve.prefix_hit_tokens"] == usage.cached_tokens
    queues = [s for s in every if s.name == "engine.queue"]
    assert {q.parent_span_id for q in queues} == {spans["prefill"].span_id, spans["decode"].span_id}
    assert spans["engine.prefill"].parent_span_id == spans["prefill"].span_id

    transfer = spans["kv_transfer"]
    block_size = next(w.info.block_size for w in client.status().workers)
    assert transfer.parent_span_id == spans["decode"].span_id
    assert transfer.attributes["splitserve.kv_transfer.blocks"] == cdiv(
        usage.prompt_tokens, block_size
    )
    assert transfer.attributes["splitserve.kv_transfer.bytes"] > 0
    decode_info = next(w.info for w in client.status().workers if w.address == decode_address)
    assert transfer.attributes["splitserve.kv_transfer.backend"] == decode_info.kv_transfer_backend
    assert transfer.attributes["splitserve.kv_transfer.failed"] is False
    decode = spans["engine.decode"]
    assert decode.parent_span_id == spans["decode"].span_id
    assert decode.start_ns >= transfer.end_ns
    # The decode worker generated every token after the prefill worker's first.
    assert spans["decode"].attributes["splitserve.generated_tokens"] == 4


def test_http_traceparent_is_continued_and_the_request_line_carries_the_trace_id(traced):
    cluster, client, receiver = traced
    trace_id = "5b8efff798038103d269b633813fc60c"
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused") as http:
        completion = http.completions.create(
            model=client.status().model,
            prompt=PROMPT,
            max_tokens=3,
            temperature=0,
            extra_headers={"traceparent": traceparent(trace_id)},
        )
    assert completion.usage.completion_tokens == 3
    spans = wait_for_trace(receiver, trace_id, {"generate", "prefill", "decode"})
    assert spans["generate"].attributes["gen_ai.usage.completion_tokens"] == 3
    router = cluster.workers("router")[0]

    def request_line() -> dict | None:
        entries = [json.loads(line) for line in list(router.stderr_tail)]
        return next((e for e in entries if e.get("trace_id") == trace_id), None)

    line = wait_until(request_line, 30, "the router's request line with the trace id")
    assert line["logger"] == "splitserve.requests" and line["output_tokens"] == 3
    assert line["req_id"] == spans["generate"].attributes["splitserve.req_id"]
    assert trace_id in line["message"]
    for worker in (*cluster.workers("prefill"), *cluster.workers("decode")):
        lines = list(worker.stderr_tail)
        assert lines and all(json.loads(line)["level"] for line in lines)


def test_a_request_without_traceparent_starts_its_own_trace(traced):
    _, client, receiver = traced
    got = client.generate(token_ids=PROMPT[:20], sampling=greedy(2), request_id="untraced")

    def root() -> ReceivedSpan | None:
        return next(
            (
                s
                for s in receiver.spans()
                if s.name == "generate" and s.attributes.get("gen_ai.request.id") == "untraced"
            ),
            None,
        )

    generate = wait_until(root, 60, "the router's root span")
    assert generate.parent_span_id == "" and len(got.token_ids) == 2
    wait_for_trace(receiver, generate.trace_id, {"decode"})


@pytest.fixture(scope="module")
def traced_pair(tiny_llama_dir):
    """A traced cluster with two decode workers, one of which a test kills."""
    with traced_cluster(tiny_llama_dir, num_decode=2) as cluster:
        yield cluster


def test_a_migration_is_an_event_of_the_request_span(traced_pair):
    """The decode worker serving a stream dies: the request's one ``generate`` span records a
    ``decode_failover`` event and has two ``decode_call`` children, one per worker."""
    cluster, client, receiver = traced_pair
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    call = client.stub.Generate(
        router_pb2.GenerateRequest(token_ids=PROMPT, sampling=greedy(200, ignore_eos=True)),
        timeout=120,
        metadata=(("traceparent", traceparent(trace_id)),),
    )
    num_tokens = 0
    killed = False
    for message in call:
        num_tokens += len(message.token_ids)
        if not killed and num_tokens >= 20:
            busy = [w for w in client.status().workers if w.role == 2 and w.load.num_running]
            victim = next(p for p in cluster.workers("decode") if p.address == busy[0].address)
            victim.signal(signal.SIGKILL)
            killed = True
    assert killed and num_tokens == 200
    spans = wait_for_trace(receiver, trace_id, {"generate", "decode_call"})
    generate = spans["generate"]
    assert "decode_failover" in generate.events
    calls = [s for s in receiver.spans(trace_id) if s.name == "decode_call"]
    assert len(calls) == 2 and {c.parent_span_id for c in calls} == {generate.span_id}
