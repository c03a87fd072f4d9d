"""Slow engine steps, read from a worker's Prometheus step-time histogram.

A worker's step-time histogram is any histogram family on its ``/metrics`` whose name has
``step`` in it and ends in ``_seconds`` (label sets summed). Two scrapes bracket a phase; the
steps it took are the difference. Steps longer than a bound are the steps above the largest
bucket edge at or below it: exact when the bound is an edge, else an upper bound on the count.
"""

from __future__ import annotations

import math
import urllib.request
from collections import defaultdict
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

SLOW_STEP_S = 0.25
_SCRAPE_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Buckets:
    """One histogram's cumulative counts by bucket upper edge (``math.inf`` last)."""

    name: str
    counts: dict[float, float]


@dataclass(frozen=True, slots=True)
class SlowSteps:
    """Steps of one histogram within a phase, and how many took longer than ``edge_s``."""

    histogram: str
    steps: int
    slow: int
    edge_s: float  # the largest bucket edge <= SLOW_STEP_S (0.0: none, every step counts)

    @property
    def exact(self) -> bool:
        """Whether ``slow`` counts exactly the steps over ``SLOW_STEP_S``."""
        return self.edge_s == SLOW_STEP_S


def step_histograms(metrics_text: str) -> dict[str, Buckets]:
    """The step-time histograms in a Prometheus text exposition, by name."""
    found = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.type != "histogram" or "step" not in family.name:
            continue
        if not family.name.endswith("_seconds"):
            continue
        counts: dict[float, float] = defaultdict(float)
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                counts[float(sample.labels["le"])] += sample.value
        found[family.name] = Buckets(family.name, dict(counts))
    return found


def scrape(metrics_url: str) -> dict[str, Buckets]:
    """``step_histograms`` of ``GET metrics_url``; blocking."""
    with urllib.request.urlopen(metrics_url, timeout=_SCRAPE_TIMEOUT_S) as response:
        return step_histograms(response.read().decode())


def slow_steps(before: Buckets | None, after: Buckets) -> SlowSteps:
    """The steps counted between two scrapes of one histogram (``before`` None: since the
    process started), and those over ``SLOW_STEP_S``."""
    earlier = before.counts if before is not None else {}
    counts = {edge: n - earlier.get(edge, 0.0) for edge, n in after.counts.items()}
    steps = counts.get(math.inf, 0.0)
    edge_s = max((edge for edge in counts if edge <= SLOW_STEP_S), default=0.0)
    within = counts.get(edge_s, 0.0)
    return SlowSteps(after.name, round(steps), round(steps - within), edge_s)
