"""Workers publish their prefix caches to a real Redis: the index follows what each worker
caches, and is rebuilt by the workers' heartbeats after Redis restarts empty."""

from __future__ import annotations

import asyncio
import random

import pytest
import redis

from engine.block_hash import hash_block_tokens
from services.common.prefix_index import RedisPrefixIndex
from services.common.redis_config import RedisConfig
from tests.services.conftest import greedy
from tests.waiting import wait_until

BLOCK_SIZE = 16
HEARTBEAT_TTL_S = 1.0


@pytest.fixture(scope="module")
def cluster(start_cluster, redis_server):
    flags = ("--redis-url", redis_server.url, "--heartbeat-ttl-s", str(HEARTBEAT_TTL_S))
    return start_cluster(num_prefill=1, num_decode=1, extra_worker_flags=flags)


def redis_run_id(url: str) -> str:
    with redis.Redis.from_url(url) as client:
        return client.info("server")["run_id"]


def match(url: str, block_hashes: list[bytes]) -> dict[str, int]:
    async def run() -> dict[str, int]:
        index = RedisPrefixIndex.from_config(RedisConfig(url))
        try:
            return await index.match(block_hashes)
        finally:
            await index.close()

    return asyncio.run(run())


def wait_for_match(url: str, block_hashes: list[bytes], want: dict[str, int]) -> None:
    wait_until(
        lambda: match(url, block_hashes) == want,
        10,
        lambda: f"the index matching {want} (now {match(url, block_hashes)})",
    )


def worker_ids(client) -> dict[int, str]:
    return {w.role: w.info.worker_id for w in client.status().workers}


def test_both_workers_publish_the_blocks_they_cache(cluster, redis_server):
    _, client = cluster
    rng = random.Random(0)
    prompt = [rng.randrange(3, 480) for _ in range(40)]  # two full blocks
    client.generate(token_ids=prompt, sampling=greedy(4))
    ids = worker_ids(client)
    block_hashes = hash_block_tokens(prompt, BLOCK_SIZE)
    # The prefill worker computed both blocks; the decode worker received them.
    wait_for_match(redis_server.url, block_hashes, {ids[1]: 2, ids[2]: 2})
    assert match(redis_server.url, hash_block_tokens(prompt[:16] + [7] * 16, BLOCK_SIZE)) == {
        ids[1]: 1,
        ids[2]: 1,
    }


def test_index_is_rebuilt_after_redis_restarts_empty(cluster, redis_server):
    _, client = cluster
    rng = random.Random(1)
    prompt = [rng.randrange(3, 480) for _ in range(33)]
    client.generate(token_ids=prompt, sampling=greedy(2))
    ids = worker_ids(client)
    block_hashes = hash_block_tokens(prompt, BLOCK_SIZE)
    wait_for_match(redis_server.url, block_hashes, {ids[1]: 2, ids[2]: 2})
    run_id = redis_run_id(redis_server.url)
    redis_server.restart()
    # A new server without persistence starts empty. (Not asserted by reading the index: a
    # worker may already have published its cache again by then.)
    assert redis_run_id(redis_server.url) != run_id
    # Within a heartbeat interval each worker notices and publishes its whole cache again.
    wait_for_match(redis_server.url, block_hashes, {ids[1]: 2, ids[2]: 2})
    # And the cluster kept serving throughout.
    assert client.generate(token_ids=prompt, sampling=greedy(2)).last.finish_reason
