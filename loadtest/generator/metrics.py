"""What one loadtest run measured, from per-request timestamps.

Definitions (times in seconds, measured by the client):

- TTFT: from sending the request to its first token.
- ITL: the gaps between successive token arrivals of a request; a message carrying n tokens
  counts as n gaps of (its gap / n).
- TPOT: (E2E - TTFT) / (output tokens - 1), per request with at least two tokens.
- E2E: from sending to the last message.
- Throughput: completed requests and output tokens per second of the run's wall time (first
  send to last completion).
- Prefix hit rate: prompt tokens served from a prefix cache over all prompt tokens, completed
  requests.
- Goodput: completed requests per second that met both SLOs: TTFT <= ``slo_ttft_ms`` and the
  ``slo_itl_percentile`` (default 90) of their own ITL <= ``slo_itl_ms``. At 90 a request
  misses it when more than a tenth of its gaps are slow; at 99, when a stream of a few hundred
  tokens stalls more than once or twice (as when long prefills join its decode batch).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from services.cluster.planner import percentile as nearest_rank

PERCENTILES = (50, 90, 99)
DEFAULT_SLO_ITL_PERCENTILE = 90.0


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, ``q`` in [0, 100]; NaN for no values."""
    value = nearest_rank(values, q / 100)
    return math.nan if value is None else value


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it. ``token_times_s`` has one entry per message with
    tokens (absolute times) and ``token_counts`` how many tokens each carried."""

    sent_s: float
    prompt_tokens: int
    token_times_s: list[float] = field(default_factory=list)
    token_counts: list[int] = field(default_factory=list)
    end_s: float | None = None
    error: str | None = None  # the gRPC status name when it failed
    cached_tokens: int = 0  # prompt tokens served from a prefix cache (the router's usage)

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None

    @property
    def output_tokens(self) -> int:
        return sum(self.token_counts)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.sent_s if self.token_times_s else None

    @property
    def e2e_s(self) -> float | None:
        return self.end_s - self.sent_s if self.end_s is not None else None

    def itl_s(self) -> list[float]:
        gaps: list[float] = []
        for prev_s, now_s, count in zip(
            self.token_times_s, self.token_times_s[1:], self.token_counts[1:], strict=False
        ):
            gaps.extend([(now_s - prev_s) / count] * count)
        return gaps

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def meets(
        self,
        slo_ttft_ms: float | None,
        slo_itl_ms: float | None,
        slo_itl_percentile: float = DEFAULT_SLO_ITL_PERCENTILE,
    ) -> bool:
        """Completed within both SLOs (an unset SLO always holds)."""
        if not self.ok or self.ttft_s is None:
            return False
        if slo_ttft_ms is not None and self.ttft_s * 1000 > slo_ttft_ms:
            return False
        gaps = self.itl_s()
        if slo_itl_ms is None or not gaps:
            return True
        return percentile(gaps, slo_itl_percentile) * 1000 <= slo_itl_ms


@dataclass(frozen=True, slots=True)
class Summary:
    """Aggregates of one run; latencies in milliseconds as {"p50": ..., "p90": ..., "p99": ...}."""

    num_sent: int
    num_completed: int
    errors: dict[str, int]
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    goodput_requests_per_s: float
    prefix_hit_rate: float
    slo_ttft_ms: float | None
    slo_itl_ms: float | None
    slo_itl_percentile: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]


def _stats_ms(values_s: Sequence[float]) -> dict[str, float]:
    return {f"p{q}": percentile(values_s, q) * 1000 for q in PERCENTILES}


def summarize(
    records: Sequence[RequestRecord],
    slo_ttft_ms: float | None,
    slo_itl_ms: float | None,
    slo_itl_percentile: float = DEFAULT_SLO_ITL_PERCENTILE,
) -> Summary:
    """Aggregate ``records`` (every request sent, completed or failed)."""
    done = [r for r in records if r.ok]
    errors = Counter(r.error for r in records if r.error is not None)
    starts = [r.sent_s for r in records]
    ends = [r.end_s for r in records if r.end_s is not None]
    duration_s = max(ends) - min(starts) if ends and starts else 0.0
    rate = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    return Summary(
        num_sent=len(records),
        num_completed=len(done),
        errors=dict(sorted(errors.items())),
        duration_s=duration_s,
        requests_per_s=rate(len(done)),
        output_tokens_per_s=rate(sum(r.output_tokens for r in done)),
        goodput_requests_per_s=rate(
            sum(r.meets(slo_ttft_ms, slo_itl_ms, slo_itl_percentile) for r in done)
        ),
        prefix_hit_rate=(
            sum(r.cached_tokens for r in done) / prompt_tokens if prompt_tokens else 0.0
        ),
        slo_ttft_ms=slo_ttft_ms,
        slo_itl_ms=slo_itl_ms,
        slo_itl_percentile=slo_itl_percentile,
        ttft_ms=_stats_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot_ms=_stats_ms([r.tpot_s for r in done if r.tpot_s is not None]),
        itl_ms=_stats_ms([gap for r in done for gap in r.itl_s()]),
        e2e_ms=_stats_ms([r.e2e_s for r in done if r.e2e_s is not None]),
    )


def vllm_bench_metrics(records: Sequence[RequestRecord], duration_s: float) -> dict[str, float]:
    """The keys of ``vllm bench serve``'s result for ``records``, a run of ``duration_s``:
    ``completed``, ``total_input_tokens`` and ``total_output_tokens`` (completed requests),
    ``request_throughput``, ``output_throughput``, ``total_token_throughput`` (per second) and,
    for each of ttft, tpot, itl and e2el, ``mean_X_ms``, ``median_X_ms``, ``std_X_ms`` and
    ``pQ_X_ms`` for Q in ``PERCENTILES``, as numpy computes them (population std, linearly
    interpolated percentiles). As in vLLM, statistics of no values are 0, and a request's TPOT
    counts only with two or more output tokens; unlike vLLM's, ITL counts a message of n tokens
    as n gaps, as ``Summary`` does."""
    done = [r for r in records if r.ok]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    per_s = 1 / duration_s if duration_s > 0 else 0.0
    metrics: dict[str, float] = {
        "duration": duration_s,
        "completed": len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) * per_s,
        "output_throughput": output_tokens * per_s,
        "total_token_throughput": (input_tokens + output_tokens) * per_s,
    }
    series = {
        "ttft": [r.ttft_s for r in done if r.ttft_s is not None],
        "tpot": [r.tpot_s for r in done if r.tpot_s is not None],
        "itl": [gap for r in done for gap in r.itl_s()],
        "e2el": [r.e2e_s for r in done if r.e2e_s is not None],
    }
    for name, values_s in series.items():
        values_ms = np.asarray(values_s or [0.0], dtype=np.float64) * 1000
        metrics[f"mean_{name}_ms"] = float(np.mean(values_ms))
        metrics[f"median_{name}_ms"] = float(np.median(values_ms))
        metrics[f"std_{name}_ms"] = float(np.std(values_ms))
        for q in PERCENTILES:
            metrics[f"p{q}_{name}_ms"] = float(np.percentile(values_ms, q))
    return metrics
