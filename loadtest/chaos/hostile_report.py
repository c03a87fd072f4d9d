"""What ``python -m loadtest.chaos --hostile`` measured, its targets, and their Markdown.

The targets (issue 37's acceptance), judged on the hostile phase against the baseline:

- the router's peak RSS under ``ROUTER_RSS_LIMIT_BYTES``;
- every well-behaved request completes (in both phases);
- the well-behaved TTFT p99 within ``TTFT_P99_RATIO_LIMIT`` times the baseline's;
- no engine step longer than 250 ms on any worker, from the workers' step-time histogram
  (``loadtest.bench.step_histogram``): ``unmeasured`` when the workers export none.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from loadtest.bench.step_histogram import SLOW_STEP_S, SlowSteps
from loadtest.chaos.hostile_clients import KindSummary, Outcome

ROUTER_RSS_LIMIT_BYTES = 500 * 10**6
TTFT_P99_RATIO_LIMIT = 1.5
_MB = 10**6


class PhaseName(enum.Enum):
    BASELINE = "baseline"  # the well-behaved load alone
    HOSTILE = "hostile"  # the same load beside the hostile connections


class Verdict(enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    UNMEASURED = "unmeasured"


@dataclass(frozen=True, slots=True)
class WellBehaved:
    """The well-behaved requests of one phase as their client saw them (latencies in ms,
    over completed requests; ITL gaps over ``SLOW_STEP_S`` are the client's view of a stall)."""

    sent: int
    completed: int
    errors: dict[str, int]
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    itl_max_ms: float
    slow_itl_gaps: int
    # The slowest first tokens, slowest first: (TTFT ms, when sent, s into the phase).
    slowest_ttft: list[tuple[float, float]]


@dataclass(frozen=True, slots=True)
class Phase:
    """One phase: its load, each process's peak RSS and CPU seconds (user + system; the
    clients' processes too: they share the host's cores), each worker's step histograms (empty
    when it exports none) and, in the hostile phase, how the hostile attempts ended."""

    name: PhaseName
    duration_s: float
    load: WellBehaved
    peak_rss_bytes: dict[str, int]
    cpu_s: dict[str, float]
    engine_steps: dict[str, list[SlowSteps]]
    hostile: dict[str, KindSummary] | None


@dataclass(frozen=True, slots=True)
class TargetResult:
    name: str
    value: str
    verdict: Verdict


def targets(baseline: Phase, hostile: Phase) -> list[TargetResult]:
    """The acceptance targets, judged on ``hostile`` against ``baseline``."""
    router_rss = max(
        (rss for key, rss in hostile.peak_rss_bytes.items() if key.startswith("router@")),
        default=0,
    )
    complete = [f"{p.name.value} {p.load.completed}/{p.load.sent}" for p in (baseline, hostile)]
    base_p99, hostile_p99 = baseline.load.ttft_ms["p99"], hostile.load.ttft_ms["p99"]
    ratio = hostile_p99 / base_p99 if base_p99 > 0 else math.nan
    return [
        TargetResult(
            f"router peak RSS < {ROUTER_RSS_LIMIT_BYTES // _MB} MB",
            f"{router_rss / _MB:.0f} MB",
            _verdict(router_rss < ROUTER_RSS_LIMIT_BYTES),
        ),
        TargetResult(
            "every well-behaved request completes",
            ", ".join(complete),
            _verdict(all(p.load.completed == p.load.sent for p in (baseline, hostile))),
        ),
        TargetResult(
            f"TTFT p99 <= {TTFT_P99_RATIO_LIMIT}x baseline",
            f"{_num(ratio, '.2f')}{'' if math.isnan(ratio) else 'x'} "
            f"({_num(hostile_p99, '.0f')} ms vs {_num(base_p99, '.0f')} ms)",
            _verdict(ratio <= TTFT_P99_RATIO_LIMIT),
        ),
        _step_target(hostile),
    ]


def _num(value: float, spec: str) -> str:
    """``value`` formatted, ``-`` for NaN (a statistic of no completed request)."""
    return "-" if math.isnan(value) else format(value, spec)


def _verdict(ok: bool) -> Verdict:
    return Verdict.PASS if ok else Verdict.FAIL


def _step_target(hostile: Phase) -> TargetResult:
    name = f"no engine step > {SLOW_STEP_S * 1000:.0f} ms"
    counts = [s for steps in hostile.engine_steps.values() for s in steps]
    if not counts:
        return TargetResult(name, "the workers export no step-time histogram", Verdict.UNMEASURED)
    slow = sum(s.slow for s in counts)
    inexact = sorted({s.edge_s for s in counts if not s.exact})
    value = f"{slow} of {sum(s.steps for s in counts)} steps"
    if inexact:
        value += f" (no bucket edge at {SLOW_STEP_S} s: counted over {inexact} s)"
    return TargetResult(name, value, _verdict(slow == 0))


def markdown(phases: Sequence[Phase], results: list[TargetResult], rate: float) -> str:
    """The whole report: load, RSS, engine steps, hostile connections, targets."""
    lines = [
        f"### Well-behaved load ({rate:g} req/s, streamed chat)",
        "",
        "| phase | s | sent | completed | errors | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
        "| ITL p99 ms | ITL max ms | ITL gaps > 250 ms |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in phases:
        w = p.load
        errors = ", ".join(f"{n} {e}" for e, n in sorted(w.errors.items())) or "0"
        lines.append(
            f"| {p.name.value} | {p.duration_s:.0f} | {w.sent} | {w.completed} | {errors} "
            f"| {_num(w.ttft_ms['p50'], '.0f')} | {_num(w.ttft_ms['p99'], '.0f')} "
            f"| {_num(w.itl_ms['p50'], '.1f')} | {_num(w.itl_ms['p99'], '.1f')} "
            f"| {w.itl_max_ms:.0f} | {w.slow_itl_gaps} |"
        )
    lines += ["", "Slowest first tokens (TTFT ms @ s into the phase when sent):", ""]
    lines += [
        f"- {p.name.value}: "
        + ", ".join(f"{ms:.0f} @ {at_s:.0f}" for ms, at_s in p.load.slowest_ttft)
        for p in phases
    ]
    rss_mb = [{k: v / _MB for k, v in p.peak_rss_bytes.items()} for p in phases]
    lines += _process_table("Peak RSS (MB)", phases, rss_mb, ".0f")
    lines += _process_table(
        "CPU seconds (user + system) over the phase", phases, [p.cpu_s for p in phases], ".1f"
    )
    lines += ["", "### Engine steps (the workers' step-time histograms)", ""]
    if not any(p.engine_steps for p in phases):
        lines.append("The workers export no step-time histogram: unmeasured.")
    else:
        lines += [
            "| phase | worker | histogram | steps | slow (> edge) | edge s |",
            "|---|---|---|---:|---:|---:|",
        ]
        for p in phases:
            for worker, steps in sorted(p.engine_steps.items()):
                lines += [
                    f"| {p.name.value} | {worker} | {s.histogram} | {s.steps} | {s.slow} "
                    f"| {s.edge_s:g} |"
                    for s in steps
                ]
    hostile = next((p.hostile for p in phases if p.hostile is not None), None)
    if hostile is not None:
        lines += ["", "### Hostile connections", "", _hostile_header(), _hostile_rule()]
        for kind, summary in hostile.items():
            outcomes = " | ".join(str(summary.outcomes.get(o.value, 0)) for o in Outcome)
            statuses = ", ".join(f"{n}x {s}" for s, n in sorted(summary.statuses.items())) or "-"
            lines.append(
                f"| {kind} | {summary.connections} | {summary.attempts} | {outcomes} "
                f"| {statuses} | {summary.mean_open_s:.1f} |"
            )
    lines += ["", "### Targets", "", "| target | value | verdict |", "|---|---|---|"]
    lines += [f"| {r.name} | {r.value} | {r.verdict.value.upper()} |" for r in results]
    return "\n".join(lines)


def _hostile_header() -> str:
    outcomes = " | ".join(o.value for o in Outcome)
    return f"| kind | connections | attempts | {outcomes} | HTTP statuses | mean open s |"


def _hostile_rule() -> str:
    return "|---|---:|---:|" + "---:|" * len(Outcome) + "---|---:|"


def _process_table(
    title: str, phases: Sequence[Phase], values: Sequence[dict[str, float]], spec: str
) -> list[str]:
    """A Markdown table of one figure per process (rows) and phase (columns, ``values[i]``
    for ``phases[i]``; 0 where a process has none)."""
    names = " | ".join(p.name.value for p in phases)
    lines = ["", f"### {title}", "", f"| process | {names} |", "|---|" + "---:|" * len(phases)]
    for key in sorted({k for v in values for k in v}):
        cells = " | ".join(f"{v.get(key, 0.0):{spec}}" for v in values)
        lines.append(f"| {key} | {cells} |")
    return lines
