"""A loadtest's reports: ``results.json``, ``report.md`` and PNG plots in one directory.

Each run of ``results.json`` holds its ``summary`` (``loadtest.generator.metrics.Summary``),
``vllm bench serve``'s keys next to it (``vllm_bench_metrics``:
``results["runs"][0]["mean_ttft_ms"]``), and every request.

Plots: latency CDFs (TTFT, ITL, E2E) with one curve per run, and, across runs at different
offered rates, goodput and p99 ITL against the offered rate.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.generator.metrics import RequestRecord, Summary, vllm_bench_metrics


@dataclass(frozen=True, slots=True)
class RunResult:
    """One run: its label (e.g. ``rate 4/s``), offered load, summary and every request."""

    label: str
    offered_rate_per_s: float | None
    concurrency: int | None
    summary: Summary
    records: list[RequestRecord]


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _json_summary(summary: Summary) -> dict[str, Any]:
    data = dataclasses.asdict(summary)
    for key, value in data.items():
        if isinstance(value, dict) and key.endswith("_ms"):
            data[key] = {q: _finite(v) for q, v in value.items()}
    return data


def write_reports(out_dir: Path, config: dict[str, Any], runs: Sequence[RunResult]) -> list[Path]:
    """Write the three kinds of report; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "config": config,
        "runs": [
            {
                "label": run.label,
                "offered_rate_per_s": run.offered_rate_per_s,
                "concurrency": run.concurrency,
                "summary": _json_summary(run.summary),
                **vllm_bench_metrics(run.records, run.summary.duration_s),
                "requests": [dataclasses.asdict(r) for r in run.records],
            }
            for run in runs
        ],
    }
    paths = [out_dir / "results.json", out_dir / "report.md"]
    paths[0].write_text(json.dumps(results, indent=1) + "\n")
    paths[1].write_text(markdown(config, runs))
    paths += _plots(out_dir, runs)
    return paths


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def markdown(config: dict[str, Any], runs: Sequence[RunResult]) -> str:
    slo = runs[0].summary if runs else None
    lines = [
        "# splitserve loadtest",
        "",
        f"Command: `{config['command']}`",
        "",
        f"Target `{config['target']}` ({config.get('backend', 'grpc')}), "
        f"workload `{config['workload']}`, seed {config['seed']}; "
        f"SLOs: TTFT <= {_fmt(slo.slo_ttft_ms if slo else None, 0)} ms, "
        f"p{_fmt(slo.slo_itl_percentile if slo else None, 0)} ITL per request <= "
        f"{_fmt(slo.slo_itl_ms if slo else None, 0)} ms.",
        "",
        "| run | sent | done | errors | req/s | out tok/s | goodput req/s | prefix hits "
        "| TTFT p50/p90/p99 ms | TPOT p50/p99 ms | ITL p50/p99 ms | E2E p50/p99 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        s = run.summary
        errors = ", ".join(f"{k} {v}" for k, v in s.errors.items()) or "0"
        lines.append(
            f"| {run.label} | {s.num_sent} | {s.num_completed} | {errors} "
            f"| {_fmt(s.requests_per_s, 2)} | {_fmt(s.output_tokens_per_s)} "
            f"| {_fmt(s.goodput_requests_per_s, 2)} | {s.prefix_hit_rate:.1%} "
            f"| {_fmt(s.ttft_ms['p50'])} / {_fmt(s.ttft_ms['p90'])} / {_fmt(s.ttft_ms['p99'])} "
            f"| {_fmt(s.tpot_ms['p50'])} / {_fmt(s.tpot_ms['p99'])} "
            f"| {_fmt(s.itl_ms['p50'])} / {_fmt(s.itl_ms['p99'])} "
            f"| {_fmt(s.e2e_ms['p50'])} / {_fmt(s.e2e_ms['p99'])} |"
        )
    lines += ["", "Plots: `latency_cdf.png`, `rate_sweep.png`.", ""]
    return "\n".join(lines)


def _cdf(axis: Any, values_ms: list[float], label: str) -> None:
    if not values_ms:
        return
    ordered = sorted(values_ms)
    n = len(ordered)
    axis.plot(ordered, [(i + 1) / n for i in range(n)], label=label)


def _plots(out_dir: Path, runs: Sequence[RunResult]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for run in runs:
        done = [r for r in run.records if r.ok]
        _cdf(axes[0], [r.ttft_s * 1000 for r in done if r.ttft_s is not None], run.label)
        _cdf(axes[1], [g * 1000 for r in done for g in r.itl_s()], run.label)
        _cdf(axes[2], [r.e2e_s * 1000 for r in done if r.e2e_s is not None], run.label)
    for axis, title in zip(
        axes, ("TTFT", "inter-token latency", "end-to-end latency"), strict=True
    ):
        axis.set_title(title)
        axis.set_xlabel("ms")
        axis.set_ylabel(
            "fraction of requests" if title != "inter-token latency" else "fraction of tokens"
        )
        axis.set_xscale("log")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    cdf_path = out_dir / "latency_cdf.png"
    fig.savefig(cdf_path, dpi=110)
    plt.close(fig)

    fig, (goodput_axis, itl_axis) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = [run.offered_rate_per_s or run.summary.requests_per_s for run in runs]
    goodput_axis.plot(
        x, [run.summary.goodput_requests_per_s for run in runs], "o-", label="goodput"
    )
    goodput_axis.plot(x, [run.summary.requests_per_s for run in runs], "s--", label="throughput")
    goodput_axis.set_title("goodput vs offered rate")
    goodput_axis.set_ylabel("requests/s")
    itl_axis.plot(x, [_finite(run.summary.itl_ms["p99"]) for run in runs], "o-")
    itl_axis.set_title("p99 inter-token latency vs offered rate")
    itl_axis.set_ylabel("ms")
    for axis in (goodput_axis, itl_axis):
        axis.set_xlabel("offered rate (requests/s)")
        axis.grid(True, alpha=0.3)
    goodput_axis.legend(fontsize=8)
    fig.tight_layout()
    sweep_path = out_dir / "rate_sweep.png"
    fig.savefig(sweep_path, dpi=110)
    plt.close(fig)
    return [cdf_path, sweep_path]
