"""``PrefixIndexReplica`` against a real Redis: it ends where the Redis index is (its sets are the
reference) after snapshots, streamed changes, trims and a restart, and a chooser matching in it
decides exactly as one matching in Redis."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Awaitable, Callable

import redis.asyncio

from engine.block_hash import BlockHash
from engine.block_pool import KVMedium
from services.common import kv_event_stream
from services.common.kv_event_stream import StreamOp
from services.common.prefix_index import RedisPrefixIndex
from services.common.redis_config import RedisConfig
from services.router.prefill_choice import PrefillChooser
from services.router.prefill_cost import PrefillWeights
from services.router.prefix_replica import PrefixIndexReplica
from services.router.redis_prefill_ledger import RedisPrefillLedger
from tests.services.router.fakes import PREFILL, W, make_pool
from tests.services.router.test_prefill_ledger import chain

WORKERS = [f"w{i}" for i in range(12)]
_namespaces = itertools.count()


def _namespace() -> str:
    return f"replica{next(_namespaces)}:"


async def _wait_for(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline_s = time.monotonic() + 30
    while not await condition():
        assert time.monotonic() < deadline_s, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def _caught_up(replica: PrefixIndexReplica, client: redis.asyncio.Redis, ns: str) -> bool:
    """The replica is ready and has applied the stream's last entry."""
    if not replica.ready:
        return False
    if not await client.exists(kv_event_stream.stream_key(ns)):
        return True
    info = await client.xinfo_stream(kv_event_stream.stream_key(ns))
    return replica.last_id == info["last-generated-id"]


async def _assert_same(
    replica: PrefixIndexReplica,
    index: RedisPrefixIndex,
    seed: int,
    client: redis.asyncio.Redis,
    ns: str,
) -> None:
    """The replica matches every prompt as the Redis index does (all workers alive), and
    counts the same blocks of each match in the worker's tier alone."""
    for worker in WORKERS:
        await index.heartbeat(worker, 3600)
    tiers = {w: await client.smembers(f"{ns}tier:{w}") for w in WORKERS}
    rng = random.Random(seed)
    prompts = [chain(seed=rng.randrange(8), num_blocks=rng.randrange(1, 9)) for _ in range(40)]
    num_in_tier = 0
    for prompt in prompts:
        matched = await index.match(prompt)
        assert replica.match(prompt) == matched
        in_tier = {w: sum(h in tiers[w] for h in prompt[:n]) for w, n in matched.items()}
        assert replica.tier_blocks(prompt, matched) == {w: n for w, n in in_tier.items() if n}
        num_in_tier += sum(in_tier.values())
    assert num_in_tier > 0


def _random_ops(
    rng: random.Random, index: RedisPrefixIndex, num: int
) -> list[Callable[[], Awaitable[None]]]:
    """``num`` random changes: stores and removes of prompt prefixes, clears, forgets."""
    ops: list[Callable[[], Awaitable[None]]] = []
    for _ in range(num):
        worker = rng.choice(WORKERS)
        hashes: list[BlockHash] = chain(seed=rng.randrange(8), num_blocks=8)[: rng.randrange(1, 9)]
        kind = rng.random()
        if kind < 0.45:
            ops.append(lambda w=worker, h=hashes: index.store(w, h))
        elif kind < 0.6:
            ops.append(lambda w=worker, h=hashes: index.store(w, h, KVMedium.TIER))
        elif kind < 0.9:
            tail = hashes[rng.randrange(len(hashes)) :]
            ops.append(lambda w=worker, h=tail: index.remove(w, h))
        elif kind < 0.97:
            ops.append(lambda w=worker: index.clear(w))
        else:
            ops.append(lambda w=worker: index.forget(w))
    return ops


def test_the_replica_ends_where_the_index_is(redis_server) -> None:
    """Changes before its snapshot and streamed after it, concurrent writers included."""

    async def main() -> None:
        ns = _namespace()
        index = RedisPrefixIndex(RedisConfig(redis_server.url).client(), ns, stream_max_len=10**5)
        rng = random.Random(0)
        for op in _random_ops(rng, index, 150):
            await op()
        client = RedisConfig(redis_server.url).client()
        replica = PrefixIndexReplica(RedisConfig(redis_server.url).client(), ns)
        replica.start()
        await _wait_for(lambda: _caught_up(replica, client, ns), "the first snapshot")
        await _assert_same(replica, index, 1, client, ns)
        writers = [_random_ops(random.Random(s), index, 150) for s in range(3)]

        async def write(ops: list[Callable[[], Awaitable[None]]]) -> None:
            for op in ops:
                await op()

        await asyncio.gather(*(write(ops) for ops in writers))
        await _wait_for(lambda: _caught_up(replica, client, ns), "the streamed changes")
        await _assert_same(replica, index, 2, client, ns)
        assert replica.num_snapshots == 1
        await replica.close()
        await index.close()
        await client.aclose()

    asyncio.run(main())


def test_entries_trimmed_before_they_are_read_mean_a_new_snapshot(redis_server) -> None:
    async def main() -> None:
        ns = _namespace()
        index = RedisPrefixIndex(RedisConfig(redis_server.url).client(), ns, stream_max_len=5)
        client = RedisConfig(redis_server.url).client()
        await client.config_set("stream-node-max-entries", 10)
        replica = PrefixIndexReplica(RedisConfig(redis_server.url).client(), ns)
        replica.start()
        try:
            await index.store("w0", chain(seed=0, num_blocks=4))
            await _wait_for(lambda: _caught_up(replica, client, ns), "the first entry")
            # Entries of a store the sets never saw, trimmed at once: the replica cannot apply
            # them in order, so it takes the sets again (without them).
            async with client.pipeline(transaction=True) as pipe:
                for seed in range(1, 60):
                    hashes = chain(seed=seed, num_blocks=2)
                    kv_event_stream.append(pipe, ns, 5, StreamOp.STORE, "w1", hashes)
                await pipe.execute()
            await _wait_for(lambda: _caught_up(replica, client, ns), "a new snapshot")
            assert replica.num_snapshots >= 2
            assert replica.match(chain(seed=1, num_blocks=2)) == {}
            assert replica.match(chain(seed=0, num_blocks=4)) == {"w0": 4}
        finally:
            await client.config_set("stream-node-max-entries", 100)
        await replica.close()
        await index.close()
        await client.aclose()

    asyncio.run(main())


def test_a_restarted_redis_means_a_new_snapshot(redis_server) -> None:
    """Redis restarts empty: the replica drops what it had and follows the workers'
    republication."""

    async def main() -> None:
        ns = _namespace()
        index = RedisPrefixIndex(RedisConfig(redis_server.url).client(), ns, stream_max_len=1000)
        client = RedisConfig(redis_server.url).client()
        replica = PrefixIndexReplica(RedisConfig(redis_server.url).client(), ns)
        replica.start()
        await index.store("w0", chain(seed=0, num_blocks=4))
        await _wait_for(lambda: _caught_up(replica, client, ns), "the first entry")
        assert replica.match(chain(seed=0, num_blocks=4)) == {"w0": 4}
        redis_server.restart()
        await _wait_for(lambda: _republished(index, client), "Redis back")

        async def caught_up_after_a_new_snapshot() -> bool:
            return replica.num_snapshots > 1 and await _caught_up(replica, client, ns)

        await _wait_for(caught_up_after_a_new_snapshot, "a snapshot of the restarted Redis")
        assert replica.match(chain(seed=0, num_blocks=4)) == {}
        assert replica.match(chain(seed=1, num_blocks=3)) == {"w1": 3}
        await replica.close()
        await index.close()
        await client.aclose()

    asyncio.run(main())


async def _republished(index: RedisPrefixIndex, client: redis.asyncio.Redis) -> bool:
    """After the restart, w1 (alone) publishes its cache; False while Redis is down."""
    try:
        await client.ping()
        await index.store("w1", chain(seed=1, num_blocks=3))
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False
    return True


def test_a_chooser_matching_in_its_replica_decides_as_one_matching_in_redis(redis_server) -> None:
    """Same seeds, same index: every decision of a 40-worker pool (sampled: 16 candidates),
    reservations kept, is the same with the match in the replica as in Redis."""
    pool = make_pool(PREFILL, [W(f"p{i}") for i in range(40)])

    async def decide(with_replica: bool) -> list[tuple[str | None, int]]:
        ns = _namespace()
        url = redis_server.url
        index = RedisPrefixIndex(RedisConfig(url).client(), ns, stream_max_len=10**5)
        rng = random.Random(5)
        for i in range(40):
            await index.heartbeat(f"p{i}", 3600)
            await index.store(f"p{i}", chain(seed=rng.randrange(6), num_blocks=6))
        replica = PrefixIndexReplica(RedisConfig(url).client(), ns) if with_replica else None
        chooser = PrefillChooser(
            pool,
            RedisPrefillLedger(RedisConfig(url).client(), "r1", 30, ns, 10**5),
            local_index=None,
            weights=PrefillWeights(load_bound=1.5),
            router_id="r1",
            rng=random.Random(9),
            max_candidates=16,
            replica=replica,
        )
        chooser.start()
        if replica is not None:
            client = RedisConfig(url).client()
            await _wait_for(lambda: _caught_up(replica, client, ns), "the snapshot")
            await client.aclose()
        decisions = []
        for i in range(60):
            prompt = chain(seed=rng.randrange(10), num_blocks=rng.randrange(2, 9))
            choice = await chooser.choose(f"req-{i}", prompt)
            worker = None if choice.worker is None else choice.worker.address
            decisions.append((worker, choice.matched_blocks))
        await chooser.close()
        await index.close()
        return decisions

    async def main() -> None:
        in_redis = await decide(with_replica=False)
        assert await decide(with_replica=True) == in_redis
        assert any(blocks for _, blocks in in_redis)

    asyncio.run(main())
