"""Metrics and the Markdown report for ``bench_engine``.

Throughput counts generated tokens over generation wall time (model load excluded). TTFT is
measured from the common start of the run (all requests are submitted at once), so it
includes queueing. Output ids are compared per request between systems as a sanity check:
in float32 greedy ids should mostly agree; bf16 rounding makes them diverge after a while.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from itertools import combinations

from loadtest.bench.arm_protocol import ArmResult

REFERENCE_SYSTEM = "transformers"


@dataclass(frozen=True, slots=True)
class ArmRun:
    """One child process: its result (``None`` if it failed) and what the parent observed."""

    system: str
    result: ArmResult | None
    error: str | None
    process_wall_s: float
    process_cpu_s: float
    peak_tree_rss_mib: float
    wait4_maxrss_mib: float
    host_load_1m: tuple[float, float]


@dataclass(frozen=True, slots=True)
class SystemMetrics:
    """Summary figures of one successful arm."""

    system: str
    version: str
    output_tokens: int
    output_tokens_per_s: float
    output_tokens_per_cpu_s: float
    requests_per_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    gen_wall_s: float
    load_s: float
    process_wall_s: float
    process_cpu_s: float
    peak_tree_rss_mib: float
    maxrss_mib: float
    host_load_1m: tuple[float, float]


@dataclass(frozen=True, slots=True)
class PairMatch:
    """How often two systems produced identical greedy ids."""

    system_a: str
    system_b: str
    identical_fraction: float
    mean_prefix_fraction: float


def _percentile(values: list[float], fraction: float) -> float:
    if len(values) == 1:
        return values[0]
    cut_points = statistics.quantiles(values, n=100, method="inclusive")
    return cut_points[round(fraction * 100) - 1]


def system_metrics(run: ArmRun) -> SystemMetrics:
    """Derive the summary of a successful run (``run.result`` must not be ``None``)."""
    result = run.result
    if result is None:
        raise ValueError(f"{run.system} has no result")
    output_tokens = sum(len(ids) for ids in result.output_token_ids)
    return SystemMetrics(
        system=run.system,
        version=result.version,
        output_tokens=output_tokens,
        output_tokens_per_s=output_tokens / result.gen_wall_s,
        output_tokens_per_cpu_s=output_tokens / result.gen_cpu_s,
        requests_per_s=len(result.output_token_ids) / result.gen_wall_s,
        ttft_p50_s=_percentile(result.first_token_s, 0.5),
        ttft_p90_s=_percentile(result.first_token_s, 0.9),
        gen_wall_s=result.gen_wall_s,
        load_s=result.load_s,
        process_wall_s=run.process_wall_s,
        process_cpu_s=run.process_cpu_s,
        peak_tree_rss_mib=run.peak_tree_rss_mib,
        maxrss_mib=max(run.wait4_maxrss_mib, result.maxrss_mib),
        host_load_1m=run.host_load_1m,
    )


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def pair_match(a: ArmResult, b: ArmResult) -> PairMatch:
    """Per-request comparison of generated ids; both results cover the same prompts."""
    if len(a.output_token_ids) != len(b.output_token_ids):
        raise ValueError("results cover different prompt sets")
    identical = 0
    prefix_fractions: list[float] = []
    for ids_a, ids_b in zip(a.output_token_ids, b.output_token_ids, strict=True):
        identical += ids_a == ids_b
        longest = max(len(ids_a), len(ids_b), 1)
        prefix_fractions.append(_common_prefix(ids_a, ids_b) / longest)
    return PairMatch(
        system_a=a.system,
        system_b=b.system,
        identical_fraction=identical / len(a.output_token_ids),
        mean_prefix_fraction=statistics.fmean(prefix_fractions),
    )


def all_pair_matches(runs: list[ArmRun]) -> list[PairMatch]:
    results = [r.result for r in runs if r.result is not None]
    return [pair_match(a, b) for a, b in combinations(results, 2)]


def throughput_ratio(
    metrics: list[SystemMetrics], numerator: str, denominator: str
) -> float | None:
    by_system = {m.system: m for m in metrics}
    if numerator in by_system and denominator in by_system:
        return by_system[numerator].output_tokens_per_s / by_system[denominator].output_tokens_per_s
    return None


def _reference_match(system: str, matches: list[PairMatch]) -> str:
    if system == REFERENCE_SYSTEM:
        return "ref"
    for m in matches:
        if {m.system_a, m.system_b} == {system, REFERENCE_SYSTEM}:
            return f"{m.identical_fraction:.0%}"
    return "n/a"


def _system_row(run: ArmRun, matches: list[PairMatch]) -> str:
    if run.result is None:
        return f"| {run.system} | FAILED: {run.error} |" + " |" * 13
    m = system_metrics(run)
    load_start, load_end = m.host_load_1m
    return (
        f"| {m.system} | {m.version} | {m.output_tokens_per_s:.1f} "
        f"| {m.output_tokens_per_cpu_s:.1f} | {m.requests_per_s:.3f} "
        f"| {m.ttft_p50_s:.2f} | {m.ttft_p90_s:.2f} | {m.gen_wall_s:.1f} | {m.load_s:.1f} "
        f"| {m.process_wall_s:.1f} | {m.process_cpu_s:.0f} | {m.peak_tree_rss_mib:.0f} "
        f"| {m.maxrss_mib:.0f} | {_reference_match(m.system, matches)} "
        f"| {load_start:.1f} / {load_end:.1f} |"
    )


def markdown_report(header_lines: list[str], runs: list[ArmRun]) -> str:
    """Render the per-system table, the splitserve/vLLM ratio and the pairwise id matches."""
    metrics = [system_metrics(r) for r in runs if r.result is not None]
    matches = all_pair_matches(runs)
    lines = [
        *header_lines,
        "",
        "| system | version | output tok/s | output tok/CPU-s | req/s | TTFT p50 (s) "
        "| TTFT p90 (s) | gen wall (s) | load (s) | process wall (s) | process CPU (s) "
        "| peak RSS tree (MiB) "
        f"| max proc RSS (MiB) | ids == {REFERENCE_SYSTEM} | host load 1m start / end |",
        "|" + "---|" * 15,
        *(_system_row(run, matches) for run in runs),
        "",
    ]
    ratio = throughput_ratio(metrics, "splitserve", "vllm")
    lines.append(
        "splitserve / vLLM output tok/s: " + (f"{ratio:.2f}x" if ratio is not None else "n/a")
    )
    if matches:
        lines += [
            "",
            "| pair | identical greedy ids | mean common-prefix fraction |",
            "|---|---|---|",
        ]
        lines += [
            f"| {m.system_a} vs {m.system_b} | {m.identical_fraction:.0%} "
            f"| {m.mean_prefix_fraction:.0%} |"
            for m in matches
        ]
    return "\n".join(lines) + "\n"
