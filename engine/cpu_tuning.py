"""Process-wide settings that make torch fast on CPU hosts."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MAX_MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
_MADV_HUGEPAGE = 14  # Linux's madvise advice number
_HUGE_PAGE_BYTES = 2 * 2**20


def keep_freed_memory_in_heap() -> bool:
    """Stop glibc from returning activation-sized buffers to the OS after every op.

    By default glibc serves allocations above a (dynamic) threshold with fresh ``mmap`` pages
    and trims the heap on free, so each large activation of a forward pass pays page faults and
    zeroing again; on a 2-core host that cost a prefill step ~25%. Raising both thresholds keeps
    the memory in the heap for reuse (what tcmalloc/jemalloc preloading achieves). No-op where
    glibc is absent; returns whether it applied.
    """
    path = ctypes.util.find_library("c")
    if path is None:
        return False
    try:
        libc = ctypes.CDLL(path)
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, _MAX_MMAP_THRESHOLD_BYTES))
        ok &= bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**30))
    except (OSError, AttributeError):
        return False
    logger.debug("glibc mallopt thresholds raised: %s", ok)
    return ok


def advise_huge_pages(address: int, size_bytes: int) -> bool:
    """Ask Linux to back ``[address, address + size_bytes)`` with transparent huge pages, as
    far as whole 2 MiB pages fit inside it. Call it before the memory is first touched.

    Decode attention reads each sequence's KV blocks scattered over the whole cache; with 4 KiB
    pages nearly every block read misses the TLB. On hosts whose THP mode is ``madvise`` (the
    common default) nothing gets huge pages unless asked: the KV cache's plain read then ran at
    13.7 GB/s against 15.4 with them (2 cores, AMX host; BENCHMARKS.md). Returns whether the
    advice was taken (False off Linux, or where THP is off).
    """
    start = -(-address // _HUGE_PAGE_BYTES) * _HUGE_PAGE_BYTES
    end = (address + size_bytes) // _HUGE_PAGE_BYTES * _HUGE_PAGE_BYTES
    path = ctypes.util.find_library("c")
    if end <= start or path is None or not sys.platform.startswith("linux"):
        return False
    try:
        madvise = ctypes.CDLL(path, use_errno=True).madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise(start, end - start, _MADV_HUGEPAGE) == 0


def parse_cpu_list(text: str) -> frozenset[int]:
    """CPU ids from a list such as ``"1"`` or ``"0-3,8"`` (the kernel's cpulist format)."""
    cpus: set[int] = set()
    for part in text.split(","):
        low, sep, high = part.strip().partition("-")
        try:
            first = int(low)
            last = int(high) if sep else first
        except ValueError:
            raise ValueError(f"not a CPU list (e.g. '1' or '0-3,8'): {text!r}") from None
        if first < 0 or last < first:
            raise ValueError(f"not a CPU list (e.g. '1' or '0-3,8'): {text!r}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def pin_process_to_cpus(cpus: frozenset[int]) -> None:
    """Restrict every thread of this process to ``cpus``; threads started later inherit it.

    Linux affinity is per thread, so pinning only the caller would leave the threads already
    running (gRPC, asyncio executors, a Ray actor's own) free to run anywhere.
    """
    available = os.sched_getaffinity(0)
    if not cpus <= available:
        missing = ",".join(str(c) for c in sorted(cpus - available))
        raise ValueError(f"CPU cores {missing} are not available to this process")
    for tid in _thread_ids():
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    logger.info("pinned to CPU cores %s", ",".join(str(c) for c in sorted(cpus)))


def _thread_ids() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except FileNotFoundError:  # no procfs: the calling thread only
        return [0]


@dataclass(slots=True)
class BuildThread:
    """The thread an engine was built (and warmed up) on: where its CPU steps belong.

    libgomp, PyTorch's OpenMP on Linux, keeps a pool of worker threads per thread that opens
    parallel regions. Once the pools together hold more threads than the process has CPUs,
    libgomp cuts every pool's spin-wait to about a hundred spins, so each parallel region wakes
    its workers through the kernel: an engine built on one thread and stepped on another, with
    as many torch threads as cores, ran its decode steps 1.7x slower (BENCHMARKS.md, "One
    OpenMP pool"). ``check`` logs that once; it changes nothing else.
    """

    ident: int = field(default_factory=threading.get_ident)
    _warned: bool = False

    def check(self) -> None:
        """Warn once when called on another thread than the builder's with more than one
        torch thread there (then a second OpenMP pool throttles both)."""
        if self._warned or threading.get_ident() == self.ident:
            return
        self._warned = True
        import torch  # here: routers import this module (for the CPU list) and not torch

        if torch.get_num_threads() > 1:
            logger.warning(
                "the engine built on thread %d steps on thread %d with %d torch threads: "
                "OpenMP keeps a pool per thread and two pools on these cores throttle each "
                "other; build the engine on the thread that steps it",
                self.ident,
                threading.get_ident(),
                torch.get_num_threads(),
            )


def place_engine_threads(cpu_cores: str | None, num_threads: int | None) -> None:
    """Pin this process to ``cpu_cores`` (``--cpu-cores``) and size torch's intra-op pool:
    ``num_threads`` (``--num-threads``), else one thread per pinned core, else torch's own.
    Called by an engine before its model is built (vLLM on CPU then keeps that pool)."""
    if cpu_cores is not None:
        cpus = parse_cpu_list(cpu_cores)
        pin_process_to_cpus(cpus)
        num_threads = num_threads or len(cpus)
    if num_threads:
        import torch

        torch.set_num_threads(num_threads)
