"""The experiments' verdicts: each target's ratio of the two arms at the same offered rate."""

from __future__ import annotations

import pytest

from loadtest.comparisons.experiments import EXPERIMENTS, compare, comparison_markdown
from loadtest.generator.metrics import RequestRecord, summarize
from loadtest.generator.report import RunResult
from loadtest.generator.sweep import LoadSpec


def stream(sent_s: float, ttft_s: float, gap_s: float, stalls: int) -> RequestRecord:
    """A 101-token stream: ``stalls`` gaps of 1 s, the others ``gap_s``."""
    times = [sent_s + ttft_s]
    for i in range(100):
        times.append(times[-1] + (1.0 if i < stalls else gap_s))
    return RequestRecord(sent_s, 64, times, [1] * len(times), end_s=times[-1])


def run(label: str, records: list[RequestRecord], spec: LoadSpec) -> RunResult:
    summary = summarize(records, spec.slo_ttft_ms, spec.slo_itl_ms, spec.slo_itl_percentile)
    return RunResult(label, 1.0, None, summary, records)


def test_disaggregation_verdicts():
    experiment = EXPERIMENTS["disaggregation"]
    spec = LoadSpec(
        "long-mixed", rates=(1.0,), slo_ttft_ms=10_000, slo_itl_ms=100, slo_itl_percentile=99
    )
    # Disaggregated: smooth streams. Colocated: same TTFT, half of them stall 3 times (1.5%).
    ours = [stream(i, 0.5, 0.03, 0) for i in range(10)]
    theirs = [stream(i, 0.5, 0.03, 3 if i % 2 else 0) for i in range(10)]
    runs = {
        experiment.arms[0].name: [run("rate 1/s", ours, spec)],
        experiment.arms[1].name: [run("rate 1/s", theirs, spec)],
    }
    rows = {row["metric"]: row for row in compare(experiment, runs)}
    itl = rows["itl_ms.p99"]
    assert itl["ratio"] == pytest.approx(30 / 1000) and itl["met"]
    goodput = rows["goodput_requests_per_s"]
    within = [
        round(arm_runs[0].summary.goodput_requests_per_s * arm_runs[0].summary.duration_s)
        for arm_runs in runs.values()
    ]
    assert within == [10, 5]  # the stalled ones miss the p99 ITL SLO
    assert goodput["ratio"] >= 2.0 and goodput["met"]  # the stalls also stretch the run
    text = comparison_markdown(experiment, "cmd", spec, runs, list(rows.values()))
    assert "p99 of each request's inter-token gaps <= 100 ms" in text
    assert text.count("| yes |") == 2


def test_prefix_routing_verdict_can_fail():
    experiment = EXPERIMENTS["prefix-routing"]
    spec = LoadSpec("shared-prefix", rates=(1.0,))
    ours = [stream(i, 0.4, 0.03, 0) for i in range(5)]
    theirs = [stream(i, 1.0, 0.03, 0) for i in range(5)]
    runs = {
        experiment.arms[0].name: [run("rate 1/s", ours, spec)],
        experiment.arms[1].name: [run("rate 1/s", theirs, spec)],
    }
    (row,) = compare(experiment, runs)
    assert row["metric"] == "ttft_ms.p50"
    assert row["ratio"] == pytest.approx(0.4) and not row["met"]


def test_a_target_both_arms_score_zero_on_shows_nothing():
    """No goodput in either arm (both saturated) is no verdict, not a met target."""
    experiment = EXPERIMENTS["disaggregation"]
    spec = LoadSpec("long-mixed", rates=(1.0,), slo_ttft_ms=100, slo_itl_ms=100)
    slow = [stream(i, 0.5, 0.03, 0) for i in range(4)]  # every TTFT misses its SLO
    runs = {arm.name: [run("rate 1/s", slow, spec)] for arm in experiment.arms}
    rows = {row["metric"]: row for row in compare(experiment, runs)}
    goodput = rows["goodput_requests_per_s"]
    assert goodput[experiment.arms[0].name] == goodput[experiment.arms[1].name] == 0
    assert goodput["met"] is None
    text = comparison_markdown(experiment, "cmd", spec, runs, list(rows.values()))
    assert "| goodput_requests_per_s | 0.00 | 0.00 | - | >= 1.3 | n/a |" in text
