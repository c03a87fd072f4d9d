"""The serving metrics users already alert on, under vLLM's names, in every process.

vLLM's ``vllm:*`` names are what existing dashboards, alerts and llm-d's endpoint picker read,
so each process exports them beside its own ``splitserve_*`` metrics, labelled ``model_name``
(the served name) and ``pool`` (``router``, ``prefill`` or ``decode``): one query per pool
shows where a request's time goes. Per-request histograms are observed once a request ends,
from timestamps the engine keeps (``RequestOutput``), never on the engine thread; the gauges
(running, waiting, KV usage) and the preemption count are read at scrape time from the
worker's load (``services.common.metrics``).

A worker whose engine keeps these metrics itself (vLLM: its own stat logger, fed by its engine
core) exports that engine's instead: vLLM's full set, computed as ``vllm serve`` computes it,
each sample labelled with the worker's ``pool`` and ``worker_id``. ``STANDARD_METRICS`` is the
one collector of every ``vllm:`` family of the process: a family appears once however many
sources have samples of it (workers of both engines in one process included), and
splitserve's own families only once observed (a vLLM worker never observes them, so its
exposition holds vLLM's alone).

What each pool measures:

- ``router``: the client's view. TTFT and E2E from receiving the request; ITL between streamed
  messages; prompt and generation tokens; finished requests by reason.
- ``prefill``: arrival at the worker until the first token (TTFT), queue time (until the
  scheduler gave it blocks), prefill time (admission until the first token), prefix-cache
  queries and hits in tokens.
- ``decode``: the same phases for the decode part, ITL between the engine's outputs, TPOT
  (decode time over the tokens it generated), generation tokens, finished requests by reason.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:  # the router imports this module and never torch (engine.outputs does)
    from engine.outputs import RequestOutput

_LABELS = ("model_name", "pool")
# From tens of milliseconds to minutes: a TTFT behind a long queue, a long generation's E2E.
_LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
_TOKEN_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
    2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 4000, 8000, 16000, 32000)
# splitserve's own families; exported through STANDARD_METRICS, never straight from REGISTRY
# (where vLLM's stat logger would unregister every "vllm:" metric it finds).
_OWN = CollectorRegistry(auto_describe=True)

TTFT = Histogram(
    "vllm:time_to_first_token_seconds",
    "from a request's arrival to its first token",
    _LABELS,
    buckets=_LATENCY_BUCKETS_S,
    registry=_OWN,
)
ITL = Histogram(
    "vllm:inter_token_latency_seconds",
    "time between two outputs of a request, per token",
    _LABELS,
    buckets=_TOKEN_LATENCY_BUCKETS_S,
    registry=_OWN,
)
TPOT = Histogram(
    "vllm:request_time_per_output_token_seconds",
    "a request's decode time over the tokens it generated after its first",
    _LABELS,
    buckets=_TOKEN_LATENCY_BUCKETS_S,
    registry=_OWN,
)
E2E = Histogram(
    "vllm:e2e_request_latency_seconds",
    "from a request's arrival to its last token",
    _LABELS,
    buckets=_LATENCY_BUCKETS_S,
    registry=_OWN,
)
QUEUE_TIME = Histogram(
    "vllm:request_queue_time_seconds",
    "from a request's arrival to the scheduler giving it KV blocks",
    _LABELS,
    buckets=_LATENCY_BUCKETS_S,
    registry=_OWN,
)
PREFILL_TIME = Histogram(
    "vllm:request_prefill_time_seconds",
    "from a request's admission to its first token",
    _LABELS,
    buckets=_LATENCY_BUCKETS_S,
    registry=_OWN,
)
DECODE_TIME = Histogram(
    "vllm:request_decode_time_seconds",
    "from a request's first token to its last",
    _LABELS,
    buckets=_LATENCY_BUCKETS_S,
    registry=_OWN,
)
PROMPT_TOKENS_HIST = Histogram(
    "vllm:request_prompt_tokens",
    "prompt tokens of a finished request",
    _LABELS,
    buckets=_TOKEN_BUCKETS,
    registry=_OWN,
)
GENERATION_TOKENS_HIST = Histogram(
    "vllm:request_generation_tokens",
    "tokens a finished request generated",
    _LABELS,
    buckets=_TOKEN_BUCKETS,
    registry=_OWN,
)
PROMPT_TOKENS = Counter(
    "vllm:prompt_tokens", "prompt tokens of finished requests", _LABELS, registry=_OWN
)
GENERATION_TOKENS = Counter("vllm:generation_tokens", "tokens generated", _LABELS, registry=_OWN)
REQUEST_SUCCESS = Counter(
    "vllm:request_success",
    "finished requests by finish reason (stop, length, abort, error)",
    (*_LABELS, "finished_reason"),
    registry=_OWN,
)
PREFIX_CACHE_QUERIES = Counter(
    "vllm:prefix_cache_queries",
    "prompt tokens looked up in the prefix cache",
    _LABELS,
    registry=_OWN,
)
PREFIX_CACHE_HITS = Counter(
    "vllm:prefix_cache_hits",
    "prompt tokens found in the prefix cache",
    _LABELS,
    registry=_OWN,
)


class ServingMetrics:
    """The standard metrics of one process, bound to its ``model_name`` and ``pool``."""

    def __init__(self, model_name: str, pool: str) -> None:
        labels = self._labels = (model_name, pool)
        self.ttft, self.itl, self.tpot, self.e2e = _bind(labels, TTFT, ITL, TPOT, E2E)
        self.queue_time, self.prefill_time, self.decode_time = _bind(
            labels, QUEUE_TIME, PREFILL_TIME, DECODE_TIME
        )
        self.prompt_tokens_hist, self.generation_tokens_hist = _bind(
            labels, PROMPT_TOKENS_HIST, GENERATION_TOKENS_HIST
        )
        self.prompt_tokens, self.generation_tokens = _bind(labels, PROMPT_TOKENS, GENERATION_TOKENS)
        self.prefix_cache_queries, self.prefix_cache_hits = _bind(
            labels, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS
        )

    def tokens_streamed(self, num_tokens: int, gap_s: float | None) -> None:
        """``num_tokens`` were output ``gap_s`` after the request's previous output (None: its
        first output, which has no gap)."""
        self.generation_tokens.inc(num_tokens)
        if gap_s is not None and num_tokens:
            for _ in range(num_tokens):
                self.itl.observe(gap_s / num_tokens)

    def finished(self, finish_reason: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """A request ended with ``finish_reason`` (``stop``, ``length``, ``abort``, ``error``)."""
        REQUEST_SUCCESS.labels(*self._labels, finish_reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.prompt_tokens_hist.observe(num_prompt_tokens)
        self.generation_tokens_hist.observe(num_output_tokens)

    def engine_request_finished(self, final: RequestOutput, num_generated_tokens: int) -> None:
        """A worker's request ended: its engine phases, from ``final``'s stamps (a request
        aborted while queued has no phases), and its prefix-cache lookups."""
        now_s = time.perf_counter()
        num_prompt_tokens = len(final.prompt_token_ids)
        self.finished(final.finish_reason or "abort", num_prompt_tokens, num_generated_tokens)
        self.e2e.observe(now_s - final.arrival_time_s)
        scheduled_s, first_token_s = final.scheduled_time_s, final.first_token_time_s
        if scheduled_s is None:
            return
        self.queue_time.observe(scheduled_s - final.arrival_time_s)
        self.prefix_cache_queries.inc(num_prompt_tokens)
        self.prefix_cache_hits.inc(final.num_cached_tokens)
        if first_token_s is None:
            return
        self.ttft.observe(first_token_s - final.arrival_time_s)
        self.prefill_time.observe(first_token_s - scheduled_s)
        self.decode_time.observe(now_s - first_token_s)
        if num_generated_tokens > 1:
            self.tpot.observe((now_s - first_token_s) / (num_generated_tokens - 1))


_Metric = TypeVar("_Metric", Counter, Histogram)


def _bind(labels: tuple[str, str], *metrics: _Metric) -> tuple[_Metric, ...]:
    """Each of ``metrics``' child for ``labels`` (model name, pool), in order."""
    return tuple(metric.labels(*labels) for metric in metrics)


class StandardMetrics(Collector):
    """Every ``vllm:`` family of this process, merged by name: splitserve's own (those with
    samples) and each worker's source added by ``add_source``, whose samples gain
    their worker's labels. Registered once in ``REGISTRY``; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: dict[int, tuple[Collector, dict[str, str]]] = {}
        self._keys = itertools.count()

    def describe(self) -> list[Metric]:
        """None: the families come and go with the workers (and are merged here, so no two
        collectors of ``REGISTRY`` can clash on them)."""
        return []

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            sources = [(_OWN, {}), *self._sources.values()]
        merged: dict[str, Metric] = {}
        for source, labels in sources:
            for family in source.collect():
                if not family.samples:
                    continue
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                into.samples += [
                    sample._replace(labels={**sample.labels, **labels}) for sample in family.samples
                ]
        yield from merged.values()

    def add_source(self, source: Collector, labels: dict[str, str]) -> int:
        """Export ``source``'s families with ``labels`` on every sample until
        ``remove_source`` of the returned key."""
        with self._lock:
            key = next(self._keys)
            self._sources[key] = (source, labels)
            return key

    def remove_source(self, key: int) -> None:
        with self._lock:
            self._sources.pop(key, None)


STANDARD_METRICS = StandardMetrics()
REGISTRY.register(STANDARD_METRICS)
