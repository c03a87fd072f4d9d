"""``python -m loadtest.chaos`` end to end on a few faults: every request of the load is
token-exact or failed with a clear status, fuzzed requests get INVALID_ARGUMENT, and the
cluster recovers (the run fails otherwise)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from loadtest import netns_hosts


def test_chaos_run_loses_nothing(tmp_path):
    out = tmp_path / "chaos.json"
    faults = "none,kill -9 decode,SIGTERM decode,fuzzed requests"
    run = subprocess.run(
        [sys.executable, "-m", "loadtest.chaos", "--num-requests", "8", "--faults", faults,
         "--out", str(out)],
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
    side = phases["fuzzed requests"]["side"]
    assert set(side) == {"INVALID_ARGUMENT"} and side["INVALID_ARGUMENT"] > 30
    assert "| kill -9 decode | 8 | 8 |" in run.stdout
    assert all(rss > 0 for rss in results["peak_rss_bytes"].values())


HOST_FAULTS = (
    "decode host cut,prefill host cut,redis host cut,router cut from a decode host,decode host lost"
)


def test_chaos_across_test_hosts_loses_nothing(tmp_path):
    """``--hosts``: every process on a host of its own, the network faults among the phases;
    every request token-exact, nothing left behind."""
    reason = netns_hosts.available()
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path / "chaos.json"
    run = subprocess.run(
        [sys.executable, "-m", "loadtest.chaos", "--hosts", "--num-requests", "8",
         "--faults", HOST_FAULTS, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["hosts"] is True
    phases = {p["fault"]: p for p in results["phases"]}
    assert list(phases) == HOST_FAULTS.split(",")
    for phase in phases.values():
        assert phase["sent"] == 8 and phase["exact"] == 8, phase
    assert netns_hosts.leftovers() == []
