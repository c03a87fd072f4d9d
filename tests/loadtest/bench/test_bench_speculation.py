"""bench_speculation end to end on a tiny model: both workloads, the baseline first, and the
float32 outputs identical with and without drafts."""

from __future__ import annotations

import json

import pytest

from loadtest.bench import speculation


def test_runs_both_workloads_and_reports_against_the_baseline(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "out"
    argv = [
        "--model",
        str(tiny_llama_dir),
        "--dtype",
        "float32",
        "--settings",
        "0,3:1",
        "--num-prompts",
        "3",
        "--output-tokens",
        "12",
        "--out",
        str(out),
    ]
    assert speculation.main(argv) == 0
    runs = json.loads((out / "results.json").read_text())
    assert [(r["workload"], r["setting"]) for r in runs] == [
        ("random-token", "none"),
        ("random-token", "3 drafts, n >= 1"),
        ("docs-chat", "none"),
        ("docs-chat", "3 drafts, n >= 1"),
    ]
    for run in runs:
        assert run["identical_outputs"] == run["num_prompts"] == 3
        assert 0 <= run["accepted_tokens"] <= run["draft_tokens"]
    assert runs[0]["draft_tokens"] == 0 and runs[1]["draft_tokens"] > 0
    assert "| random-token | none |" in capsys.readouterr().out


def test_the_baseline_must_come_first():
    with pytest.raises(SystemExit):
        speculation.parse_args(["--settings", "3,0"])
