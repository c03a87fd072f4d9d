"""Where a request runs: its prefill worker (or none) and its decode worker.

Conditional disaggregation: the decode worker prefills the prompt itself, skipping the prefill
pool and the KV transfer, when

- the part of the prompt it does not cache is at most ``local_prefill_max_tokens`` (moving a
  short prefill costs more than computing it in the decode batch; the default comes from the
  crossover measured in BENCHMARKS.md), or
- every prefill worker is saturated (``prefill_cost``), or no prefill worker is healthy, or
- the prompt's priority is better than every prefill the router has on the chosen prefill
  worker, at most ``priority_local_prefill_max_tokens`` of it are uncached, and the decode
  worker schedules by priority: on the prefill worker it would wait for the lower-priority
  prefill step in progress (a whole batch of prompts), while the decode worker's scheduler
  admits it first into a step of decodes, which is short.

One ledger call gives both the prefill decision and the prefix matches the decode choice uses.

Colocated mode has no prefill pool: the worker that prefills is the one that decodes, so the
decode worker is chosen by the prefill cost (prefix hits, queued prefill work, bounded load)
over the decode pool, and the prompt's blocks are recorded as its own at once, so that the next
request with the same prefix follows it.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

from engine.block_hash import BlockHash, hash_block_tokens
from services.common.prefix_index import InProcessPrefixIndex
from services.common.roles import ClusterMode
from services.router import metrics
from services.router.config import RouterConfig
from services.router.decode_choice import DecodeCandidate, DecodeChooser
from services.router.prefill_choice import PrefillChoice, PrefillChooser, PrefillPolicy
from services.router.prefill_cost import PrefillWeights
from services.router.prefill_ledger import LocalPrefillLedger, PrefillLedger
from services.router.prefix_replica import PrefixIndexReplica
from services.router.redis_prefill_ledger import RedisPrefillLedger
from services.router.worker_pool import ServedTarget, WorkerHandle, WorkerPool


class PrefillPlace(enum.Enum):
    """Where a prompt is prefilled, and why there."""

    PREFILL_WORKER = "prefill_worker"
    SHORT_UNCACHED = "short_uncached"  # the decode worker computes the short uncached part
    SATURATED = "saturated"  # every prefill worker has too much queued
    NO_PREFILL_WORKER = "no_prefill_worker"  # none healthy
    COLOCATED = "colocated"  # colocated mode: the decode worker chosen by the prefill cost
    KV_CANNOT_MOVE = "kv_cannot_move"  # the decode worker cannot read the prefill worker's KV
    PRIORITY = "priority"  # better priority than the prefill worker's work: not behind it


@dataclass(frozen=True, slots=True)
class PeerPull:
    """Pull the prompt's first ``num_blocks`` blocks from ``source``, whose cache holds them,
    instead of computing them on the prefill worker (which holds fewer)."""

    source: WorkerHandle
    num_blocks: int


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """The decision for one request; ``prefill.reservation`` is held only when the place is
    ``PREFILL_WORKER`` or ``COLOCATED`` (release it with ``PrefillChooser.done`` or ``cancel``
    once the prompt is prefilled); otherwise the planner has withdrawn it
    (``PrefillChooser.withdraw``)."""

    prefill: PrefillChoice
    place: PrefillPlace
    decode_candidates: tuple[DecodeCandidate, ...]
    decode: DecodeCandidate | None
    peer_pull: PeerPull | None = None  # only with place PREFILL_WORKER

    @property
    def prefill_worker(self) -> WorkerHandle | None:
        return self.prefill.worker if self.place is PrefillPlace.PREFILL_WORKER else None


class RoutePlanner:
    """Combines the prefill and decode choices for each request."""

    def __init__(
        self,
        prefill_chooser: PrefillChooser,
        decode_chooser: DecodeChooser,
        *,
        local_prefill_max_tokens: int,
        priority_local_prefill_max_tokens: int = 0,
        colocated: bool = False,
        peer_pull_min_tokens: int = 0,
    ) -> None:
        """In ``colocated`` mode ``prefill_chooser`` must score the decode pool. A plan pulls a
        prefix from a peer when that peer caches at least ``peer_pull_min_tokens`` more of it
        than the prefill worker (0: never)."""
        self.prefill_chooser = prefill_chooser
        self.decode_chooser = decode_chooser
        self._local_prefill_max_tokens = local_prefill_max_tokens
        self._priority_local_prefill_max_tokens = priority_local_prefill_max_tokens
        self._colocated = colocated
        self._peer_pull_min_tokens = peer_pull_min_tokens

    def block_size(self, target: ServedTarget | None = None) -> int:
        """The KV block size of ``target``'s model, as the first of its workers that answered
        reports it (0 before one has)."""
        pools = (self.decode_chooser.pool, self.prefill_chooser.pool)
        for worker in (w for pool in pools for w in pool.workers):
            if worker.info is not None and (target is None or worker.serves_model(target.model)):
                return worker.info.block_size
        return 0

    async def plan(
        self,
        req_id: str | None,
        prompt_token_ids: Sequence[int],
        extra_key: str = "",
        target: ServedTarget | None = None,
        priority: int | None = None,
    ) -> RoutePlan:
        """Decide for a prompt. With a ``req_id`` the prefill worker is reserved (when one is
        used); without, nothing is (``Router.Explain``). Only blocks hashed with the same
        ``extra_key`` (``block_extra_key`` of its salt and adapter, as the workers hash) count
        as hits; only workers serving ``target`` (a model, maybe an adapter) are
        candidates. ``priority`` (lower first; None: the default, 0) may keep the prompt off
        a prefill worker busy with worse-priority prefills."""
        block_size = self.block_size(target)
        block_hashes = (
            hash_block_tokens(prompt_token_ids, block_size, extra_key) if block_size else []
        )
        if self._colocated:
            return await self._plan_colocated(req_id, block_hashes, target)
        short = len(prompt_token_ids) <= self._local_prefill_max_tokens
        # A worker not yet answered may be of the model: the pool exists, as before it answers.
        has_prefill_pool = any(
            target is None or w.info is None or w.serves_model(target.model)
            for w in self.prefill_chooser.pool.workers
        )
        choice = await self.prefill_chooser.choose(
            req_id,
            block_hashes,
            with_candidates=has_prefill_pool and not short,
            target=target,
        )
        decode_candidates = tuple(
            self.decode_chooser.score(len(block_hashes), choice.matched, target=target)
        )
        decode = self.decode_chooser.pick(decode_candidates)
        if choice.worker is not None:
            uncached_tokens = len(prompt_token_ids) - (
                decode.matched_blocks * block_size if decode is not None else 0
            )
            if decode is not None and not kv_can_move(choice.worker, decode.worker):
                await self.prefill_chooser.withdraw(choice)
                place = PrefillPlace.KV_CANNOT_MOVE
            elif uncached_tokens > self._local_prefill_max_tokens:
                if decode is not None and self._skips_busy_prefill(
                    choice.worker, decode.worker, priority or 0, uncached_tokens
                ):
                    await self.prefill_chooser.withdraw(choice)
                    place = PrefillPlace.PRIORITY
                else:
                    place = PrefillPlace.PREFILL_WORKER
            else:
                await self.prefill_chooser.withdraw(choice)
                place = PrefillPlace.SHORT_UNCACHED
        elif short and has_prefill_pool:
            place = PrefillPlace.SHORT_UNCACHED
        elif choice.saturated:
            place = PrefillPlace.SATURATED
        else:
            place = PrefillPlace.NO_PREFILL_WORKER
        if req_id is not None and has_prefill_pool and place is not PrefillPlace.PREFILL_WORKER:
            metrics.LOCAL_PREFILLS.labels(place.value).inc()
        peer_pull = None
        if place is PrefillPlace.PREFILL_WORKER:
            max_blocks = (len(prompt_token_ids) - 1) // block_size
            peer_pull = self._peer_pull(choice, max_blocks, block_size, target)
        return RoutePlan(choice, place, decode_candidates, decode, peer_pull)

    def _peer_pull(
        self,
        choice: PrefillChoice,
        max_blocks: int,
        block_size: int,
        target: ServedTarget | None,
    ) -> PeerPull | None:
        """The routable worker (either pool) whose cache holds the longest run of the prompt's
        first ``max_blocks`` blocks, when it holds ``peer_pull_min_tokens`` more than the
        chosen prefill worker and its KV can move there; None otherwise.

        Pulling a block costs a fraction of a millisecond on every KV backend, computing it
        tens (BENCHMARKS.md, "What a block costs"); the threshold pays for the pin's round
        trip."""
        prefill = choice.worker
        if self._peer_pull_min_tokens <= 0 or prefill is None:
            return None
        own_blocks = choice.matched_blocks
        most_blocks = min(max(choice.matched.values(), default=0), max_blocks)
        if (most_blocks - own_blocks) * block_size < self._peer_pull_min_tokens:
            return None  # the common case: no worker holds enough more (no pool walk)
        best: PeerPull | None = None
        pools = (self.prefill_chooser.pool, self.decode_chooser.pool)
        for worker in (w for pool in pools for w in pool.routable_workers(target)):
            if worker is prefill or worker.info is None:
                continue
            num_blocks = min(choice.matched.get(worker.info.worker_id, 0), max_blocks)
            if (num_blocks - own_blocks) * block_size < self._peer_pull_min_tokens:
                continue
            if (best is None or num_blocks > best.num_blocks) and kv_can_move(worker, prefill):
                best = PeerPull(worker, num_blocks)
        return best

    def _skips_busy_prefill(
        self, prefill: WorkerHandle, decode: WorkerHandle, priority: int, uncached_tokens: int
    ) -> bool:
        """Whether a prompt of ``priority`` with ``uncached_tokens`` to compute goes to its
        ``decode`` worker (which must schedule by priority) rather than wait behind
        ``prefill``'s worse-priority prefills."""
        return (
            uncached_tokens <= self._priority_local_prefill_max_tokens
            and decode.schedules_by_priority
            and prefill.prefills_only_worse_than(priority)
        )

    async def _plan_colocated(
        self, req_id: str | None, block_hashes: Sequence[BlockHash], target: ServedTarget | None
    ) -> RoutePlan:
        choice = await self.prefill_chooser.choose(req_id, block_hashes, target=target)
        candidates = tuple(
            self.decode_chooser.score(len(block_hashes), choice.matched, target=target)
        )
        chosen = [c for c in candidates if c.worker is choice.worker]
        # Every worker saturated, or the chosen one unhealthy since: the least busy one.
        decode = chosen[0] if chosen else self.decode_chooser.pick(candidates)
        if not chosen:
            await self.prefill_chooser.withdraw(choice)
            choice = replace(choice, reservation=None)
        return RoutePlan(choice, PrefillPlace.COLOCATED, candidates, decode)


def kv_can_move(prefill: WorkerHandle, decode: WorkerHandle) -> bool:
    """Whether ``decode`` can read KV that ``prefill`` computes: both engines expose a KV cache
    (a vLLM worker's only at tensor and pipeline parallel size 1) of one layout
    (``compat_hash``: never a native and a vLLM worker) over one backend.
    Unknown until both have answered ``GetInfo``: assumed, as a failed pairing still falls back
    to local prefill."""
    if prefill.info is None or decode.info is None:
        return True
    source, reader = prefill.info, decode.info
    if not source.HasField("kv_peer") or not reader.HasField("kv_peer"):
        return False
    return (source.kv_peer.backend, source.kv_peer.compat_hash) == (
        reader.kv_peer.backend,
        reader.kv_peer.compat_hash,
    )


def build_planner(
    config: RouterConfig,
    router_id: str,
    prefill_pool: WorkerPool,
    decode_pool: WorkerPool,
    rng: random.Random,
) -> RoutePlanner:
    """The planner ``config`` describes: prefix index and ledger (Redis, or in process), the
    prefill chooser over the prefill pool (colocated: the decode pool) and the decode chooser.
    ``router_id`` (``RouterConfig.resolved_router_id``, resolved once by the router) names this
    router's reservations."""
    local_index: InProcessPrefixIndex | None = None
    replica: PrefixIndexReplica | None = None
    ledger: PrefillLedger
    if config.redis.enabled:
        stream_len = config.redis.redis_kv_event_stream_len
        ledger = RedisPrefillLedger(
            config.redis.client(),
            router_id,
            config.router_heartbeat_ttl_s,
            config.redis.redis_namespace,
            stream_len,
        )
        if stream_len > 0:
            replica = PrefixIndexReplica(config.redis.client(), config.redis.redis_namespace)
    else:
        local_index = InProcessPrefixIndex()
        ledger = LocalPrefillLedger(router_id, local_index)
    # Each weight is the router flag of its name after --prefill-.
    weights = PrefillWeights(
        **{f.name: getattr(config, f"prefill_{f.name}") for f in fields(PrefillWeights)}
    )
    colocated = config.mode is ClusterMode.COLOCATED
    prefill_chooser = PrefillChooser(
        decode_pool if colocated else prefill_pool,
        ledger,
        local_index=local_index,
        weights=weights,
        router_id=router_id,
        rng=rng,
        policy=PrefillPolicy(config.prefill_policy),
        max_candidates=config.prefill_max_candidates,
        replica=replica,
        select_timeout_s=config.prefix_index_timeout_s,
    )
    decode_chooser = DecodeChooser(
        decode_pool,
        load_weight=config.decode_load_weight,
        move_weight=config.decode_move_weight,
        rng=rng,
    )
    return RoutePlanner(
        prefill_chooser,
        decode_chooser,
        local_prefill_max_tokens=config.local_prefill_max_tokens,
        priority_local_prefill_max_tokens=config.priority_local_prefill_max_tokens,
        colocated=colocated,
        peer_pull_min_tokens=config.peer_pull_min_tokens,
    )
