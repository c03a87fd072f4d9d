"""Which prefill worker computes a prompt: the one with the least work, counted in blocks.

The cost and the bounded-load rule are in ``prefill_cost``; the decision and the reservation of
the chosen worker's uncached blocks are one atomic step of a ``PrefillLedger`` (in Redis when
several routers share a cluster). Call ``done`` when the prefill ends: it releases the
reservation and records predicted vs realized prefix hits.

With a Redis index the workers publish what they cache. Without one the router's in-process
index holds only its own choices (a worker chosen for a prompt is assumed to cache it until it
fails): approximate, like SGLang's router tree; a stale index only costs affinity. A
slow or unreachable Redis costs the prefix term and the other routers' reservations, never a
request: the router then decides on load alone with its own reservations.

In a pool of more than ``max_candidates`` workers a decision does not score every worker: it
asks the index which workers hold the prompt's prefix, then scores the longest holders (at most
half the candidates) and a uniform sample of the others (``sample_candidates``) with that
match (so the match and the reservation are two steps there, not one: another router's
prediction in between costs affinity only). A decision's cost then stays flat with the
fleet's size, and bounded load holds over the sample (its capacity is the sample's mean times
the bound), as in power-of-d-choices balancing.

With a ``replica`` of the index (the index's change stream is on) the match is made in this
process (``prefix_replica``) and the ledger's Redis step only scores and reserves; while the
replica is not ready, the ledger matches in Redis as without one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from engine.block_hash import BlockHash
from services.common.background import BackgroundTasks
from services.common.logs import rate_limited
from services.common.prefix_index import InProcessPrefixIndex
from services.router import metrics
from services.router.prefill_cost import CandidateLoad, CandidateScore, PrefillWeights
from services.router.prefill_ledger import (
    LocalPrefillLedger,
    PrefillLedger,
    PrefillQuery,
    Reservation,
    Selection,
)
from services.router.prefix_replica import PrefixIndexReplica
from services.router.worker_pool import ServedTarget, WorkerHandle, WorkerPool
from splitserve.v1 import worker_pb2

logger = logging.getLogger(__name__)

# TTL of the router's own liveness entries in an in-process index (refreshed at every choice).
_LOCAL_TTL_S = 3600.0


class PrefillPolicy(enum.Enum):
    """How the prefill worker is chosen: by cost, or a cache-blind baseline (benchmarks)."""

    COST = "cost"
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"


# The baselines score every worker alike; the tie-break then does the choosing.
_BLIND = PrefillWeights(cache_weight=0.0, load_weight=0.0)


@dataclass(frozen=True, slots=True)
class PrefillChoice:
    """One decision. ``worker`` is None when no prefill worker is healthy or all are saturated;
    ``matched`` holds the index's matches for every live worker, decode workers included, and
    ``tier_matched`` how many of those are in the worker's tier alone (absent: none)."""

    worker: WorkerHandle | None
    block_hashes: tuple[BlockHash, ...]
    candidates: tuple[PrefillCandidate, ...]
    matched: dict[str, int]
    reservation: Reservation | None
    ledger: PrefillLedger
    # Seconds the ledger took to decide (a Redis round trip with a Redis index).
    ledger_s: float = 0.0
    tier_matched: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def matched_blocks(self) -> int:
        chosen = [c for c in self.candidates if c.worker is self.worker]
        return chosen[0].score.matched_blocks if chosen else 0

    @property
    def tier_blocks(self) -> int:
        """Of ``matched_blocks``, those in the chosen worker's tier alone."""
        chosen = [c for c in self.candidates if c.worker is self.worker]
        return chosen[0].score.tier_blocks if chosen else 0

    @property
    def saturated(self) -> bool:
        return self.worker is None and bool(self.candidates)


@dataclass(frozen=True, slots=True)
class PrefillCandidate:
    """One healthy prefill worker and its score for a prompt."""

    worker: WorkerHandle
    score: CandidateScore


class PrefillChooser:
    """Scores the prefill pool through a ledger; call ``done`` after each chosen prefill.
    ``max_candidates`` (0: every worker) caps the workers one decision scores."""

    def __init__(
        self,
        pool: WorkerPool,
        ledger: PrefillLedger,
        *,
        local_index: InProcessPrefixIndex | None,
        weights: PrefillWeights,
        router_id: str,
        rng: random.Random,
        policy: PrefillPolicy = PrefillPolicy.COST,
        max_candidates: int = 0,
        replica: PrefixIndexReplica | None = None,
        select_timeout_s: float = 0.25,
    ) -> None:
        self.pool = pool
        self.ledger = ledger
        self.num_hit_blocks_predicted = 0
        self.num_hit_blocks_realized = 0
        self._local_index = local_index
        self._replica = replica
        # How long a decision waits for the ledger before deciding on load alone.
        self._select_timeout_s = select_timeout_s
        self._weights = weights if policy is PrefillPolicy.COST else _BLIND
        self._policy = policy
        self._num_choices = 0
        self._rng = rng
        # The cache-blind baselines pick among every worker (their tie value counts them all).
        self._max_candidates = max_candidates if policy is PrefillPolicy.COST else 0
        # Decides on load alone, with this router's reservations, while Redis is unreachable.
        self._fallback = LocalPrefillLedger(router_id, None) if local_index is None else None
        self._background = BackgroundTasks()

    async def choose(
        self,
        req_id: str | None,
        block_hashes: Sequence[BlockHash],
        *,
        with_candidates: bool = True,
        target: ServedTarget | None = None,
    ) -> PrefillChoice:
        """Decide for a prompt's ``block_hashes``; with a ``req_id``, reserve the chosen worker
        until ``done``. ``with_candidates=False`` only matches (for the decode choice). Only
        workers serving ``target`` (a model, maybe an adapter) are candidates."""
        workers = [
            w
            for w in (self.pool.routable_workers(target) if with_candidates else ())
            if w.info is not None
        ]
        block_hashes = tuple(block_hashes)
        if self._local_index is not None:  # its workers are live while the router sees them
            for worker in workers:
                await self._local_index.heartbeat(_worker_id(worker), _LOCAL_TTL_S)
        if not workers and not block_hashes:
            return PrefillChoice(None, block_hashes, (), {}, None, self.ledger)
        query = PrefillQuery(block_hashes, (), self._weights, self._tie_value(len(workers)))
        ledger = self.ledger
        start_s = time.perf_counter()
        try:
            with metrics.DECISION_SECONDS.time():
                selection, considered = await asyncio.wait_for(
                    self._select(ledger, req_id, query, workers),
                    self._select_timeout_s,
                )
        except Exception as exc:  # Redis down or slow: decide on load alone
            if self._fallback is None:
                raise
            metrics.PREFIX_INDEX_ERRORS.inc()
            logger.warning(
                "prefix index unreachable (%r); routing on load only",
                exc,
                extra=rate_limited("redis"),
            )
            ledger = self._fallback
            selection, considered = await self._select(ledger, req_id, query, workers)
        workers = [workers[i] for i in considered]
        scored = zip(workers, selection.scores, strict=True)
        candidates = tuple(PrefillCandidate(w, s) for w, s in scored)
        chosen = workers[selection.chosen] if selection.chosen is not None else None
        return PrefillChoice(
            chosen,
            block_hashes,
            candidates,
            selection.matched,
            selection.reservation,
            ledger,
            time.perf_counter() - start_s,
            selection.tier_matched,
        )

    async def _select(
        self,
        ledger: PrefillLedger,
        req_id: str | None,
        query: PrefillQuery,
        workers: Sequence[WorkerHandle],
    ) -> tuple[Selection, Sequence[int]]:
        """``ledger``'s selection for ``query`` (its candidates left out) among ``workers``, and
        the indices in ``workers`` of the candidates it scored: all of them, or in a larger pool
        the holders of the prompt's prefix and a sample (see the module's docstring)."""
        considered: Sequence[int] = range(len(workers))
        holders: dict[str, int] | None = None
        if self._replica is not None and self._replica.ready:
            holders = self._replica.match(query.block_hashes)
            tier = self._replica.tier_blocks(query.block_hashes, holders)
            if not workers:
                return Selection((), None, holders, None, tier), considered
            query = dataclasses.replace(query, matched=holders, tier_matched=tier)
        if 0 < self._max_candidates < len(workers):
            if holders is None:
                matching = await ledger.select(None, query)
                holders = matching.matched
                query = dataclasses.replace(query, tier_matched=matching.tier_matched)
            ids = [_worker_id(w) for w in workers]
            considered = sample_candidates(ids, holders, self._max_candidates, self._rng)
            # The sample's scores use this match: the prompt is not matched a second time.
            query = dataclasses.replace(query, matched=holders)
        candidates = [_candidate_load(workers[i]) for i in considered]
        selection = await ledger.select(req_id, dataclasses.replace(query, candidates=candidates))
        reservation = selection.reservation
        if self._replica is not None and reservation is not None:
            self._replica.note_prediction(reservation.worker_id, reservation.recorded)
        return selection, considered

    def _tie_value(self, num_candidates: int) -> float:
        if self._policy is PrefillPolicy.ROUND_ROBIN and num_candidates:
            self._num_choices += 1
            return (self._num_choices % num_candidates + 0.5) / num_candidates
        return self._rng.random()

    def cancel(self, choice: PrefillChoice) -> None:
        """The chosen prefill ended without ``done`` (cancelled, or never answered): release
        its reservation (in the background). What the choice recorded in the prefix index stays:
        the worker may have computed it."""
        if choice.reservation is not None:
            self._background.spawn(self._release(choice.ledger, choice.reservation))

    async def withdraw(self, choice: PrefillChoice) -> None:
        """The chosen worker will not prefill the prompt (it is prefilled elsewhere): release
        the reservation and remove the blocks the choice recorded as the worker's from the
        prefix index, before the next choice can match them. A ledger error is logged: it costs
        affinity, never the request."""
        if choice.reservation is None:
            return
        if self._replica is not None:
            self._replica.note_withdrawal(choice.reservation.worker_id, choice.reservation.recorded)
        try:
            await choice.ledger.withdraw(choice.reservation)
        except Exception as exc:  # the reservation still ends with the heartbeat or max age
            logger.warning(
                "could not withdraw reservation %s: %r",
                choice.reservation.member,
                exc,
                extra=rate_limited("redis"),
            )

    def done(self, choice: PrefillChoice, response: worker_pb2.PrefillResponse | None) -> None:
        """The prefill ended, with the worker's ``response`` or without one (failed or
        cancelled). Releases the reservation and records predicted vs realized hits."""
        self.cancel(choice)
        if response is not None:
            self.record_hits(choice, response.num_cached_tokens, response.num_tier_tokens)

    def record_hits(
        self, choice: PrefillChoice, num_cached_tokens: int, num_tier_tokens: int = 0
    ) -> None:
        """The chosen worker found ``num_cached_tokens`` of the prompt cached, of which it
        loaded ``num_tier_tokens`` from its tier: count them against the blocks the index
        predicted, in all and in the tier."""
        worker = choice.worker
        if worker is None or worker.info is None:
            return
        block_size = worker.info.block_size
        hit_blocks = min(num_cached_tokens // block_size, len(choice.block_hashes))
        tier_hit_blocks = min(num_tier_tokens // block_size, hit_blocks)
        self.num_hit_blocks_predicted += choice.matched_blocks
        self.num_hit_blocks_realized += hit_blocks
        metrics.PREFIX_HITS_PREDICTED.inc(choice.matched_blocks)
        metrics.PREFIX_HITS_REALIZED.inc(hit_blocks)
        metrics.PREFIX_TIER_HITS_PREDICTED.inc(choice.tier_blocks)
        metrics.PREFIX_TIER_HITS_REALIZED.inc(tier_hit_blocks)

    async def forget(self, worker: WorkerHandle) -> None:
        """An in-process index drops what it assumed ``worker`` caches (its prefill failed; a
        restarted worker comes back empty)."""
        if self._local_index is not None and worker.info is not None:
            await self._local_index.clear(worker.info.worker_id)

    def start(self) -> None:
        """Start the ledger's background work (a Redis ledger's router heartbeat) and the
        replica's following of the index's stream."""
        self.ledger.start()
        if self._replica is not None:
            self._replica.start()

    async def close(self) -> None:
        if self._replica is not None:
            await self._replica.close()
        await self.ledger.close()

    @staticmethod
    async def _release(ledger: PrefillLedger, reservation: Reservation) -> None:
        try:
            await ledger.release(reservation)
        except Exception as exc:  # it ends with this router's heartbeat or its max age
            logger.warning(
                "could not release reservation %s: %r",
                reservation.member,
                exc,
                extra=rate_limited("redis"),
            )


def _worker_id(worker: WorkerHandle) -> str:
    assert worker.info is not None  # the chooser takes only workers that answered a poll
    return worker.info.worker_id


def _candidate_load(worker: WorkerHandle) -> CandidateLoad:
    assert worker.info is not None
    block_size = worker.info.block_size
    queued_blocks = worker.load.num_queued_prefill_tokens / block_size
    return CandidateLoad(
        worker.info.worker_id, queued_blocks, tier_load_cost(worker.load, block_size)
    )


def tier_load_cost(load: worker_pb2.WorkerLoad, block_size: int) -> float:
    """Blocks of compute that loading one block from the worker's tier costs, from what it
    measured (``load``): 0 without a tier, or before it has measured both."""
    compute_s_per_block = load.prefill_s_per_token * block_size
    if load.tier_load_s_per_block <= 0 or compute_s_per_block <= 0:
        return 0.0
    return load.tier_load_s_per_block / compute_s_per_block


def sample_candidates(
    worker_ids: Sequence[str], matched: dict[str, int], k: int, rng: random.Random
) -> list[int]:
    """The indices (ascending) of ``k`` of ``worker_ids`` to score: the workers holding the
    longest prefixes of the prompt (``matched``: worker id -> leading blocks held), at most
    ``k // 2`` of them (ties broken at random), then a uniform sample of the rest."""
    holders = [i for i, w in enumerate(worker_ids) if matched.get(w, 0) > 0]
    rng.shuffle(holders)
    holders.sort(key=lambda i: -matched[worker_ids[i]])
    chosen = set(holders[: k // 2])
    others = [i for i in range(len(worker_ids)) if i not in chosen]
    chosen.update(rng.sample(others, min(k - len(chosen), len(others))))
    return sorted(chosen)
