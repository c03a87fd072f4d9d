"""Which decode worker runs a request: the least busy, counting the KV blocks it must pull.

For each healthy decode worker (docs/architecture.md#decode-choice)::

    cost = load_weight * active_requests + move_weight * (prompt_blocks - matched_blocks)

``active_requests`` is the larger of the worker's last report (running, waiting, waiting for
KV) and what this router has in flight on it; ``matched_blocks`` are the prompt's leading blocks
the worker already caches (decode workers publish to the prefix index too), which it will not
pull. Ties go to the lower KV usage, then to a seeded random choice.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass

from services.router.worker_pool import ServedTarget, WorkerHandle, WorkerPool


@dataclass(frozen=True, slots=True)
class DecodeCandidate:
    """One decode worker's score for a prompt."""

    worker: WorkerHandle
    matched_blocks: int
    active_requests: int
    cost: float


class DecodeChooser:
    """Scores the decode pool; stateless apart from the pool's own counters."""

    def __init__(
        self, pool: WorkerPool, *, load_weight: float, move_weight: float, rng: random.Random
    ) -> None:
        self.pool = pool
        self._load_weight = load_weight
        self._move_weight = move_weight
        self._rng = rng

    def score(
        self,
        prompt_blocks: int,
        matched: dict[str, int],
        exclude: set[str] | None = None,
        target: ServedTarget | None = None,
    ) -> list[DecodeCandidate]:
        """Every routable worker serving ``target`` and not in ``exclude`` (addresses),
        cheapest first."""
        candidates = []
        for worker in self.pool.routable_workers(target):
            if exclude and worker.address in exclude:
                continue
            load = worker.load
            active = max(
                load.num_running + load.num_waiting + load.num_waiting_for_kv, worker.num_inflight
            )
            worker_id = worker.info.worker_id if worker.info is not None else ""
            matched_blocks = min(matched.get(worker_id, 0), prompt_blocks)
            cost = self._load_weight * active + self._move_weight * (prompt_blocks - matched_blocks)
            candidates.append(DecodeCandidate(worker, matched_blocks, active, cost))
        candidates.sort(key=lambda c: (c.cost, c.worker.load.kv_usage))
        return candidates

    def pick(self, candidates: Sequence[DecodeCandidate]) -> DecodeCandidate | None:
        """The cheapest of ``score``'s candidates (ties: lower KV usage, then random); None
        when there is none."""
        if not candidates:
            return None
        best = (candidates[0].cost, candidates[0].worker.load.kv_usage)
        tied = [c for c in candidates if (c.cost, c.worker.load.kv_usage) == best]
        return self._rng.choice(tied)

    def choose(
        self,
        prompt_blocks: int,
        matched: dict[str, int],
        exclude: set[str] | None = None,
        target: ServedTarget | None = None,
    ) -> DecodeCandidate | None:
        """``pick`` over ``score``."""
        return self.pick(self.score(prompt_blocks, matched, exclude, target))

    async def wait_for(
        self,
        prompt_blocks: int,
        matched: dict[str, int],
        exclude: set[str],
        wait_s: float,
        poll_s: float,
        target: ServedTarget | None = None,
    ) -> DecodeCandidate | None:
        """``choose`` every ``poll_s`` (the health polls' interval: only a poll makes a worker
        routable) until one comes or ``wait_s`` has passed (then None)."""
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + wait_s
        while loop.time() < deadline_s:
            await asyncio.sleep(poll_s)
            candidate = self.choose(prompt_blocks, matched, exclude, target)
            if candidate is not None:
                return candidate
        return None
