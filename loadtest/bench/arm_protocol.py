"""File protocol between ``bench_engine`` and the per-system benchmark children ("arms").

Every arm runs in its own fresh process (so its peak RSS is its own) as
``python -m loadtest.bench.arm_<system> JOB.json RESULT.json``. The vLLM arm runs under a
different interpreter (the vLLM venv), so this module imports only the standard library.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class ArmJob:
    """What one arm must run: the same model, prompts and limits for every system."""

    system: str
    model_dir: str
    dtype: str
    prompt_token_ids: list[list[int]]
    output_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    hf_batch_size: int
    threads: int
    seed: int
    # splitserve's --cpu-isa (the other systems are capped by ATEN/oneDNN env vars only).
    cpu_isa: str = "auto"
    # "cpu" or "cuda": where splitserve and transformers run (the vLLM arm is CPU only).
    device: str = "cpu"
    # --kv-cache-dtype of splitserve and vLLM (transformers keeps its own cache).
    kv_cache_dtype: str = "auto"
    # Prompt-lookup (ngram) draft tokens per step in splitserve and vLLM (0: none); None: each
    # system's default (splitserve drafts, vLLM does not).
    num_speculative_tokens: int | None = None
    # splitserve's --load-format (dummy: random weights from config.json alone).
    load_format: str = "auto"

    def write(self, path: Path) -> None:
        """Serialise to ``path`` as JSON (overwrites)."""
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def read(cls, path: Path) -> ArmJob:
        return cls(**json.loads(path.read_text()))


@dataclass(slots=True)
class ArmResult:
    """What one arm measured.

    Invariants: every per-request list is indexed like ``ArmJob.prompt_token_ids``;
    ``first_token_s`` / ``finish_s`` are offsets in seconds from the common start of the run
    (the moment just before the first request was submitted); ``gen_wall_s`` excludes model
    load (``load_s``); ``gen_cpu_s`` is the CPU time the arm's whole process tree spent in
    that window (robust to other load on a shared host, unlike wall time).
    """

    system: str
    version: str
    load_s: float
    gen_wall_s: float
    first_token_s: list[float]
    finish_s: list[float]
    output_token_ids: list[list[int]]
    maxrss_mib: float
    gen_cpu_s: float
    settings: dict[str, Any] = field(default_factory=dict)

    def write(self, path: Path) -> None:
        """Serialise to ``path`` as JSON (overwrites)."""
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def read(cls, path: Path) -> ArmResult:
        return cls(**json.loads(path.read_text()))


class RequestTimeline:
    """First-token and finish stamps per request, relative to one common start.

    ``start()`` resets the clock (and the CPU baseline); ``mark(index, finished)`` records the
    first call per request as its first token and the call with ``finished=True`` as its
    finish.
    """

    __slots__ = ("_finish_s", "_first_token_s", "_start_cpu_s", "_start_s")

    def __init__(self, num_requests: int) -> None:
        self._start_s = time.perf_counter()
        self._start_cpu_s = 0.0
        self._first_token_s: list[float | None] = [None] * num_requests
        self._finish_s: list[float | None] = [None] * num_requests

    def start(self) -> None:
        self._start_cpu_s = tree_cpu_s()
        self._start_s = time.perf_counter()

    def cpu_s(self) -> float:
        """Tree CPU seconds since ``start()``."""
        return tree_cpu_s() - self._start_cpu_s

    def elapsed_s(self) -> float:
        return time.perf_counter() - self._start_s

    def mark(self, index: int, finished: bool) -> None:
        now_s = self.elapsed_s()
        if self._first_token_s[index] is None:
            self._first_token_s[index] = now_s
        if finished:
            self._finish_s[index] = now_s

    def first_token_s(self) -> list[float]:
        return _complete(self._first_token_s, "first token")

    def finish_s(self) -> list[float]:
        return _complete(self._finish_s, "finish")

    def result(
        self,
        system: str,
        version: str,
        load_s: float,
        output_token_ids: list[list[int]],
        settings: dict[str, Any],
    ) -> ArmResult:
        """The arm's result, read at the end of generation (call once, right after it)."""
        return ArmResult(
            system=system,
            version=version,
            load_s=load_s,
            gen_wall_s=self.elapsed_s(),
            first_token_s=self.first_token_s(),
            finish_s=self.finish_s(),
            output_token_ids=output_token_ids,
            maxrss_mib=self_maxrss_mib(),
            gen_cpu_s=self.cpu_s(),
            settings=settings,
        )


def _complete(stamps: list[float | None], what: str) -> list[float]:
    missing = [i for i, s in enumerate(stamps) if s is None]
    if missing:
        raise RuntimeError(f"{len(missing)} requests have no {what} stamp (first: {missing[0]})")
    return [s for s in stamps if s is not None]


def tree_cpu_s() -> float:
    """CPU seconds (user + system) of this process and its live descendants."""
    import psutil  # present in both the project env and the vLLM venv

    me = psutil.Process()
    total = 0.0
    for member in (me, *me.children(recursive=True)):
        try:
            times = member.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def self_maxrss_mib() -> float:
    """Peak RSS of this process and its reaped children, whichever is larger (Linux: KiB)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1024.0


def arm_main(run: Callable[[ArmJob], ArmResult]) -> None:
    """CLI entry of an arm: ``JOB.json RESULT.json``; writes the result file on success."""
    if len(sys.argv) != 3:
        raise SystemExit(f"usage: {sys.argv[0]} JOB.json RESULT.json")
    job = ArmJob.read(Path(sys.argv[1]))
    result = run(job)
    result.write(Path(sys.argv[2]))
