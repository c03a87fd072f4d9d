"""``loadtest.bench.mock_profile``'s fit recovers the costs that made the step times, and its report
prices each kind of step."""

from __future__ import annotations

import itertools

import pytest

from engine.simulated import StepProfile
from loadtest.bench.mock_profile import TimedStep, fit, report

TRUE = StepProfile(
    overhead_s=0.004, prefill_s_per_token=3e-5, decode_s_per_seq=6e-4, kv_read_s_per_block=2e-5
)


def _steps() -> list[TimedStep]:
    shapes = itertools.chain(
        ((tokens, 0, tokens // 16) for tokens in (64, 256, 1024, 2048)),
        ((0, seqs, seqs * blocks) for seqs in (1, 8, 32) for blocks in (4, 32, 64)),
        ((512, 8, 200), (1024, 31, 900)),
    )
    return [
        TimedStep(p, d, b, TRUE.overhead_s + p * 3e-5 + d * 6e-4 + b * 2e-5) for p, d, b in shapes
    ]


def test_the_fit_recovers_the_costs_of_exact_step_times() -> None:
    fitted = fit(_steps())
    assert fitted.overhead_s == pytest.approx(TRUE.overhead_s, rel=1e-6)
    assert fitted.prefill_s_per_token == pytest.approx(TRUE.prefill_s_per_token, rel=1e-6)
    assert fitted.decode_s_per_seq == pytest.approx(TRUE.decode_s_per_seq, rel=1e-6)
    assert fitted.kv_read_s_per_block == pytest.approx(TRUE.kv_read_s_per_block, rel=1e-6)


def test_the_report_has_each_kind_and_the_flags() -> None:
    text = report(TRUE, _steps(), "exact")
    assert "| prefill | 4 |" in text and "| decode | 9 |" in text and "| mixed | 2 |" in text
    assert "--mock-step-ms 4.000 --mock-prefill-us-per-token 30.00" in text
    assert "--mock-decode-us-per-seq 600.0 --mock-kv-read-us-per-block 20.00" in text
