"""Which prefill worker computes a prompt: the one with the least work, counted in blocks.

For each healthy prefill worker (Dynamo-style, DESIGN §3)::

    cost = cache_weight * (prompt_blocks - matched_blocks) + load_weight * queued_blocks

``matched_blocks`` are the prompt's leading blocks the worker already caches (from the prefix
index); ``queued_blocks`` is the prefill work it has queued (its last reported queue plus what
this router sent it since, both in blocks). Ties go to a seeded random choice.

With a Redis index the workers publish what they cache. Without one the router keeps an
in-process index of its own choices (a worker that computed a prompt is assumed to cache it
until it stops being healthy): approximate, like SGLang's router tree, and a stale index only
costs affinity. A slow or unreachable index costs the prefix term, never a request.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

from engine.block_hash import BlockHash, hash_block_tokens
from services.common.prefix_index import PrefixIndex
from services.router import metrics
from services.router.worker_pool import WorkerHandle, WorkerPool
from splitserve.v1 import worker_pb2

logger = logging.getLogger(__name__)

# How long the router waits for the index before routing on load alone.
_MATCH_TIMEOUT_S = 0.05
# TTL of the router's own liveness entries in an in-process index (refreshed at every choice).
_LOCAL_TTL_S = 3600.0


@dataclass(frozen=True, slots=True)
class PrefillCandidate:
    """One worker's score for a prompt."""

    worker: WorkerHandle
    matched_blocks: int
    queued_blocks: float
    cost: float


@dataclass(frozen=True, slots=True)
class PrefillChoice:
    """The chosen worker, the prompt's block hashes and every candidate's score."""

    worker: WorkerHandle
    block_hashes: tuple[BlockHash, ...]
    candidates: tuple[PrefillCandidate, ...]

    @property
    def matched_blocks(self) -> int:
        return next(c.matched_blocks for c in self.candidates if c.worker is self.worker)

    @property
    def uncached_blocks(self) -> int:
        return len(self.block_hashes) - self.matched_blocks


class PrefillChooser:
    """Scores the prefill pool against the prefix index; call ``done`` after each prefill."""

    def __init__(
        self,
        pool: WorkerPool,
        index: PrefixIndex,
        *,
        index_is_local: bool,
        cache_weight: float,
        load_weight: float,
        rng: random.Random,
    ) -> None:
        self.pool = pool
        self.index = index
        self._index_is_local = index_is_local
        self._cache_weight = cache_weight
        self._load_weight = load_weight
        self._rng = rng
        self._sent_blocks: dict[str, int] = {}  # worker address -> uncached blocks in flight

    async def choose(self, prompt_token_ids: Sequence[int]) -> PrefillChoice | None:
        """Pick the cheapest healthy worker and count the prompt's uncached blocks as queued on
        it until ``done``; None when no worker is healthy."""
        choice = await self.score(prompt_token_ids)
        if choice is not None:
            address = choice.worker.address
            self._sent_blocks[address] = self._sent_blocks.get(address, 0) + choice.uncached_blocks
        return choice

    async def score(self, prompt_token_ids: Sequence[int]) -> PrefillChoice | None:
        """What ``choose`` would pick, without reserving anything (``Router.Explain``)."""
        workers = self.pool.healthy_workers()
        if not workers:
            return None
        block_size = workers[0].info.block_size if workers[0].info is not None else 0
        block_hashes = tuple(hash_block_tokens(prompt_token_ids, block_size)) if block_size else ()
        matched = await self._match(block_hashes)
        candidates = tuple(self._score(w, matched, len(block_hashes)) for w in workers)
        best = min(c.cost for c in candidates)
        chosen = self._rng.choice([c for c in candidates if c.cost == best])
        return PrefillChoice(chosen.worker, block_hashes, candidates)

    async def done(
        self, choice: PrefillChoice, response: worker_pb2.PrefillResponse | None
    ) -> None:
        """The prefill ended, with the worker's ``response`` or without one (failed or
        cancelled). Records predicted vs realized hits and feeds an in-process index."""
        address = choice.worker.address
        self._sent_blocks[address] -= choice.uncached_blocks
        if response is None or choice.worker.info is None:
            return
        hit_blocks = response.num_cached_tokens // choice.worker.info.block_size
        metrics.PREFIX_HITS_PREDICTED.inc(choice.matched_blocks)
        metrics.PREFIX_HITS_REALIZED.inc(min(hit_blocks, len(choice.block_hashes)))
        if self._index_is_local and choice.block_hashes:
            worker_id = choice.worker.info.worker_id
            await self.index.store(worker_id, choice.block_hashes)
            await self.index.heartbeat(worker_id, _LOCAL_TTL_S)

    async def forget(self, worker: WorkerHandle) -> None:
        """An in-process index drops what it assumed ``worker`` caches (its prefill failed; a
        restarted worker comes back empty)."""
        if self._index_is_local and worker.info is not None:
            await self.index.clear(worker.info.worker_id)

    async def _match(self, block_hashes: tuple[BlockHash, ...]) -> dict[str, int]:
        if not block_hashes:
            return {}
        try:
            return await asyncio.wait_for(self.index.match(block_hashes), _MATCH_TIMEOUT_S)
        except Exception as exc:  # Redis down or slow: route on load alone
            metrics.PREFIX_INDEX_ERRORS.inc()
            logger.warning("prefix index lookup failed (%r); routing on load only", exc)
            return {}

    def _score(
        self, worker: WorkerHandle, matched: dict[str, int], prompt_blocks: int
    ) -> PrefillCandidate:
        worker_id = worker.info.worker_id if worker.info is not None else ""
        matched_blocks = min(matched.get(worker_id, 0), prompt_blocks)
        block_size = worker.info.block_size if worker.info is not None else 1
        queued_blocks = worker.load.num_queued_prefill_tokens / block_size + self._sent_blocks.get(
            worker.address, 0
        )
        cost = (
            self._cache_weight * (prompt_blocks - matched_blocks)
            + self._load_weight * queued_blocks
        )
        return PrefillCandidate(worker, matched_blocks, queued_blocks, cost)
