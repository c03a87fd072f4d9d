"""CPU tuning: the core list parser, pinning every thread of the process, and huge pages."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.cpu_tuning import parse_cpu_list


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("1", {1}), ("0-3", {0, 1, 2, 3}), ("0-1, 4,6-7", {0, 1, 4, 6, 7}), ("2-2", {2})],
)
def test_parse_cpu_list(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "3-1", "-1", "1-", "0,,1"])
def test_parse_cpu_list_rejects_garbage(text):
    with pytest.raises(ValueError, match="not a CPU list"):
        parse_cpu_list(text)


def test_engine_config_checks_cpu_cores():
    with pytest.raises(ValueError, match="not a CPU list"):
        EngineConfig(model="m", cpu_cores="first")


def test_pinning_reaches_threads_started_before_and_after():
    core = min(os.sched_getaffinity(0))
    script = textwrap.dedent(f"""
        import os, threading
        from engine.cpu_tuning import pin_process_to_cpus

        started, stop = threading.Event(), threading.Event()
        tids = []
        def park():
            tids.append(threading.get_native_id())
            started.set()
            stop.wait()
        before = threading.Thread(target=park)
        before.start()
        started.wait()
        pin_process_to_cpus(frozenset({{{core}}}))
        after = threading.Thread(target=park)
        started.clear()
        after.start()
        started.wait()
        print(sorted(os.sched_getaffinity(tid) == {{{core}}} for tid in [0, *tids]))
        stop.set()
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.split() == ["[True,", "True,", "True]"]


def test_pinning_refuses_cores_the_process_cannot_use():
    missing = max(os.sched_getaffinity(0)) + 1
    script = (
        f"from engine.cpu_tuning import pin_process_to_cpus; pin_process_to_cpus({{{missing}}})"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode != 0 and f"CPU cores {missing} are not available" in result.stderr


def test_an_engine_stepped_off_its_build_thread_warns_once():
    script = textwrap.dedent("""
        import logging, threading, torch
        from engine.cpu_tuning import BuildThread

        logging.basicConfig(format="%(levelname)s %(message)s")
        built = BuildThread()
        built.check()  # on the builder's thread: silent
        def step():
            torch.set_num_threads(2)
            built.check()
            built.check()
        other = threading.Thread(target=step)
        other.start()
        other.join()
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    warnings = [line for line in result.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1
    assert "steps on thread" in warnings[0] and "with 2 torch threads" in warnings[0]


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0]


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping in /proc/self/smaps that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    return set()


@pytest.mark.skipif(_thp_mode() in (None, "never"), reason="no transparent huge pages here")
def test_advise_huge_pages_marks_the_whole_pages_inside_the_range():
    import torch

    from engine.cpu_tuning import advise_huge_pages

    buffer = torch.empty(16 * 2**20, dtype=torch.uint8)
    assert advise_huge_pages(buffer.data_ptr(), buffer.nbytes)
    first_whole_page = -(-buffer.data_ptr() // 2**21) * 2**21
    assert "hg" in _vm_flags(first_whole_page)
    assert not advise_huge_pages(buffer.data_ptr() + 1, 2**20)  # no whole page inside


@pytest.mark.skipif(_thp_mode() in (None, "never"), reason="no transparent huge pages here")
def test_the_cpu_kv_cache_is_advised_huge_pages(tiny_llama_dir):
    from engine.llm import LLM

    cache = LLM(model=str(tiny_llama_dir), num_kv_blocks=16384).engine.kv_cache
    assert "hg" in _vm_flags(-(-cache.data_ptr() // 2**21) * 2**21)
    assert not cache.any()  # still zeroed
