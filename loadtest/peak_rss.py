"""Peak resident memory of a cluster's processes, sampled on a background thread, and their
CPU time."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import psutil

from services.launcher import LocalCluster

SAMPLE_INTERVAL_S = 0.25


class PeakRss:
    """Samples the RSS of each process ``pids()`` names (key -> pid; read again at every sample,
    so restarted processes are followed) every ``SAMPLE_INTERVAL_S`` from a daemon thread, and
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
        while not self._stopped.wait(SAMPLE_INTERVAL_S):
            for key, pid in self._pids().items():
                try:
                    rss = psutil.Process(pid).memory_info().rss
                except psutil.Error:
                    continue
                with self._lock:
                    self._peaks[key] = max(self._peaks.get(key, 0), rss)


def cpu_seconds(pids: Mapping[str, int]) -> dict[str, float]:
    """Each process's CPU time so far (user + system, its threads included), in seconds; a
    process that has ended is left out."""
    spent = {}
    for key, pid in pids.items():
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        spent[key] = times.user + times.system
    return spent


def cluster_pids(local: LocalCluster) -> dict[str, int]:
    """``role@address`` -> pid of each process of ``local`` that has been started."""
    return {f"{p.role}@{p.address}": p.popen.pid for p in local.processes if p.popen is not None}
