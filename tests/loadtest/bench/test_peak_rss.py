"""A process's CPU time and peak RSS include its child processes' (the router's body-parsing
helper is the router's cost)."""

from __future__ import annotations

import subprocess
import sys
import time

from loadtest.bench.peak_rss import PeakRss, cpu_seconds

# The parent only waits; its child computes, then holds 64 MB until its stdin closes.
_PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdin=sys.stdin)
child.wait()
"""
_CHILD = """
import sys, time
end_s = time.process_time() + 1.0
while time.process_time() < end_s:
    pass
held = b"x" * (64 * 2**20)  # written, so resident
print("busy", flush=True)
sys.stdin.read()
"""


def test_a_process_counts_its_childs_cpu_time_and_memory() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, _CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    rss = PeakRss(lambda: {"parent": parent.pid})
    try:
        assert parent.stdout is not None and parent.stdout.readline() == "busy\n"
        spent_s = cpu_seconds({"parent": parent.pid})["parent"]
        # The parent alone spent almost nothing; the child at least its second of CPU.
        assert spent_s >= 0.9
        deadline_s = time.monotonic() + 30
        while rss.peaks().get("parent", 0) < 64 * 2**20:
            assert time.monotonic() < deadline_s, rss.peaks()
            time.sleep(0.1)
    finally:
        rss.close()
        assert parent.stdin is not None
        parent.stdin.close()
        parent.wait()
