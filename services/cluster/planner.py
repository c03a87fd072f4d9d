"""The autoscaler's decisions: each pool's size from its own latency and load signals.

Per evaluation (every ``planner_interval_s``) each pool gets a ``PoolSignals``: the prefill pool
is judged by TTFT and queued prefill requests, the decode pool by inter-token latency (ITL),
queued requests and KV usage. A pool grows by one worker after ``breach_evaluations`` in a row
over a target, and shrinks by one after ``idle_evaluations`` in a row well under every target
(below ``scale_down_ratio`` of it): the gap between the two thresholds is the hysteresis. After
any change the pool may grow again only after ``scale_up_cooldown_s`` and shrink only after the
longer ``scale_down_cooldown_s``, so a noisy signal cannot make it flap. The pools are decided
independently: a TTFT breach never grows the decode pool.

Pure and clock-free (``now_s`` is passed in), so a recorded trace replays exactly.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine.flags import flag
from services.common.roles import POOL_ROLES, Role


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """The autoscaler's targets and pacing (``splitserve up`` flags)."""

    autoscale: bool = flag(False, "let the planner size the prefill and decode pools")
    planner_interval_s: float = flag(10.0, "seconds between the planner's evaluations")
    target_ttft_ms: float = flag(2000.0, "prefill pool target: p90 time to first token")
    target_itl_ms: float = flag(200.0, "decode pool target: p90 inter-token latency")
    target_queue_per_worker: float = flag(
        8.0, "requests waiting per worker (prefill: for prefill; decode: for a batch slot or KV)"
    )
    target_kv_usage: float = flag(0.9, "decode pool target: mean KV cache usage (0-1)")
    scale_down_ratio: float = flag(
        0.5, "a pool shrinks only while every signal stays below this fraction of its target"
    )
    breach_evaluations: int = flag(2, "evaluations in a row over a target before growing")
    idle_evaluations: int = flag(6, "evaluations in a row well under target before shrinking")
    scale_up_cooldown_s: float = flag(60.0, "seconds a pool is left alone after it grew")
    scale_down_cooldown_s: float = flag(300.0, "seconds a pool is left alone after it shrank")
    min_prefill_workers: int = flag(0, "the planner never shrinks the prefill pool below this")
    max_prefill_workers: int = flag(8, "the planner never grows the prefill pool above this")
    min_decode_workers: int = flag(1, "the planner never shrinks the decode pool below this")
    max_decode_workers: int = flag(8, "the planner never grows the decode pool above this")

    def __post_init__(self) -> None:
        if not 0 < self.scale_down_ratio < 1:
            raise ValueError(f"scale_down_ratio must be in (0, 1), got {self.scale_down_ratio}")
        if self.breach_evaluations < 1 or self.idle_evaluations < 1:
            raise ValueError("breach_evaluations and idle_evaluations must be >= 1")
        if self.min_decode_workers < 1:
            raise ValueError("min_decode_workers must be >= 1")
        for role in POOL_ROLES:
            low, high = self.bounds(role)
            if not 0 <= low <= high:
                raise ValueError(f"{role}: need 0 <= min_{role}_workers <= max_{role}_workers")

    def bounds(self, role: Role) -> tuple[int, int]:
        if role == Role.PREFILL:
            return self.min_prefill_workers, self.max_prefill_workers
        return self.min_decode_workers, self.max_decode_workers


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """One evaluation window of one pool. ``latency_ms`` is the p90 TTFT (prefill) or ITL
    (decode) of the window, None without traffic; ``kv_usage`` is only judged for decode."""

    num_workers: int
    latency_ms: float | None
    queue_per_worker: float
    kv_usage: float = 0.0


class Verdict(enum.Enum):
    BREACH = "breach"  # over a target
    IDLE = "idle"  # well under every target
    OK = "ok"


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in [0, 1]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


@dataclass(slots=True)
class PoolPlanner:
    """The state of one pool's decisions: streaks of breaches and idle windows, last change."""

    role: Role
    config: PlannerConfig
    breach_streak: int = 0
    idle_streak: int = 0
    last_change_s: float = -math.inf

    def judge(self, signals: PoolSignals) -> Verdict:
        config = self.config
        target_ms = config.target_ttft_ms if self.role == Role.PREFILL else config.target_itl_ms
        limits = [(signals.queue_per_worker, config.target_queue_per_worker)]
        if signals.latency_ms is not None:
            limits.append((signals.latency_ms, target_ms))
        if self.role == Role.DECODE:
            limits.append((signals.kv_usage, config.target_kv_usage))
        if any(value > limit for value, limit in limits):
            return Verdict.BREACH
        if all(value < config.scale_down_ratio * limit for value, limit in limits):
            return Verdict.IDLE
        return Verdict.OK

    def decide(self, signals: PoolSignals, now_s: float) -> int:
        """The pool's new size (``signals.num_workers`` when unchanged, clamped to the
        planner's bounds)."""
        verdict = self.judge(signals)
        self.breach_streak = self.breach_streak + 1 if verdict is Verdict.BREACH else 0
        self.idle_streak = self.idle_streak + 1 if verdict is Verdict.IDLE else 0
        config = self.config
        low, high = config.bounds(self.role)
        size = signals.num_workers
        since_change_s = now_s - self.last_change_s
        if (
            self.breach_streak >= config.breach_evaluations
            and size < high
            and since_change_s >= config.scale_up_cooldown_s
        ):
            return self._changed(size + 1, now_s)
        if (
            self.idle_streak >= config.idle_evaluations
            and size > low
            and since_change_s >= config.scale_down_cooldown_s
        ):
            return self._changed(size - 1, now_s)
        return min(max(size, low), high)

    def _changed(self, size: int, now_s: float) -> int:
        self.last_change_s = now_s
        self.breach_streak = self.idle_streak = 0
        return size
