"""Select-and-reserve in process and in a real Redis: the Lua script against the Python
reference, bounded load on a hot prefix, several router processes sharing one Redis, and a
crashed router's reservations."""

from __future__ import annotations

import asyncio
import itertools
import math
import multiprocessing
import os
import random
import signal

import pytest

from engine.block_hash import BlockHash, hash_block_tokens
from engine.block_pool import AllBlocksCleared, BlockRemoved, BlockStored, KVMedium
from services.common.prefix_index import (
    InProcessPrefixIndex,
    PrefixIndex,
    RedisPrefixIndex,
)
from services.common.redis_config import RedisConfig
from services.router.prefill_cost import CandidateLoad, PrefillWeights
from services.router.prefill_ledger import (
    LocalPrefillLedger,
    PrefillLedger,
    PrefillQuery,
    Selection,
)
from services.router.redis_prefill_ledger import RedisPrefillLedger
from tests.waiting import wait_until

_namespaces = itertools.count()
WORKERS = ("w0", "w1", "w2", "w3")


def chain(seed: int, num_blocks: int) -> list[BlockHash]:
    rng = random.Random(seed)
    return hash_block_tokens([rng.randrange(1000) for _ in range(num_blocks * 4)], 4)


def idle(workers: tuple[str, ...] = WORKERS) -> list[CandidateLoad]:
    return [CandidateLoad(w, 0.0) for w in workers]


async def make_pair(
    url: str, router_id: str = "r1", namespace: str | None = None
) -> tuple[PrefixIndex, PrefillLedger]:
    ns = namespace or f"ledger{next(_namespaces)}:"
    index = RedisPrefixIndex.from_config(RedisConfig(url, redis_namespace=ns))
    return index, RedisPrefillLedger(
        RedisConfig(url).client(), router_id, router_ttl_s=30, namespace=ns
    )


@pytest.fixture(params=["inproc", "redis"])
def ledger_kind(request) -> str:
    return request.param


async def index_and_ledger(kind: str, url: str) -> tuple[PrefixIndex, PrefillLedger]:
    if kind == "inproc":
        index = InProcessPrefixIndex()
        return index, LocalPrefillLedger("r1", index)
    return await make_pair(url)


def test_redis_script_decides_exactly_as_the_python_reference(redis_server):
    """Random caches (parts of them in a worker's tier alone), loads, tier load costs, weights
    and reservations, matches known or not: every decision, score and reservation of the Lua
    script equals the in-process ledger's."""

    async def main() -> None:
        rng = random.Random(7)
        num_tier_scores = 0
        for trial in range(12):
            local_index = InProcessPrefixIndex()
            local = LocalPrefillLedger("r1", local_index)
            redis_index, remote = await make_pair(redis_server.url)
            prompts = [
                chain(seed=trial * 10 + i, num_blocks=rng.randrange(1, 12)) for i in range(3)
            ]
            for worker in (*WORKERS, "decode-0"):
                for index in (local_index, redis_index):
                    await index.heartbeat(worker, ttl_s=60)
                prompt = rng.choice(prompts)
                cached = prompt[: rng.randrange(0, len(prompt) + 1)]
                start = rng.randrange(0, len(cached) + 1)
                in_tier = cached[start : rng.randrange(start, len(cached) + 1)]
                for index in (local_index, redis_index):
                    await index.store(worker, cached)
                    await index.store(worker, in_tier, KVMedium.TIER)
            weights = PrefillWeights(
                cache_weight=rng.choice([1.0, 0.5, 2.0]),
                load_weight=rng.choice([1.0, 0.25, 3.0]),
                load_bound=rng.choice([0.0, 1.0, 1.25, 2.0]),
                load_bound_slack=rng.choice([0, 2, 5]),
                saturation_blocks=rng.choice([0.0, 6.0, 1e9]),
            )
            for step in range(20):
                prompt = rng.choice(prompts)
                loads = [
                    CandidateLoad(w, rng.choice([0.0, 1.5, 4.0]), rng.choice([0.0, 0.03, 0.5]))
                    for w in WORKERS
                ]
                tie = rng.random()
                req_id = f"req-{step}" if rng.random() < 0.8 else None
                query = PrefillQuery(prompt, loads, weights, tie)
                # Sometimes with the matches known (a large pool's sample): none recomputed.
                if rng.random() < 0.3:
                    known = await local_index.match(prompt)
                    known_tier = local_index.tier_blocks(prompt, known)
                    query = PrefillQuery(prompt, loads, weights, tie, known, known_tier)
                ours = await local.select(req_id, query)
                theirs = await remote.select(req_id, query)
                assert theirs == ours, (trial, step)
                num_tier_scores += sum(s.tier_blocks > 0 for s in ours.scores)
                if ours.reservation is not None and rng.random() < 0.3:
                    await local.release(ours.reservation)
                    await remote.release(ours.reservation)
            await redis_index.close()
            await remote.close()
        assert num_tier_scores > 20  # the tier's part was exercised

    asyncio.run(main())


def test_a_hot_prefix_spills_within_the_load_bound(ledger_kind, redis_server):
    """32 requests of one prefix cached on w0 only, all in flight at once: w0 takes its bounded
    share, the rest spreads, and no worker exceeds ceil(bound * requests / workers)."""

    async def main() -> None:
        index, ledger = await index_and_ledger(ledger_kind, redis_server.url)
        prompt = chain(seed=1, num_blocks=16)
        for worker in WORKERS:
            await index.heartbeat(worker, ttl_s=60)
        await index.store("w0", prompt)
        weights = PrefillWeights(load_bound=1.25)
        chosen = []
        for i in range(32):
            selection = await ledger.select(f"req-{i}", PrefillQuery(prompt, idle(), weights, 0.5))
            assert selection.reservation is not None
            chosen.append(selection.reservation.worker_id)
        counts = {w: chosen.count(w) for w in WORKERS}
        assert chosen[0] == "w0"
        assert max(counts.values()) <= math.ceil(1.25 * 32 / 4), counts
        assert counts["w0"] == max(counts.values()), counts
        await index.close()
        await ledger.close()

    asyncio.run(main())


def test_released_reservations_stop_counting_and_explain_reserves_nothing(
    ledger_kind, redis_server
):
    async def main() -> None:
        _, ledger = await index_and_ledger(ledger_kind, redis_server.url)
        prompt = chain(seed=2, num_blocks=5)
        weights = PrefillWeights()
        first = await ledger.select("a", PrefillQuery(prompt, idle(("w0",)), weights, 0.0))
        assert first.reservation is not None and first.reservation.blocks == 5
        peek = await ledger.select(None, PrefillQuery(prompt, idle(("w0",)), weights, 0.0))
        assert peek.reservation is None
        assert (peek.scores[0].reserved_blocks, peek.scores[0].reserved_requests) == (5, 1)
        await ledger.release(first.reservation)
        await ledger.release(first.reservation)  # idempotent
        after = await ledger.select(None, PrefillQuery(prompt, idle(("w0",)), weights, 0.0))
        assert (after.scores[0].reserved_blocks, after.scores[0].reserved_requests) == (0, 0)
        await ledger.close()

    asyncio.run(main())


def test_a_withdrawn_reservation_leaves_only_what_the_worker_held_before(ledger_kind, redis_server):
    """A decision records the prompt as the chosen worker's; withdrawing it (the prompt is
    prefilled elsewhere) removes those blocks and the reservation, not the worker's own."""

    async def main() -> None:
        index, ledger = await index_and_ledger(ledger_kind, redis_server.url)
        prompt = chain(seed=3, num_blocks=5)
        await index.heartbeat("w0", ttl_s=60)
        await index.store("w0", prompt[:2])
        weights = PrefillWeights()
        selection = await ledger.select("a", PrefillQuery(prompt, idle(("w0",)), weights, 0.0))
        assert selection.reservation is not None
        assert selection.reservation.recorded == tuple(prompt[2:])
        assert await index.match(prompt) == {"w0": 5}
        await ledger.withdraw(selection.reservation)
        await ledger.withdraw(selection.reservation)  # idempotent
        assert await index.match(prompt) == {"w0": 2}
        assert sorted(await index.entries("w0")) == sorted(prompt[:2])
        after = await ledger.select(None, PrefillQuery(prompt, idle(("w0",)), weights, 0.0))
        assert (after.scores[0].reserved_blocks, after.scores[0].reserved_requests) == (0, 0)
        await index.close()
        await ledger.close()

    asyncio.run(main())


def test_a_prefix_in_a_workers_tier_is_matched_and_priced_as_a_load(ledger_kind, redis_server):
    """The index follows a worker's events as its blocks move between its cache and its tier:
    a prefix in the tier alone is matched in full and its blocks cost the worker's measured
    load cost each, so the worker holding it in its cache wins; loaded back, it is free."""

    async def main() -> None:
        index, ledger = await index_and_ledger(ledger_kind, redis_server.url)
        prompt = tuple(chain(seed=4, num_blocks=8))
        for worker in ("w0", "w1"):
            await index.heartbeat(worker, ttl_s=60)
        await index.apply("w0", [BlockStored(prompt, None, 4)])
        await index.apply(
            "w1", [BlockStored(prompt, None, 4), BlockStored(prompt[3:], None, 4, KVMedium.TIER)]
        )
        loads = [CandidateLoad("w0", 0.0, 0.05), CandidateLoad("w1", 0.0, 0.05)]
        query = PrefillQuery(prompt, loads, PrefillWeights(), tie_value=0.99)

        async def scores() -> tuple[int | None, list[tuple[int, int, float]]]:
            selection = await ledger.select(None, query)
            assert selection.tier_matched == {
                s.worker_id: s.tier_blocks for s in selection.scores if s.tier_blocks
            }
            return selection.chosen, [
                (s.matched_blocks, s.tier_blocks, round(s.cost, 9)) for s in selection.scores
            ]

        assert await scores() == (0, [(8, 0, 0.0), (8, 5, 0.25)])
        # w1 loads them back into its cache; w0 evicts its last four into its tier.
        await index.apply("w1", [BlockStored(prompt[3:], None, 4)])
        await index.apply("w0", [BlockStored(prompt[4:], None, 4, KVMedium.TIER)])
        assert await scores() == (1, [(8, 4, 0.2), (8, 0, 0.0)])
        # w0's tier drops them; w1's cache is reset.
        await index.apply("w0", [BlockRemoved(prompt[4:])])
        await index.apply("w1", [AllBlocksCleared()])
        assert await scores() == (0, [(4, 0, 4.0), (0, 0, 8.0)])
        await index.close()
        await ledger.close()

    asyncio.run(main())


def test_every_worker_saturated_chooses_none(ledger_kind, redis_server):
    async def main() -> None:
        _, ledger = await index_and_ledger(ledger_kind, redis_server.url)
        prompt = chain(seed=3, num_blocks=4)
        weights = PrefillWeights(saturation_blocks=10)
        busy = [CandidateLoad("w0", 10.0), CandidateLoad("w1", 12.0)]
        selection = await ledger.select("a", PrefillQuery(prompt, busy, weights, 0.0))
        assert selection.chosen is None and selection.reservation is None
        one_free = [CandidateLoad("w0", 10.0), CandidateLoad("w1", 9.0)]
        assert (await ledger.select("a", PrefillQuery(prompt, one_free, weights, 0.0))).chosen == 1
        await ledger.close()

    asyncio.run(main())


def _router_process(url: str, namespace: str, router_id: str, num_requests: int, start):
    """One router: a burst of concurrent selections of one hot prefix, reservations held; the
    burst starts once every router is ready (``start``: a barrier shared by them)."""

    async def main() -> None:
        _, ledger = await make_pair(url, router_id, namespace)
        prompt = chain(seed=4, num_blocks=16)
        weights = PrefillWeights(load_bound=1.25)
        start.wait(timeout=60)
        await asyncio.gather(
            *(
                ledger.select(f"req-{i}", PrefillQuery(prompt, idle(), weights, random.random()))
                for i in range(num_requests)
            )
        )

    asyncio.run(main())


def test_two_router_processes_spread_a_burst_within_the_bound(redis_server):
    """Two router processes decide a burst of one hot prefix at the same time against one
    Redis: together they respect the bound, as one router would."""
    namespace = f"ledger{next(_namespaces)}:"

    async def setup() -> None:
        index = RedisPrefixIndex.from_config(
            RedisConfig(redis_server.url, redis_namespace=namespace)
        )
        for worker in WORKERS:
            await index.heartbeat(worker, ttl_s=60)
        await index.store("w0", chain(seed=4, num_blocks=16))
        await index.close()

    asyncio.run(setup())
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(2)
    routers = [
        ctx.Process(target=_router_process, args=(redis_server.url, namespace, rid, 24, start))
        for rid in ("ra", "rb")
    ]
    for process in routers:
        process.start()
    for process in routers:
        process.join(60)
        assert process.exitcode == 0

    async def counts() -> dict[str, dict[str, int]]:
        client = RedisConfig(redis_server.url).client()
        members = {w: await client.zrange(f"{namespace}resv:{w}", 0, -1) for w in WORKERS}
        await client.aclose()
        return {
            w: {r: sum(m.decode().startswith(f"{r}|") for m in ms) for r in ("ra", "rb")}
            for w, ms in members.items()
        }

    per_worker = asyncio.run(counts())
    totals = {w: sum(c.values()) for w, c in per_worker.items()}
    assert sum(totals.values()) == 48
    assert max(totals.values()) <= math.ceil(1.25 * 48 / 4), per_worker
    assert totals["w0"] == max(totals.values()), per_worker


def test_a_crashed_routers_reservations_stop_counting_after_its_ttl(redis_server):
    namespace = f"ledger{next(_namespaces)}:"
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(
        target=_crashing_router_with_ttl, args=(redis_server.url, namespace, child)
    )
    process.start()
    assert parent.poll(60) and parent.recv() == "reserved"

    async def reserved() -> int:
        _, ledger = await make_pair(redis_server.url, "survivor", namespace)
        query = PrefillQuery([], idle(), PrefillWeights(), 0)
        selection: Selection = await ledger.select(None, query)
        await ledger.close()
        return sum(s.reserved_requests for s in selection.scores)

    assert asyncio.run(reserved()) == 3
    os.kill(process.pid, signal.SIGKILL)
    process.join()
    wait_until(
        lambda: asyncio.run(reserved()) == 0, 10, "the crashed router's reservations ending", 0.2
    )
    assert asyncio.run(reserved()) == 0


def _crashing_router_with_ttl(url: str, namespace: str, conn) -> None:
    """Reserves three prefills with a 1 s router TTL, says so, then hangs until killed."""

    async def main() -> None:
        client = RedisConfig(url).client()
        ledger = RedisPrefillLedger(client, "doomed", router_ttl_s=1.0, namespace=namespace)
        ledger.start()
        for i in range(3):
            query = PrefillQuery(chain(seed=5, num_blocks=4), idle(), PrefillWeights(), 0)
            await ledger.select(f"req-{i}", query)
        conn.send("reserved")
        await asyncio.sleep(3600)  # hang, holding the reservations, until the test kills it

    asyncio.run(main())
