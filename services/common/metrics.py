"""Prometheus metrics: an HTTP ``/metrics`` endpoint per process and the workers' load gauges.

Worker gauges are read at scrape time from the same ``WorkerLoad`` that ``GetLoad`` returns, so
the two never disagree. The router's request metrics live in ``services.router.metrics``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.serving_metrics import STANDARD_METRICS
from splitserve.v1 import worker_pb2

logger = logging.getLogger(__name__)

# WorkerLoad fields exported as gauges / as counters (name -> help).
_GAUGES = {
    "num_running": "requests in the running batch",
    "num_waiting": "requests waiting to be scheduled",
    "num_waiting_for_kv": "requests waiting for a KV transfer",
    "num_kv_leases": "finished prefills whose blocks await a pull",
    "num_total_blocks": "KV blocks in the cache",
    "num_used_blocks": "KV blocks referenced by a request or a lease",
    "num_cached_blocks": "free KV blocks still holding reusable prefix KV",
    "kv_usage": "used / total KV blocks",
    "num_queued_prefill_tokens": "prompt tokens admitted or waiting but not computed",
    "num_tier_blocks": "KV blocks in the second tier (--kv-offload-gib)",
}
_COUNTERS = {
    "num_preemptions": ("preemptions", "requests preempted for lack of KV blocks"),
    "num_transfers_failed": ("kv_transfers_failed", "KV pulls that failed (prompt recomputed)"),
    "num_leases_expired": ("kv_leases_expired", "KV leases that expired without a pull"),
    "num_draft_tokens": ("spec_decode_draft_tokens", "speculative draft tokens proposed"),
    "num_accepted_draft_tokens": (
        "spec_decode_accepted_tokens",
        "speculative draft tokens the model accepted",
    ),
    "num_tier_stored_blocks": ("kv_tier_stored_blocks", "evicted KV blocks the second tier kept"),
    "num_tier_hit_blocks": (
        "kv_tier_hit_blocks",
        "KV blocks loaded back from the second tier instead of recomputed",
    ),
    "num_tier_refused_blocks": (
        "kv_tier_refused_blocks",
        "second-tier KV blocks refused on read (damaged; recomputed)",
    ),
}
# vLLM's names of the same counters (prometheus_client adds the _total suffix).
_STANDARD_COUNTERS = {
    "vllm:num_preemptions": ("num_preemptions", "requests preempted for lack of KV blocks"),
    "vllm:spec_decode_num_draft_tokens": ("num_draft_tokens", "draft tokens proposed"),
    "vllm:spec_decode_num_accepted_tokens": (
        "num_accepted_draft_tokens",
        "draft tokens accepted",
    ),
}


def start_metrics_server(host: str, port: int) -> None:
    """Serve ``/metrics`` on ``host:port`` from a background thread; port 0 disables it."""
    if port:
        start_http_server(port, addr=host)
        logger.info("metrics on http://%s:%d/metrics", host, port)


class WorkerLoadCollector(Collector):
    """Exports ``splitserve_worker_*`` from ``load()`` at each scrape."""

    def __init__(self, role: str, worker_id: str, load: Callable[[], worker_pb2.WorkerLoad]):
        self._labels = {"role": role, "worker_id": worker_id}
        self._load = load

    def collect(self) -> Iterator[Metric]:
        load = self._load()
        names, values = list(self._labels), list(self._labels.values())
        for field, help_text in _GAUGES.items():
            gauge = GaugeMetricFamily(f"splitserve_worker_{field}", help_text, labels=names)
            gauge.add_metric(values, getattr(load, field))
            yield gauge
        for field, (name, help_text) in _COUNTERS.items():
            counter = CounterMetricFamily(f"splitserve_worker_{name}", help_text, labels=names)
            counter.add_metric(values, getattr(load, field))
            yield counter


class StandardLoadCollector(Collector):
    """vLLM's gauges and counters of a worker's load, for an engine that does not keep them
    itself: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
    ``vllm:kv_cache_usage_perc``, ``vllm:num_preemptions_total`` and
    ``vllm:spec_decode_num_{draft,accepted}_tokens_total``, labelled ``model_name`` (see
    ``serving_metrics``, which adds the worker's ``pool`` and ``worker_id``)."""

    def __init__(self, model_name: str, load: Callable[[], worker_pb2.WorkerLoad]):
        self._model_name = model_name
        self._load = load

    def collect(self) -> Iterator[Metric]:
        load = self._load()
        names, values = ["model_name"], [self._model_name]
        gauges = {
            "vllm:num_requests_running": ("requests in the running batch", load.num_running),
            "vllm:num_requests_waiting": (
                "requests waiting to be scheduled or for their KV transfer",
                load.num_waiting + load.num_waiting_for_kv,
            ),
            "vllm:kv_cache_usage_perc": ("used / total KV blocks (0 to 1)", load.kv_usage),
        }
        for name, (help_text, value) in gauges.items():
            gauge = GaugeMetricFamily(name, help_text, labels=names)
            gauge.add_metric(values, value)
            yield gauge
        for name, (field, help_text) in _STANDARD_COUNTERS.items():
            counter = CounterMetricFamily(name, help_text, labels=names)
            counter.add_metric(values, getattr(load, field))
            yield counter


@dataclass(frozen=True, slots=True)
class WorkerMetrics:
    """What ``register_worker_metrics`` exports for one worker, until ``unregister``."""

    load: WorkerLoadCollector
    standard_key: int

    def unregister(self) -> None:
        """Stop exporting the worker's series (another worker of the same process would export
        the same ones)."""
        REGISTRY.unregister(self.load)
        STANDARD_METRICS.remove_source(self.standard_key)


def register_worker_metrics(
    role: str,
    worker_id: str,
    model_name: str,
    load: Callable[[], worker_pb2.WorkerLoad],
    engine_metrics: Collector | None,
) -> WorkerMetrics:
    """Export a worker's load as ``splitserve_worker_*``, and its ``vllm:`` metrics: the
    engine's own (``engine_metrics``, e.g. vLLM's stat logger) or, without them, vLLM's names
    of the same load (``StandardLoadCollector``); both labelled with ``pool`` and
    ``worker_id``."""
    collector = WorkerLoadCollector(role, worker_id, load)
    REGISTRY.register(collector)
    standard = (
        engine_metrics if engine_metrics is not None else StandardLoadCollector(model_name, load)
    )
    key = STANDARD_METRICS.add_source(standard, {"pool": role, "worker_id": worker_id})
    return WorkerMetrics(collector, key)
