"""Prometheus metrics: an HTTP ``/metrics`` endpoint per process and the workers' load gauges.

Worker gauges are read at scrape time from the same ``WorkerLoad`` that ``GetLoad`` returns, so
the two never disagree. The router's request metrics live in ``services.router.metrics``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

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
    """Exports ``splitserve_worker_*`` from ``load()`` at each scrape, and vLLM's gauges of the
    same load (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
    ``vllm:kv_cache_usage_perc``, ``vllm:num_preemptions_total``,
    ``vllm:spec_decode_num_draft_tokens_total`` and ``..._num_accepted_tokens_total``; see
    ``serving_metrics``)."""

    def __init__(
        self,
        role: str,
        worker_id: str,
        model_name: str,
        load: Callable[[], worker_pb2.WorkerLoad],
    ):
        self._labels = {"role": role, "worker_id": worker_id}
        self._standard_labels = {"model_name": model_name, "pool": role, "worker_id": worker_id}
        self._load = load

    def collect(self) -> Iterator[Metric]:
        load = self._load()
        yield from self._standard(load)
        names, values = list(self._labels), list(self._labels.values())
        for field, help_text in _GAUGES.items():
            gauge = GaugeMetricFamily(f"splitserve_worker_{field}", help_text, labels=names)
            gauge.add_metric(values, getattr(load, field))
            yield gauge
        for field, (name, help_text) in _COUNTERS.items():
            counter = CounterMetricFamily(f"splitserve_worker_{name}", help_text, labels=names)
            counter.add_metric(values, getattr(load, field))
            yield counter

    def _standard(self, load: worker_pb2.WorkerLoad) -> Iterator[Metric]:
        names, values = list(self._standard_labels), list(self._standard_labels.values())
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


def register_worker_metrics(
    role: str, worker_id: str, model_name: str, load: Callable[[], worker_pb2.WorkerLoad]
) -> WorkerLoadCollector:
    """Export a worker's load; ``REGISTRY.unregister`` the collector when the worker stops
    (another worker of the same process would export the same series)."""
    collector = WorkerLoadCollector(role, worker_id, model_name, load)
    REGISTRY.register(collector)
    return collector
