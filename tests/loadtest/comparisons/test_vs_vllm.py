"""The vs-vllm experiment's verdicts: goodput and output tok/s over vLLM's per offered rate,
and the highest rate at which each arm still meets the SLOs, over vLLM's."""

from __future__ import annotations

from loadtest.comparisons.vs_vllm import (
    ARMS,
    comparison,
    highest_rate_meeting_slos,
    output_tokens_per_s,
)
from loadtest.generator.metrics import summarize
from loadtest.generator.report import RunResult
from loadtest.generator.sweep import LoadSpec
from tests.loadtest.comparisons.test_experiments import stream

SPEC = LoadSpec("chat", rates=(1.0, 2.0), slo_ttft_ms=2_000, slo_itl_ms=100, slo_itl_percentile=90)


def at_rate(rate: float, ttft_s: float, stalls: int) -> RunResult:
    records = [stream(i / rate, ttft_s, 0.05, stalls) for i in range(10)]
    summary = summarize(records, SPEC.slo_ttft_ms, SPEC.slo_itl_ms, SPEC.slo_itl_percentile)
    return RunResult(f"rate {rate:g}/s", rate, None, summary, records)


def test_ratios_against_vllm_and_the_rate_vllm_meets_the_slos_up_to():
    runs = {
        # vLLM meets the SLOs at 1/s, and misses TTFT on every request at 2/s.
        ARMS[0].name: [at_rate(1.0, 0.5, 0), at_rate(2.0, 3.0, 0)],
        ARMS[1].name: [at_rate(1.0, 0.2, 0), at_rate(2.0, 0.4, 0)],
        # Each stream stalls 20 times in 100 gaps: its p90 gap is 1 s, over the ITL SLO.
        ARMS[2].name: [at_rate(1.0, 0.2, 20), at_rate(2.0, 0.2, 20)],
        ARMS[3].name: [at_rate(1.0, 0.5, 0), at_rate(2.0, 0.5, 0)],
    }
    assert highest_rate_meeting_slos(runs[ARMS[0].name]) == 1.0
    markdown, summary = comparison(runs, SPEC, "cmd")
    assert summary["vllm_meets_slos_up_to"] == 1.0
    ratios = {(r["run"], r["arm"]): r["goodput_ratio"] for r in summary["ratios"]}
    assert ratios[("rate 1/s", ARMS[1].name)] > 1.0  # both meet the SLOs, ours ends sooner
    assert ratios[("rate 2/s", ARMS[1].name)] == float("inf")  # vLLM's goodput is 0
    assert ratios[("rate 1/s", ARMS[2].name)] == 0.0
    assert "- (vLLM 0)" in markdown and "Highest rate at which vLLM meets the SLOs: 1.0" in markdown
    # The rate each arm sustains under the SLOs, over vLLM's.
    assert summary["meets_slos_up_to"] == {
        ARMS[0].name: 1.0, ARMS[1].name: 2.0, ARMS[2].name: None, ARMS[3].name: 2.0
    }  # fmt: skip
    assert f"| {ARMS[1].name} | 2.0 | 2.00x |" in markdown
    assert f"| {ARMS[2].name} | none | - |" in markdown
    # 10 streams of 101 tokens, from the first send to the last token.
    run = runs[ARMS[1].name][0]
    end_s = max(r.end_s for r in run.records)
    assert output_tokens_per_s(run) == 1010 / (end_s - run.records[0].sent_s)
