"""The overhead verdict of ``loadtest.comparisons.vllm_engine_overhead`` from ``vllm bench
serve`` results: splitserve's TTFT difference and throughput ratio against each baseline."""

from __future__ import annotations

import argparse
from pathlib import Path

from loadtest.comparisons.vllm_engine_overhead import report


def _result(ttft_ms: float, tok_s: float) -> dict[str, float]:
    return {
        "median_ttft_ms": ttft_ms,
        "p99_ttft_ms": 2 * ttft_ms,
        "median_itl_ms": 50.0,
        "output_throughput": tok_s,
        "p99_itl_ms": 90.0,
    }


def test_overhead_against_each_baseline_present():
    results = {
        "vllm-serve": {"low": _result(100.0, 1.0), "saturation": _result(900.0, 200.0)},
        "splitserve-vllm": {"low": _result(103.5, 1.0), "saturation": _result(950.0, 196.0)},
    }
    args = argparse.Namespace(
        out=Path("out"), model="m", dtype="float32", low_prompts=16, saturation_prompts=64
    )
    table = report(results, args)
    assert "| vllm-serve | 100.0 | 200.0 | 50.0 | 200.0 | 900 | 90.0 |" in table
    assert (
        "splitserve against vllm-serve: TTFT p50 one request at a time +3.5 ms; output "
        "throughput at saturation -2.0%." in table
    )
    assert "vllm-serve-inproc" not in table
