"""Select-and-reserve: match a prompt, score the prefill pool, pick and reserve, atomically.

A reservation is the chosen worker's uncached blocks, counted as its queued work by every router
until the router that made it releases it (the prefill ended). The same step records the prompt's
blocks in the prefix index as held by the chosen worker, before the worker computes them (as
Dynamo's router predicts active blocks): the next request with that prefix follows it at once
instead of missing until the worker's own events arrive. The worker's events then confirm or
remove them; a prefill that fails leaves a hint that only costs affinity. A decision that is not
followed (the decode worker prefills the prompt instead) is ``withdraw``-n: its reservation and
the blocks it recorded go, so that no later prompt follows blocks the worker never computed.

``RedisPrefillLedger`` (``redis_prefill_ledger``) does the whole decision in one Lua script on
Redis, shared by every router. ``LocalPrefillLedger`` is the same thing in this process: for a
router without Redis, and for routing on load alone while Redis is unreachable.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from engine.block_hash import BlockHash
from services.common.prefix_index import InProcessPrefixIndex
from services.router.prefill_cost import (
    CandidateLoad,
    CandidateScore,
    PrefillWeights,
    pick,
    score_candidates,
)

# A reservation whose router never released it and kept heartbeating (a bug, not a crash)
# still ends after this long.
RESERVATION_MAX_S = 600.0


@dataclass(frozen=True, slots=True)
class PrefillQuery:
    """What one decision is asked: the prompt's blocks, the candidates with their reported
    load, the policy's weights and the tie value that breaks equal scores (0..1)."""

    block_hashes: Sequence[BlockHash]
    candidates: Sequence[CandidateLoad]
    weights: PrefillWeights
    tie_value: float
    # The index's matches for this prompt, when a match of it just ran (worker id -> leading
    # blocks held; every live holder, candidates or not): the ledger scores with them instead
    # of matching again. None: the ledger matches, atomically with its pick.
    matched: Mapping[str, int] | None = None
    # With ``matched``: how many of each worker's matched blocks are in its tier alone.
    tier_matched: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Reservation:
    """Blocks reserved on one worker; ``member`` names it in the ledger. ``recorded`` are the
    prompt's blocks past the worker's match, which the decision recorded in the prefix index as
    the worker's (``PrefillLedger.withdraw`` removes them again)."""

    worker_id: str
    member: str
    blocks: int
    recorded: tuple[BlockHash, ...] = field(default=(), repr=False)


@dataclass(frozen=True, slots=True)
class Selection:
    """One decision: every candidate's score, the chosen one (None: no candidate, or all
    saturated), the index's matches for every live worker (decode workers too), the
    reservation made (None when nothing was chosen or nothing was to be reserved) and, of each
    worker's matched blocks, those in its tier alone (absent: none)."""

    scores: tuple[CandidateScore, ...]
    chosen: int | None
    matched: dict[str, int]
    reservation: Reservation | None
    tier_matched: dict[str, int] = field(default_factory=dict)


def reservation_member(router_id: str, req_id: str, blocks: int) -> str:
    return f"{router_id}|{req_id}|{blocks}"


class PrefillLedger(abc.ABC):
    """Decides and reserves for one router; shared with other routers when in Redis."""

    @abc.abstractmethod
    async def select(self, req_id: str | None, query: PrefillQuery) -> Selection:
        """Match ``query.block_hashes`` (unless ``query.matched`` is given), score its
        candidates (``prefill_cost``), pick one and, when ``req_id`` is given, reserve its
        uncached blocks, all as one atomic step."""

    @abc.abstractmethod
    async def release(self, reservation: Reservation) -> None:
        """The reserved work finished (or never started); idempotent."""

    @abc.abstractmethod
    async def withdraw(self, reservation: Reservation) -> None:
        """The worker will not prefill the prompt after all: ``release`` the reservation and
        remove the blocks the decision recorded as the worker's (``Reservation.recorded``) from
        the prefix index. Idempotent. A worker that had computed some of them meanwhile (another
        request's prefill) loses them from the index until its next events: affinity only."""

    @abc.abstractmethod
    def start(self) -> None:
        """Start background work on the running loop."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop heartbeating and drop this router's reservations."""


class LocalPrefillLedger(PrefillLedger):
    """Reservations in this process; matches from ``index`` (None: route on load alone)."""

    def __init__(self, router_id: str, index: InProcessPrefixIndex | None) -> None:
        self._router_id = router_id
        self._index = index
        self._reserved: dict[str, dict[str, int]] = {}  # worker id -> member -> blocks

    @property
    def has_index(self) -> bool:
        """Whether it matches prefixes (False: it decides on load alone)."""
        return self._index is not None

    async def select(self, req_id: str | None, query: PrefillQuery) -> Selection:
        block_hashes, candidates, weights = query.block_hashes, query.candidates, query.weights
        tier_matched: dict[str, int] = {}
        if query.matched is not None:
            matched = dict(query.matched)
            tier_matched = dict(query.tier_matched)
        else:
            matched = await self._index.match(block_hashes) if self._index and block_hashes else {}
            if self._index is not None:
                tier_matched = self._index.tier_blocks(block_hashes, matched)
        reserved = [self._reserved.get(c.worker_id, {}) for c in candidates]
        scores = score_candidates(
            len(block_hashes),
            candidates,
            matched,
            [sum(r.values()) for r in reserved],
            [len(r) for r in reserved],
            weights,
            tier_matched,
        )
        chosen = pick(scores, weights, query.tie_value)
        reservation = None
        if chosen is not None and req_id is not None:
            worker_id = candidates[chosen].worker_id
            blocks = len(block_hashes) - scores[chosen].matched_blocks
            member = reservation_member(self._router_id, req_id, blocks)
            self._reserved.setdefault(worker_id, {})[member] = blocks
            recorded = tuple(block_hashes[scores[chosen].matched_blocks :])
            reservation = Reservation(worker_id, member, blocks, recorded)
            if self._index is not None:
                await self._index.store(worker_id, recorded)
        return Selection(scores, chosen, matched, reservation, tier_matched)

    async def release(self, reservation: Reservation) -> None:
        self._reserved.get(reservation.worker_id, {}).pop(reservation.member, None)

    async def withdraw(self, reservation: Reservation) -> None:
        await self.release(reservation)
        if self._index is not None:
            await self._index.remove(reservation.worker_id, reservation.recorded)

    def start(self) -> None:
        """Nothing runs in the background."""

    async def close(self) -> None:
        """Nothing to release: the reservations die with this process."""
