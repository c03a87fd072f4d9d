"""The router's view of the worker pools as Prometheus gauges: how many workers each pool has
and wants, so that a dashboard shows pool sizes and the planner's decisions over time.

``splitserve_pool_workers{model_name, pool, state}`` counts the router's members of each
model's pool by state (``ready``: routable; ``unhealthy``: failing its polls; ``draining``:
scaled down, finishing its requests). With an orchestrator (Ray),
``splitserve_pool_desired_workers``, ``splitserve_pool_starting_workers`` and
``splitserve_pool_restarts_total`` are its last answer (``Router.Status``'s pools), refreshed
by the router's poll loop: a step in the desired size is a ``Scale`` call or a planner
decision.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.router.scaler import PoolSize
from services.router.worker_pool import WorkerPool


class WorkerState(enum.Enum):
    READY = "ready"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"


class PoolCollector(Collector):
    """Read at each scrape from ``pools`` and from ``sizes`` (the orchestrator's last answer,
    set by the router; empty without one)."""

    def __init__(self, pools: Sequence[WorkerPool]) -> None:
        self._pools = pools
        self.sizes: list[PoolSize] = []

    def describe(self) -> list[Metric]:
        # Nothing up front: routers started in one process (tests) each register theirs.
        return []

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "pool", "state"]
        workers = GaugeMetricFamily(
            "splitserve_pool_workers", "the router's pool members by state", labels=labels
        )
        for pool in self._pools:
            # A worker that never answered counts under no model (""): its model is not known.
            models = {w.info.served_model_name for w in pool.workers if w.info is not None}
            counts = {(m, s): 0 for m in sorted(models) for s in WorkerState}
            for worker in pool.workers:
                model = worker.info.served_model_name if worker.info is not None else ""
                key = (model, _state(worker.routable, worker.draining))
                counts[key] = counts.get(key, 0) + 1
            for (model, state), count in counts.items():
                workers.add_metric([model, str(pool.role), state.value], count)
        yield workers
        yield from self._sizes()

    def _sizes(self) -> Iterator[Metric]:
        labels = ["model_name", "pool"]
        desired = GaugeMetricFamily(
            "splitserve_pool_desired_workers", "the orchestrator's target size", labels=labels
        )
        starting = GaugeMetricFamily(
            "splitserve_pool_starting_workers", "workers started, not yet healthy", labels=labels
        )
        restarts = CounterMetricFamily(
            "splitserve_pool_restarts",
            "workers that died and were replaced since the cluster started",
            labels=labels,
        )
        for size in self.sizes:
            values = [size.model, str(size.role)]
            desired.add_metric(values, size.desired_workers)
            starting.add_metric(values, size.num_starting)
            restarts.add_metric(values, size.num_restarts)
        yield from (desired, starting, restarts)


def _state(routable: bool, draining: bool) -> WorkerState:
    if draining:
        return WorkerState.DRAINING
    return WorkerState.READY if routable else WorkerState.UNHEALTHY


def register_pool_metrics(collector: PoolCollector) -> None:
    """Export ``collector`` on this process's ``/metrics``."""
    REGISTRY.register(collector)


def unregister_pool_metrics(collector: PoolCollector) -> None:
    """Stop exporting ``collector`` (its router stopped)."""
    REGISTRY.unregister(collector)
