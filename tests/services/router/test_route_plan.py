"""``RoutePlanner`` as ``build_planner`` wires it without Redis (in-process prefix index and
ledger), over fake workers: one table row per placement the planner can return, checked the way
``Router.Explain`` reports it and then as a real request (reservation, metric) would get it.

The processes-and-Redis versions of these behaviours are ``tests/services/test_route_plan.py``,
``test_prefix_routing.py`` and ``test_colocated_routing.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from dataclasses import dataclass, field

import pytest
from prometheus_client import REGISTRY

from engine.block_hash import hash_block_tokens
from services.common.prefix_index import InProcessPrefixIndex
from services.router.config import RouterConfig
from services.router.explain import explain_response
from services.router.prefill_cost import CandidateLoad, PrefillWeights
from services.router.prefill_ledger import PrefillLedger, PrefillQuery, Reservation, Selection
from services.router.route_plan import PrefillPlace, RoutePlan, RoutePlanner, build_planner
from splitserve.v1 import worker_pb2
from tests.services.router.fakes import BLOCK_SIZE, DECODE, PREFILL, W, make_pool

LOCAL_MAX_TOKENS = 32  # --local-prefill-max-tokens (the default)
SATURATION_BLOCKS = 8  # --prefill-saturation-blocks
LONG = 100  # 6 full blocks: more than LOCAL_MAX_TOKENS
PEER_PULL_MIN_TOKENS = 16  # --peer-pull-min-tokens (the default): one block
SHORT = 30  # 1 full block
LIVE_S = 3600.0

# p0 is the cheaper prefill worker (p1 has 2 blocks queued); d0 the cheaper decode worker.
PREFILL2 = (W("p0"), W("p1", queued_prefill_tokens=2 * BLOCK_SIZE))
DECODE2 = (W("d0"), W("d1", running=1))
SAME = "same as want_prefill"


@dataclass(frozen=True, slots=True)
class PlanCase:
    prefill: tuple[W, ...]
    decode: tuple[W, ...]
    prompt_len: int
    want_place: PrefillPlace
    want_prefill: str | None  # RoutePlan.prefill_worker: where the prompt is prefilled
    want_decode: str | None
    # Leading prompt blocks each worker holds in the prefix index (it is live in it).
    hits: dict[str, int] = field(default_factory=dict)
    # Blocks reserved per worker once a real request is planned (the prefill worker's lease).
    want_reserved: dict[str, int] = field(default_factory=dict)
    want_chosen: str | None = SAME  # the prefill chooser's pick, used or not
    colocated: bool = False
    local_prefill_max_tokens: int = LOCAL_MAX_TOKENS
    # The peer the prefill worker pulls the prefix from, and how many blocks (None: none).
    want_peer: tuple[str, int] | None = None
    peer_pull_min_tokens: int = PEER_PULL_MIN_TOKENS


def prompt_tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 480) for _ in range(n)]


def make_planner(
    prefill: tuple[W, ...],
    decode: tuple[W, ...],
    *,
    colocated: bool = False,
    local_prefill_max_tokens: int = LOCAL_MAX_TOKENS,
    peer_pull_min_tokens: int = PEER_PULL_MIN_TOKENS,
) -> RoutePlanner:
    config = RouterConfig(
        model="unused",
        mode="colocated" if colocated else "disaggregated",
        router_id="router-test",
        local_prefill_max_tokens=local_prefill_max_tokens,
        peer_pull_min_tokens=peer_pull_min_tokens,
        prefill_saturation_blocks=SATURATION_BLOCKS,
    )
    # As the router does: colocated mode has no prefill pool.
    prefill_pool = make_pool(PREFILL, () if colocated else prefill)
    return build_planner(
        config, "router-test", prefill_pool, make_pool(DECODE, decode), random.Random(0)
    )


def index_of(planner: RoutePlanner) -> InProcessPrefixIndex:
    """The in-process index ``build_planner`` made (it exposes none: a private attribute)."""
    index = planner.prefill_chooser._local_index
    assert isinstance(index, InProcessPrefixIndex)
    return index


async def seed_hits(planner: RoutePlanner, prompt: list[int], hits: dict[str, int]) -> None:
    """Workers publishing their caches: ``hits`` = worker id -> leading blocks it holds."""
    index = index_of(planner)
    hashes = hash_block_tokens(prompt, BLOCK_SIZE)
    for worker_id, num_blocks in hits.items():
        await index.store(worker_id, hashes[:num_blocks])
        await index.heartbeat(worker_id, LIVE_S)


async def reserved(planner: RoutePlanner) -> dict[str, int]:
    """Blocks reserved in the planner's ledger, per worker with a reservation."""
    await asyncio.sleep(0)  # let the releases that ``cancel`` spawned run (no time passes)
    pools = (planner.prefill_chooser.pool, planner.decode_chooser.pool)
    loads = [CandidateLoad(w.address, 0.0) for pool in pools for w in pool.workers]
    query = PrefillQuery((), loads, PrefillWeights(), 0)
    selection = await planner.prefill_chooser.ledger.select(None, query)
    return {s.worker_id: s.reserved_blocks for s in selection.scores if s.reserved_requests}


def local_prefills(place: PrefillPlace) -> float:
    value = REGISTRY.get_sample_value(
        "splitserve_router_local_prefills_total", {"reason": place.value}
    )
    return value or 0.0


def address(worker: object) -> str | None:
    return None if worker is None else worker.address  # type: ignore[attr-defined]


def check_plan(plan: RoutePlan, case: PlanCase, prompt_len: int) -> None:
    want_chosen = case.want_prefill if case.want_chosen == SAME else case.want_chosen
    assert plan.place is case.want_place
    assert address(plan.prefill_worker) == case.want_prefill
    assert address(plan.prefill.worker) == want_chosen
    assert address(plan.decode.worker if plan.decode else None) == case.want_decode
    assert len(plan.prefill.block_hashes) == prompt_len // BLOCK_SIZE
    routable = [w.address for w in case.decode if w.healthy and not (w.draining or w.shutting_down)]
    assert sorted(c.worker.address for c in plan.decode_candidates) == sorted(routable)
    peer = plan.peer_pull
    assert (None if peer is None else (peer.source.address, peer.num_blocks)) == case.want_peer


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            PlanCase(PREFILL2, DECODE2, LONG, PrefillPlace.PREFILL_WORKER, "p0", "d0",
                     want_reserved={"p0": 6}),
            id="a-long-prompt-goes-to-the-cheapest-prefill-worker",
        ),
        pytest.param(
            # p1: 0 uncached + 0.5 * 2 queued = 1 < p0: 6 uncached. Nothing left to reserve.
            PlanCase(PREFILL2, DECODE2, LONG, PrefillPlace.PREFILL_WORKER, "p1", "d0",
                     hits={"p1": 6}, want_reserved={"p1": 0}),
            id="the-prefill-worker-caching-the-prefix",
        ),
        pytest.param(
            # p1: 5 uncached + 0.5 * 20 queued = 15 > p0: 6. p0 pulls p1's one block.
            PlanCase((W("p0"), W("p1", queued_prefill_tokens=20 * BLOCK_SIZE)), DECODE2, LONG,
                     PrefillPlace.PREFILL_WORKER, "p0", "d0", hits={"p1": 1},
                     want_reserved={"p0": 6}, want_peer=("p1", 1)),
            id="queued-work-outweighs-a-short-prefix-hit",
        ),
        pytest.param(
            PlanCase(PREFILL2, DECODE2, SHORT, PrefillPlace.SHORT_UNCACHED, None, "d0"),
            id="a-short-prompt-is-prefilled-on-the-decode-worker",
        ),
        pytest.param(
            PlanCase(PREFILL2, DECODE2, LOCAL_MAX_TOKENS, PrefillPlace.SHORT_UNCACHED, None, "d0"),
            id="local-prefill-max-tokens-exactly-is-short",
        ),
        pytest.param(
            PlanCase(PREFILL2, DECODE2, LOCAL_MAX_TOKENS + 1, PrefillPlace.PREFILL_WORKER, "p0",
                     "d0", want_reserved={"p0": 2}),
            id="one-token-more-goes-to-the-prefill-pool",
        ),
        pytest.param(
            # d0 caches 96 of the 100 tokens: the chosen prefill worker's reservation is dropped.
            PlanCase(PREFILL2, DECODE2, LONG, PrefillPlace.SHORT_UNCACHED, None, "d0",
                     hits={"d0": 6}, want_chosen="p0"),
            id="a-decode-worker-caching-the-prefix-computes-the-rest",
        ),
        pytest.param(
            # p0 computes the rest after pulling d0's two blocks; d0 then pulls the prompt.
            PlanCase(PREFILL2, DECODE2, LONG, PrefillPlace.PREFILL_WORKER, "p0", "d0",
                     hits={"d0": 2}, want_reserved={"p0": 6}, want_peer=("d0", 2)),
            id="a-decode-worker-caching-part-of-the-prefix-still-pulls-it",
        ),
        pytest.param(
            # d1 caches it all but is busier: d0 is chosen, and it caches nothing. The prefill
            # worker pulls the prefix from d1 rather than compute it.
            PlanCase(PREFILL2, DECODE2, LONG, PrefillPlace.PREFILL_WORKER, "p0", "d0",
                     hits={"d1": 6}, want_reserved={"p0": 6}, want_peer=("d1", 6)),
            id="only-the-chosen-decode-workers-cache-counts",
        ),
        pytest.param(
            # p1 caches the prefix but has 20 blocks queued (10 > p0's 6): bounded by its load,
            # the prompt goes to p0, which pulls the prefix from p1.
            PlanCase((W("p0"), W("p1", queued_prefill_tokens=20 * BLOCK_SIZE)), DECODE2, LONG,
                     PrefillPlace.PREFILL_WORKER, "p0", "d0", hits={"p1": 6},
                     want_reserved={"p0": 6}, want_peer=("p1", 6)),
            id="a-busy-holder-of-the-prefix-is-its-peer-source",
        ),
        pytest.param(
            PlanCase((W("p0"), W("p1", queued_prefill_tokens=20 * BLOCK_SIZE)), DECODE2, LONG,
                     PrefillPlace.PREFILL_WORKER, "p0", "d0", hits={"p1": 6},
                     want_reserved={"p0": 6}, peer_pull_min_tokens=0),
            id="peer-pull-min-tokens-0-never-pulls",
        ),
        pytest.param(
            # 6 - 3 blocks = 48 tokens more than p0 holds: under a threshold of 64.
            PlanCase((W("p0"), W("p1", queued_prefill_tokens=20 * BLOCK_SIZE)), DECODE2, LONG,
                     PrefillPlace.PREFILL_WORKER, "p0", "d0", hits={"p0": 3, "p1": 6},
                     want_reserved={"p0": 3}, peer_pull_min_tokens=64),
            id="a-peer-holding-too-little-more-is-not-pulled-from",
        ),
        pytest.param(
            PlanCase(PREFILL2, (W("d0"), W("d1", running=1, kv_layout="bfloat16-cache")), LONG,
                     PrefillPlace.PREFILL_WORKER, "p0", "d0", hits={"d1": 6},
                     want_reserved={"p0": 6}),
            id="a-peer-whose-kv-cannot-move-is-not-pulled-from",
        ),
        pytest.param(
            PlanCase((W("p0", queued_prefill_tokens=10 * BLOCK_SIZE),
                      W("p1", queued_prefill_tokens=SATURATION_BLOCKS * BLOCK_SIZE)),
                     DECODE2, LONG, PrefillPlace.SATURATED, None, "d0"),
            id="every-prefill-worker-saturated",
        ),
        pytest.param(
            PlanCase((W("p0", queued_prefill_tokens=10 * BLOCK_SIZE),
                      W("p1", queued_prefill_tokens=(SATURATION_BLOCKS - 1) * BLOCK_SIZE)),
                     DECODE2, LONG, PrefillPlace.PREFILL_WORKER, "p1", "d0",
                     want_reserved={"p1": 6}),
            id="one-prefill-worker-below-saturation-takes-it",
        ),
        pytest.param(
            PlanCase((), DECODE2, LONG, PrefillPlace.NO_PREFILL_WORKER, None, "d0"),
            id="no-prefill-pool",
        ),
        pytest.param(
            PlanCase((), DECODE2, SHORT, PrefillPlace.NO_PREFILL_WORKER, None, "d0"),
            id="no-prefill-pool-short-prompt",
        ),
        pytest.param(
            PlanCase((W("p0", healthy=False), W("p1", healthy=False)), DECODE2, LONG,
                     PrefillPlace.NO_PREFILL_WORKER, None, "d0"),
            id="every-prefill-worker-unhealthy",
        ),
        pytest.param(
            PlanCase((W("p0", draining=True), W("p1", shutting_down=True)), DECODE2, LONG,
                     PrefillPlace.NO_PREFILL_WORKER, None, "d0"),
            id="prefill-workers-draining-or-shutting-down",
        ),
        pytest.param(
            PlanCase((W("p0", healthy=False),), DECODE2, SHORT, PrefillPlace.SHORT_UNCACHED,
                     None, "d0"),
            id="a-short-prompt-with-no-healthy-prefill-worker",
        ),
        pytest.param(
            PlanCase((W("p0", healthy=False), W("p1", queued_prefill_tokens=64)), DECODE2, LONG,
                     PrefillPlace.PREFILL_WORKER, "p1", "d0", want_reserved={"p1": 6}),
            id="the-only-healthy-prefill-worker",
        ),
        pytest.param(
            PlanCase(PREFILL2, DECODE2, 5, PrefillPlace.PREFILL_WORKER, "p0", "d0",
                     want_reserved={"p0": 0}, local_prefill_max_tokens=0),
            id="local-prefill-max-tokens-0-always-uses-the-pool",
        ),
        pytest.param(
            # The prefill is still planned (and reserved) with no decode worker to take it.
            PlanCase(PREFILL2, (W("d0", healthy=False),), LONG, PrefillPlace.PREFILL_WORKER,
                     "p0", None, want_reserved={"p0": 6}),
            id="no-routable-decode-worker",
        ),
        pytest.param(
            # The replica is chosen by the prefill cost (d1: 6 < d0: 6 + 0.5 * 4), not by the
            # decode cost (which would prefer the idle d0).
            PlanCase((), (W("d0", queued_prefill_tokens=4 * BLOCK_SIZE), W("d1", running=1)),
                     LONG, PrefillPlace.COLOCATED, None, "d1", want_chosen="d1",
                     colocated=True, want_reserved={"d1": 6}),
            id="colocated-the-replica-with-the-least-prefill-cost",
        ),
        pytest.param(
            # The decode worker cannot read the prefill worker's KV: it prefills the prompt.
            PlanCase(PREFILL2, (W("d0", kv_layout=None),), LONG, PrefillPlace.KV_CANNOT_MOVE,
                     None, "d0", want_chosen="p0"),
            id="decode-engine-without-kv-transfer",
        ),
        pytest.param(
            PlanCase(PREFILL2, (W("d0", kv_layout="bfloat16-cache"),), LONG,
                     PrefillPlace.KV_CANNOT_MOVE, None, "d0", want_chosen="p0"),
            id="decode-kv-layout-differs",
        ),
        pytest.param(
            PlanCase((), (W("d0", running=2), W("d1")), LONG, PrefillPlace.COLOCATED, None, "d0",
                     hits={"d0": 6}, want_chosen="d0", colocated=True,
                     want_reserved={"d0": 0}),
            id="colocated-the-replica-caching-the-prefix",
        ),
        pytest.param(
            PlanCase((), (W("d0", queued_prefill_tokens=64), W("d1", running=1)), SHORT,
                     PrefillPlace.COLOCATED, None, "d1", want_chosen="d1", colocated=True,
                     want_reserved={"d1": 1}),
            id="colocated-short-prompts-too",
        ),
        pytest.param(
            # Nothing chosen by the prefill cost: the least busy replica, with no reservation.
            PlanCase((), (W("d0", running=2, queued_prefill_tokens=10 * BLOCK_SIZE),
                          W("d1", running=1, queued_prefill_tokens=10 * BLOCK_SIZE)),
                     LONG, PrefillPlace.COLOCATED, None, "d1", want_chosen=None, colocated=True),
            id="colocated-every-replica-saturated",
        ),
        pytest.param(
            PlanCase((), (W("d0", healthy=False),), LONG, PrefillPlace.COLOCATED, None, None,
                     want_chosen=None, colocated=True),
            id="colocated-no-routable-replica",
        ),
    ],
)  # fmt: skip
def test_route_plan_placements(case: PlanCase) -> None:
    async def main() -> None:
        planner = make_planner(
            case.prefill,
            case.decode,
            colocated=case.colocated,
            local_prefill_max_tokens=case.local_prefill_max_tokens,
            peer_pull_min_tokens=case.peer_pull_min_tokens,
        )
        prompt = prompt_tokens(case.prompt_len)
        await seed_hits(planner, prompt, case.hits)

        # Router.Explain: the same decision, reserving and recording nothing.
        explained = await planner.plan(None, prompt)
        check_plan(explained, case, len(prompt))
        assert explained.prefill.reservation is None
        assert await reserved(planner) == {}
        again = await planner.plan(None, prompt)
        assert again.prefill.candidates == explained.prefill.candidates
        response = explain_response(explained, len(prompt))
        assert response.prefill_place == case.want_place.value
        assert response.chosen_prefill == (case.want_prefill or "")
        assert response.chosen_decode == (case.want_decode or "")
        assert (response.peer_pull_source, response.peer_pull_blocks) == (case.want_peer or ("", 0))

        # Router.Generate: reserves the prefill worker it uses, counts a local prefill.
        before = local_prefills(case.want_place)
        plan = await planner.plan("req-1", prompt)
        check_plan(plan, case, len(prompt))
        assert await reserved(planner) == case.want_reserved
        counted = bool(case.prefill) and case.want_place is not PrefillPlace.PREFILL_WORKER
        assert local_prefills(case.want_place) == before + counted
        await planner.prefill_chooser.close()

    asyncio.run(main())


def test_a_routed_prompt_follows_its_prefill_worker_until_it_is_forgotten() -> None:
    """Without Redis the index holds the router's own choices: the chosen prefill worker is
    assumed to cache the prompt from the moment it is chosen, until it fails."""

    async def main() -> None:
        planner = make_planner(PREFILL2, DECODE2)
        chooser = planner.prefill_chooser
        p0 = chooser.pool.workers[0]
        prompt = prompt_tokens(LONG)
        first = await planner.plan("a", prompt)
        assert address(first.prefill_worker) == "p0" and first.prefill.matched_blocks == 0
        chooser.done(first.prefill, None)
        # p0 is busier now (4 blocks queued) but caches the prompt: 1 + 2 < p1's 7 + 1.
        p0.load.num_queued_prefill_tokens = 4 * BLOCK_SIZE
        longer = prompt + prompt_tokens(20, seed=1)
        second = await planner.plan("b", longer)
        assert address(second.prefill_worker) == "p0" and second.prefill.matched_blocks == 6
        chooser.done(second.prefill, worker_pb2.PrefillResponse(num_cached_tokens=96))
        assert (chooser.num_hit_blocks_predicted, chooser.num_hit_blocks_realized) == (6, 6)
        # Its prefill failed: the hint is dropped and the load decides (p1: 6 + 1 < 6 + 2).
        await chooser.forget(p0)
        third = await planner.plan("c", prompt)
        assert address(third.prefill_worker) == "p1" and third.prefill.matched_blocks == 0
        chooser.done(third.prefill, None)
        assert await reserved(planner) == {}

    asyncio.run(main())


def test_a_prompt_prefilled_on_its_decode_worker_leaves_nothing_under_the_prefill_worker() -> None:
    """d0 caches the prompt, so p0, chosen by the ledger, does not prefill it (short_uncached):
    neither p0's reservation nor the prompt's blocks stay behind, and a longer prompt with the
    same prefix finds nothing cached on p0."""

    async def main() -> None:
        planner = make_planner(PREFILL2, DECODE2)
        prompt = prompt_tokens(LONG)
        await seed_hits(planner, prompt, {"d0": 6})
        short = await planner.plan("a", prompt)
        assert short.place is PrefillPlace.SHORT_UNCACHED
        assert address(short.prefill.worker) == "p0"
        assert await index_of(planner).entries("p0") == []
        assert await reserved(planner) == {}
        longer = await planner.plan("b", prompt + prompt_tokens(40, seed=1))
        assert longer.place is PrefillPlace.PREFILL_WORKER
        assert address(longer.prefill_worker) == "p0" and longer.prefill.matched_blocks == 0
        assert await reserved(planner) == {"p0": 8}

    asyncio.run(main())


def test_colocated_records_the_prompt_as_the_chosen_replicas_at_once() -> None:
    async def main() -> None:
        planner = make_planner((), (W("d0", queued_prefill_tokens=64), W("d1")), colocated=True)
        d0, d1 = planner.decode_chooser.pool.workers
        prompt = prompt_tokens(LONG)
        assert (await planner.plan(None, prompt)).prefill.matched == {}
        first = await planner.plan("a", prompt)
        assert address(first.decode.worker if first.decode else None) == "d1"
        assert first.decode is not None and first.decode.matched_blocks == 0
        # d1 has more queued than d0 now, yet the prefix it was given keeps the prompt there.
        d1.load.num_queued_prefill_tokens = 8 * BLOCK_SIZE
        second = await planner.plan("b", prompt)
        assert second.decode is not None and second.decode.worker is d1
        assert second.prefill.matched == {"d1": 6} and second.decode.matched_blocks == 6
        assert await reserved(planner) == {"d1": 6}  # the first's 6 blocks, the second's 0
        assert d0.num_inflight == d1.num_inflight == 0  # planning moves no in-flight count

    asyncio.run(main())


class HealthFlipLedger(PrefillLedger):
    """The planner's own ledger, except that the chosen worker's health poll fails while the
    decision is made (as it may during a Redis round trip)."""

    def __init__(self, inner: PrefillLedger, planner: RoutePlanner) -> None:
        self.inner = inner
        self.planner = planner

    async def select(self, req_id: str | None, query: PrefillQuery) -> Selection:
        selection = await self.inner.select(req_id, query)
        if selection.chosen is not None:
            chosen_id = query.candidates[selection.chosen].worker_id
            for worker in self.planner.decode_chooser.pool.workers:
                if worker.address == chosen_id:
                    worker.mark_failed("UNAVAILABLE: poll failed")
        return selection

    async def release(self, reservation: Reservation) -> None:
        await self.inner.release(reservation)

    async def withdraw(self, reservation: Reservation) -> None:
        await self.inner.withdraw(reservation)

    def start(self) -> None:
        self.inner.start()

    async def close(self) -> None:
        await self.inner.close()


def test_colocated_replica_lost_while_choosing_goes_to_the_least_busy_other() -> None:
    async def main() -> None:
        # d0 is the cheapest by the prefill cost; of the others d2 has fewer requests.
        busy = 2 * BLOCK_SIZE
        replicas = (
            W("d0"),
            W("d1", running=2, queued_prefill_tokens=busy),
            W("d2", running=1, queued_prefill_tokens=busy),
        )
        planner = make_planner((), replicas, colocated=True)
        chooser = planner.prefill_chooser
        chooser.ledger = HealthFlipLedger(chooser.ledger, planner)
        plan = await planner.plan("a", prompt_tokens(LONG))
        assert address(plan.prefill.worker) == "d0"  # chosen, then marked unhealthy
        assert plan.place is PrefillPlace.COLOCATED
        assert address(plan.decode.worker if plan.decode else None) == "d2"
        assert plan.prefill.reservation is None
        assert await reserved(planner) == {}  # the reservation made on d0 was released

    asyncio.run(main())


def test_a_better_priority_prompt_is_not_put_behind_worse_priority_prefills() -> None:
    """While this router's prefills on the chosen prefill worker are all of a worse priority,
    a better-priority prompt is prefilled by its decode worker (whose scheduler admits it
    first), unless it is longer than --priority-local-prefill-max-tokens uncached tokens or
    the decode worker schedules first come, first served."""
    by_priority = tuple(dataclasses.replace(w, scheduling_policy="priority") for w in DECODE2)

    async def place(
        worker_priorities: dict[int, int],
        priority: int | None,
        length: int,
        decode: tuple[W, ...] = by_priority,
    ):
        planner = make_planner(PREFILL2, decode)
        p0 = planner.prefill_chooser.pool.workers[0]
        p0.prefill_priorities.update(worker_priorities)
        plan = await planner.plan("req", prompt_tokens(length), priority=priority)
        reservations = await reserved(planner)
        await planner.prefill_chooser.close()
        return plan.place, address(plan.prefill_worker), reservations

    before = local_prefills(PrefillPlace.PRIORITY)
    # p0, the cheapest, prefills bulk (priority 10) only: an interactive prompt skips it.
    assert asyncio.run(place({10: 3}, 0, LONG)) == (PrefillPlace.PRIORITY, None, {})
    assert local_prefills(PrefillPlace.PRIORITY) == before + 1
    # Not when its work is as urgent, or idle, or the prompt too long for the decode worker.
    assert asyncio.run(place({10: 2, 0: 1}, 0, LONG))[:2] == (PrefillPlace.PREFILL_WORKER, "p0")
    assert asyncio.run(place({10: 3}, 10, LONG))[:2] == (PrefillPlace.PREFILL_WORKER, "p0")
    assert asyncio.run(place({}, 0, LONG))[:2] == (PrefillPlace.PREFILL_WORKER, "p0")
    assert asyncio.run(place({10: 3}, None, LONG))[0] is PrefillPlace.PRIORITY
    assert asyncio.run(place({10: 3}, 0, 2000))[:2] == (PrefillPlace.PREFILL_WORKER, "p0")
    assert asyncio.run(place({10: 3}, 0, LONG, DECODE2))[:2] == (PrefillPlace.PREFILL_WORKER, "p0")
