"""The prefix index, in process and in a real Redis, against the same expectations."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Awaitable, Callable

import pytest

from engine.block_hash import hash_block_tokens
from engine.block_pool import AllBlocksCleared, BlockRemoved, BlockStored
from services.common.prefix_index import InProcessPrefixIndex, PrefixIndex, RedisPrefixIndex
from services.common.redis_config import RedisConfig

_namespaces = itertools.count()


def chain(seed: int, num_blocks: int, block_size: int = 4) -> list[bytes]:
    rng = random.Random(seed)
    return hash_block_tokens([rng.randrange(1000) for _ in range(num_blocks * block_size)], 4)


@pytest.fixture(params=["inproc", "redis"])
def run_with_index(request, redis_server):
    """Runs ``scenario(index)`` on a fresh index (a Redis one in its own namespace of the
    module's server), in a loop of its own."""

    def run(scenario: Callable[[PrefixIndex], Awaitable[None]]) -> None:
        async def main() -> None:
            if request.param == "inproc":
                index: PrefixIndex = InProcessPrefixIndex()
            else:
                index = RedisPrefixIndex.from_config(
                    RedisConfig(redis_server.url, redis_namespace=f"test{next(_namespaces)}:")
                )
            try:
                await scenario(index)
            finally:
                await index.close()

        asyncio.run(main())

    return run


def test_match_counts_leading_blocks_per_live_worker(run_with_index):
    async def scenario(index: PrefixIndex) -> None:
        prompt = chain(seed=1, num_blocks=6)
        other = chain(seed=2, num_blocks=3)
        for worker_id in ("a", "b", "c"):
            await index.heartbeat(worker_id, ttl_s=30)
        await index.store("a", prompt[:4])
        await index.store("b", prompt[:2] + prompt[3:6])  # a hole at block 2
        await index.store("c", other)
        assert await index.match(prompt) == {"a": 4, "b": 2}
        assert await index.match(other) == {"c": 3}
        assert await index.match(chain(seed=3, num_blocks=2)) == {}
        assert await index.match([]) == {}

    run_with_index(scenario)


def test_index_follows_stored_removed_and_cleared_events(run_with_index):
    async def scenario(index: PrefixIndex) -> None:
        prompt = chain(seed=4, num_blocks=5)
        await index.heartbeat("w", ttl_s=30)
        await index.apply("w", [BlockStored(tuple(prompt[:3]), None, 4)])
        assert await index.match(prompt) == {"w": 3}
        await index.apply("w", [BlockStored(tuple(prompt[3:]), prompt[2], 4)])
        assert await index.match(prompt) == {"w": 5}
        await index.apply("w", [BlockRemoved((prompt[1],))])
        assert await index.match(prompt) == {"w": 1}
        await index.apply("w", [AllBlocksCleared()])
        assert await index.match(prompt) == {}
        await index.apply("w", [BlockStored(tuple(prompt[:2]), None, 4)])  # usable again
        assert await index.match(prompt) == {"w": 2}

    run_with_index(scenario)


def test_dead_workers_expire_and_come_back_with_a_heartbeat(run_with_index):
    async def scenario(index: PrefixIndex) -> None:
        prompt = chain(seed=5, num_blocks=2)
        await index.store("short", prompt)
        await index.store("long", prompt)
        assert await index.match(prompt) == {}  # no heartbeat yet: not routable
        assert not await index.heartbeat("short", ttl_s=0.2)  # first: publish everything
        assert not await index.heartbeat("long", ttl_s=30)
        assert await index.heartbeat("long", ttl_s=30)
        assert await index.match(prompt) == {"short": 2, "long": 2}
        await asyncio.sleep(0.3)  # the 0.2 s TTL lapses: the clock is all there is to wait for
        assert await index.match(prompt) == {"long": 2}
        assert not await index.heartbeat("short", ttl_s=30)  # lapsed: publish everything again
        assert await index.match(prompt) == {"short": 2, "long": 2}
        await index.clear("short")
        assert await index.match(prompt) == {"long": 2}

    run_with_index(scenario)


def test_dead_and_departed_workers_leave_no_entries(run_with_index):
    async def scenario(index: PrefixIndex) -> None:
        prompt = chain(seed=4, num_blocks=4)
        await index.heartbeat("live", ttl_s=30)
        await index.heartbeat("dead", ttl_s=0.05)
        await index.heartbeat("leaving", ttl_s=30)
        for worker_id in ("live", "dead", "leaving"):
            await index.store(worker_id, prompt)
        await index.forget("leaving")
        await asyncio.sleep(0.1)  # the 0.05 s TTL lapses: the clock is all there is to wait for
        assert await index.reap() == ["dead"]
        assert await index.entries("dead") == [] and await index.entries("leaving") == []
        assert sorted(await index.entries("live")) == sorted(prompt)
        assert await index.match(prompt) == {"live": 4}
        assert await index.reap() == []

    run_with_index(scenario)


def test_retain_drops_predictions_the_worker_never_computed(run_with_index):
    async def scenario(index: PrefixIndex) -> None:
        computed, predicted = chain(seed=5, num_blocks=3), chain(seed=6, num_blocks=2)
        await index.heartbeat("w", ttl_s=30)
        await index.store("w", computed + predicted)
        await index.retain("w", computed)
        assert sorted(await index.entries("w")) == sorted(computed)
        assert await index.match(predicted) == {}

    run_with_index(scenario)


def test_in_process_index_keeps_the_most_recent_blocks_only():
    async def scenario() -> None:
        index = InProcessPrefixIndex(max_blocks=8)
        await index.heartbeat("w", ttl_s=30)
        old, new = chain(seed=7, num_blocks=6), chain(seed=8, num_blocks=6)
        await index.store("w", old)
        await index.store("w", new)
        assert len(await index.entries("w")) == 8
        assert await index.match(new) == {"w": 6}
        assert await index.match(old) == {}
        # A prefix that keeps matching is kept over blocks stored before its last match.
        await index.store("w", old[:2])
        assert await index.match(old) == {"w": 2}
        await index.store("w", chain(seed=9, num_blocks=6))
        assert await index.match(old) == {"w": 2}

    asyncio.run(scenario())
