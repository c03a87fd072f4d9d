"""``StandardMetrics``: every ``vllm:`` family of a process, merged from splitserve's own and the
workers' engine sources, each family once (Prometheus refuses a second ``# TYPE`` line).

The reference is prometheus_client's own text parser over the exposition."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics import StandardLoadCollector
from services.common.serving_metrics import ServingMetrics, StandardMetrics
from splitserve.v1 import worker_pb2


def _exposition(collector: StandardMetrics) -> str:
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_sources_of_one_family_merge_into_one_family_each_with_its_workers_labels():
    standard = StandardMetrics()
    engine_registry = CollectorRegistry()
    preemptions = Counter(
        "vllm:num_preemptions", "preempted", ["model_name", "engine"], registry=engine_registry
    )
    preemptions.labels("m", "0").inc(3)
    load = worker_pb2.WorkerLoad(num_running=2, num_preemptions=5, kv_usage=0.25)
    standard.add_source(engine_registry, {"pool": "decode", "worker_id": "d0"})
    native = standard.add_source(
        StandardLoadCollector("m", lambda: load), {"pool": "prefill", "worker_id": "p0"}
    )
    text = _exposition(standard)
    assert text.count("# TYPE vllm:num_preemptions_total counter\n") == 1, text
    samples = _samples(text)
    prefill = frozenset({"model_name": "m", "pool": "prefill", "worker_id": "p0"}.items())
    decode = frozenset(
        {"model_name": "m", "engine": "0", "pool": "decode", "worker_id": "d0"}.items()
    )
    assert samples[("vllm:num_preemptions_total", decode)] == 3
    assert samples[("vllm:num_preemptions_total", prefill)] == 5
    assert samples[("vllm:num_requests_running", prefill)] == 2

    standard.remove_source(native)
    assert ("vllm:num_preemptions_total", prefill) not in _samples(_exposition(standard))


def test_splitserve_families_appear_once_observed():
    pool = "test-serving-metrics"
    labels = frozenset({("model_name", "m"), ("pool", pool)})
    assert ("vllm:e2e_request_latency_seconds_count", labels) not in _samples(
        _exposition(StandardMetrics())
    )
    ServingMetrics("m", pool).e2e.observe(0.5)
    assert (
        _samples(_exposition(StandardMetrics()))[("vllm:e2e_request_latency_seconds_count", labels)]
        == 1
    )
