"""``python -m loadtest.chaos`` end to end on a few faults: every request of the load is
token-exact or failed with a clear status, fuzzed requests get INVALID_ARGUMENT, and the
cluster recovers (the run fails otherwise); with ``--hosts``, the network faults too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.fixtures import netns_hosts

HOST_FAULTS = (
    "decode host cut,prefill host cut,redis host cut,router cut from a decode host,decode host lost"
)


def run_chaos(tmp_path: Path, faults: str, *flags: str) -> tuple[str, dict]:
    """Run 8 requests a phase through ``faults``; its stdout and phases by fault, checked:
    every request token-exact, none lost, hung or wrong."""
    out = tmp_path / "chaos.json"
    run = subprocess.run(
        [sys.executable, "-m", "loadtest.chaos", "--num-requests", "8", "--faults", faults,
         "--out", str(out), *flags],
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())
    phases = {p["fault"]: p for p in results["phases"]}
    assert list(phases) == faults.split(",")
    for phase in phases.values():
        assert phase["sent"] == 8 and phase["exact"] == 8, phase
        assert phase["lost"] == phase["hung"] == phase["wrong"] == 0
    assert all(rss > 0 for rss in results["peak_rss_bytes"].values())
    return run.stdout, results


def test_chaos_run_loses_nothing(tmp_path):
    stdout, results = run_chaos(tmp_path, "none,kill -9 decode,SIGTERM decode,fuzzed requests")
    side = results["phases"][-1]["side"]
    assert set(side) == {"INVALID_ARGUMENT"} and side["INVALID_ARGUMENT"] > 30
    assert "| kill -9 decode | 8 | 8 |" in stdout


def test_chaos_across_test_hosts_loses_nothing(tmp_path):
    """``--hosts``: every process on a host of its own, the network faults among the phases;
    nothing left behind."""
    reason = netns_hosts.available()
    if reason is not None:
        pytest.skip(reason)
    _, results = run_chaos(tmp_path, HOST_FAULTS, "--hosts")
    assert results["hosts"] is True
    assert netns_hosts.leftovers() == []
