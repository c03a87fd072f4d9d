"""Loadtest metrics against hand-computed examples."""

from __future__ import annotations

import math

import pytest

from loadtest.generator.metrics import RequestRecord, percentile, summarize, vllm_bench_metrics


def records() -> list[RequestRecord]:
    return [
        # TTFT 0.5; gaps 0.1, then a 2-token message 0.2 later: 0.1, 0.1; TPOT 0.3 / 3.
        RequestRecord(0.0, 10, [0.5, 0.6, 0.8], [1, 1, 2], end_s=0.8, cached_tokens=8),
        # TTFT 0.2; one gap of 1.0 (a stall); TPOT 1.0.
        RequestRecord(1.0, 20, [1.2, 2.2], [1, 1], end_s=2.2),
        RequestRecord(1.5, 30, error="UNAVAILABLE", cached_tokens=16),
        # One token: TTFT 0.1, no gap, no TPOT.
        RequestRecord(2.0, 40, [2.1], [1], end_s=2.1),
    ]


def test_per_request_latencies():
    r1, r2, _, r4 = records()
    assert r1.ttft_s == 0.5 and r1.e2e_s == 0.8 and r1.output_tokens == 4
    assert r1.itl_s() == pytest.approx([0.1, 0.1, 0.1])
    assert r1.tpot_s == pytest.approx(0.1)
    assert r2.itl_s() == pytest.approx([1.0]) and r2.tpot_s == pytest.approx(1.0)
    assert r4.itl_s() == [] and r4.tpot_s is None


def test_summary_counts_rates_and_percentiles():
    summary = summarize(records(), slo_ttft_ms=300, slo_itl_ms=500)
    assert (summary.num_sent, summary.num_completed) == (4, 3)
    assert summary.errors == {"UNAVAILABLE": 1}
    assert summary.num_completed + sum(summary.errors.values()) == summary.num_sent
    assert summary.duration_s == pytest.approx(2.2)
    assert summary.requests_per_s == pytest.approx(3 / 2.2)
    assert summary.output_tokens_per_s == pytest.approx(7 / 2.2)
    assert summary.prefix_hit_rate == pytest.approx(8 / 70)  # the failed request is left out
    # r1 misses TTFT (500 > 300 ms), r2 misses ITL (its p90 gap is the 1 s stall), r4 meets.
    assert summary.goodput_requests_per_s == pytest.approx(1 / 2.2)
    assert summary.ttft_ms == pytest.approx({"p50": 200, "p90": 500, "p99": 500})
    assert summary.itl_ms == pytest.approx({"p50": 100, "p90": 1000, "p99": 1000})
    assert summary.tpot_ms == pytest.approx({"p50": 100, "p90": 1000, "p99": 1000})
    assert summary.e2e_ms == pytest.approx({"p50": 800, "p90": 1200, "p99": 1200})


def test_unset_slos_always_hold_and_empty_runs_are_nan():
    summary = summarize(records(), slo_ttft_ms=None, slo_itl_ms=None)
    assert summary.goodput_requests_per_s == pytest.approx(3 / 2.2)
    empty = summarize([RequestRecord(0.0, 5, error="DEADLINE_EXCEEDED")], None, None)
    assert empty.num_completed == 0 and empty.requests_per_s == 0.0
    assert math.isnan(empty.ttft_ms["p50"])


def test_nearest_rank_percentile():
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 90), percentile(values, 99)) == (
        50.0,
        90.0,
        99.0,
    )
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_itl_slo_percentile_decides_how_many_stalls_a_request_may_have():
    # 20 gaps of 50 ms and 2 stalls of 400 ms: p90 (18th of 20) is fine, p99 (20th) is not.
    times = [0.0]
    for gap in [0.05] * 9 + [0.4] + [0.05] * 9 + [0.4]:
        times.append(times[-1] + gap)
    stalled = RequestRecord(0.0, 8, times, [1] * len(times), end_s=times[-1])
    assert stalled.meets(None, 100, slo_itl_percentile=90)
    assert not stalled.meets(None, 100, slo_itl_percentile=99)
    assert summarize([stalled], None, 100, slo_itl_percentile=99).goodput_requests_per_s == 0


def test_vllm_bench_metrics_by_hand():
    m = vllm_bench_metrics(records(), duration_s=2.2)
    assert (m["completed"], m["total_input_tokens"], m["total_output_tokens"]) == (3, 70, 7)
    assert m["duration"] == 2.2
    assert m["request_throughput"] == pytest.approx(3 / 2.2)
    assert m["output_throughput"] == pytest.approx(7 / 2.2)
    assert m["total_token_throughput"] == pytest.approx(77 / 2.2)
    # TTFT 500, 200, 100 ms; percentiles interpolate linearly between the sorted values.
    assert m["mean_ttft_ms"] == pytest.approx(800 / 3)
    assert m["median_ttft_ms"] == pytest.approx(200)
    mean = 800 / 3
    std = math.sqrt(((500 - mean) ** 2 + (200 - mean) ** 2 + (100 - mean) ** 2) / 3)
    assert m["std_ttft_ms"] == pytest.approx(std)
    assert m["p50_ttft_ms"] == pytest.approx(200)
    assert m["p90_ttft_ms"] == pytest.approx(200 + 0.8 * 300)
    assert m["p99_ttft_ms"] == pytest.approx(200 + 0.98 * 300)
    # TPOT 100 and 1000 ms (the one-token request has none).
    assert (m["mean_tpot_ms"], m["median_tpot_ms"], m["std_tpot_ms"]) == pytest.approx(
        (550, 550, 450)
    )
    assert m["p99_tpot_ms"] == pytest.approx(100 + 0.99 * 900)
    # ITL 100, 100, 100 (the 2-token message: two gaps) and 1000 ms.
    assert (m["mean_itl_ms"], m["median_itl_ms"]) == pytest.approx((325, 100))
    assert m["std_itl_ms"] == pytest.approx(math.sqrt((3 * 225**2 + 675**2) / 4))
    assert m["p90_itl_ms"] == pytest.approx(100 + 0.7 * 900)
    assert m["p99_itl_ms"] == pytest.approx(100 + 0.97 * 900)
    # E2E 800, 1200, 100 ms.
    assert (m["mean_e2el_ms"], m["median_e2el_ms"]) == pytest.approx((700, 800))
    assert m["p99_e2el_ms"] == pytest.approx(800 + 0.98 * 400)


def test_vllm_bench_metrics_of_no_completed_request_are_zero():
    m = vllm_bench_metrics([RequestRecord(0.0, 5, error="HTTP 500")], duration_s=0.0)
    assert m["completed"] == 0 and m["request_throughput"] == 0.0
    assert m["mean_ttft_ms"] == m["p99_itl_ms"] == m["std_e2el_ms"] == 0.0
