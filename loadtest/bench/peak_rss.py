"""Peak resident memory of a cluster's processes, sampled on a background thread, and their
CPU time; a process's figures include its child processes' (the router's body-parsing helper)."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Mapping

import psutil

from services.launcher import LocalCluster

SAMPLE_INTERVAL_S = 0.25
_CHILDREN_EVERY_SAMPLES = 8


class PeakRss:
    """Samples the RSS of each process ``pids()`` names (key -> pid; read again at every sample,
    so restarted processes are followed), plus its descendants' (looked up every
    ``_CHILDREN_EVERY_SAMPLES`` samples), every ``SAMPLE_INTERVAL_S`` from a daemon thread, and
    keeps each key's peak. ``peaks`` and ``reset`` may be called from any thread."""

    def __init__(self, pids: Callable[[], Mapping[str, int]]) -> None:
        self._pids = pids
        self._peaks: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)
        self._thread.start()

    def peaks(self) -> dict[str, int]:
        """Each process's peak RSS in bytes since the start or the last ``reset``."""
        with self._lock:
            return dict(self._peaks)

    def reset(self) -> None:
        with self._lock:
            self._peaks.clear()

    def close(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _sample(self) -> None:
        # Looking descendants up reads every process's /proc entry (~2 ms): not every sample.
        children: dict[int, list[psutil.Process]] = {}
        for sample in itertools.count():
            if self._stopped.wait(SAMPLE_INTERVAL_S):
                return
            for key, pid in self._pids().items():
                try:
                    process = psutil.Process(pid)
                    if pid not in children or sample % _CHILDREN_EVERY_SAMPLES == 0:
                        children[pid] = process.children(recursive=True)
                    rss = process.memory_info().rss + _rss(children[pid])
                except psutil.Error:
                    continue
                with self._lock:
                    self._peaks[key] = max(self._peaks.get(key, 0), rss)


def cpu_seconds(pids: Mapping[str, int]) -> dict[str, float]:
    """Each process's CPU time so far (user + system, its threads and child processes included,
    ended ones too), in seconds; a process that has ended is left out."""
    spent = {}
    for key, pid in pids.items():
        try:
            process = psutil.Process(pid)
            times = process.cpu_times()
            children = process.children(recursive=True)
        except psutil.Error:
            continue
        spent[key] = times.user + times.system + times.children_user + times.children_system
        for child in children:
            with contextlib.suppress(psutil.Error):  # it ended meanwhile
                child_times = child.cpu_times()
                spent[key] += child_times.user + child_times.system
    return spent


def _rss(processes: list[psutil.Process]) -> int:
    """Their RSS summed (a page they share counts in each); one that ended counts 0."""
    rss = 0
    for process in processes:
        with contextlib.suppress(psutil.Error):
            rss += process.memory_info().rss
    return rss


def cluster_pids(local: LocalCluster) -> dict[str, int]:
    """``role@address`` -> pid of each process of ``local`` that has been started."""
    return {f"{p.role}@{p.address}": p.popen.pid for p in local.processes if p.popen is not None}
