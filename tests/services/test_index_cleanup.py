"""The prefix index in Redis keeps no entries of workers that are gone: one that shuts down
removes its own, one that dies is reaped by the routers once its heartbeat expires."""

from __future__ import annotations

import random
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from engine import LLM, SamplingParams
from tests.services.conftest import NUM_KV_BLOCKS, greedy
from tests.waiting import wait_until

HEARTBEAT_TTL_S = 1.0


@pytest.fixture(scope="module")
def cluster(start_cluster, redis_server):
    redis_flags = ("--redis-url", redis_server.url)
    return start_cluster(
        num_prefill=1,
        num_decode=2,
        extra_worker_flags=(*redis_flags, "--heartbeat-ttl-s", str(HEARTBEAT_TTL_S)),
        extra_router_flags=redis_flags,
    )


def indexed_workers(url: str) -> set[str]:
    client = redis.Redis.from_url(url)
    try:
        return {k.decode().rsplit(":", 1)[1] for k in client.scan_iter("splitserve:worker:*")}
    finally:
        client.close()


def test_workers_that_shut_down_or_die_leave_no_index_entries(
    cluster, redis_server, tiny_llama_dir
):
    local, client = cluster
    rng = random.Random(3)
    batch = [[rng.randrange(3, 480) for _ in range(rng.randrange(20, 70))] for _ in range(12)]
    want = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS).generate(
        batch, SamplingParams(temperature=0.0, max_tokens=30)
    )
    ids = {w.address: w.info.worker_id for w in client.status().workers}
    with ThreadPoolExecutor(max_workers=4) as pool:
        first = [pool.submit(client.generate, token_ids=p, sampling=greedy(30)) for p in batch[:6]]
        assert [f.result(timeout=120).token_ids for f in first] == [w.token_ids for w in want[:6]]
        assert set(ids.values()) <= indexed_workers(redis_server.url)
        leaving, dying = local.workers("decode")[0], local.workers("prefill")[0]
        leaving.signal(signal.SIGTERM)
        dying.signal(signal.SIGKILL)
        rest = [pool.submit(client.generate, token_ids=p, sampling=greedy(30)) for p in batch[6:]]
        assert [f.result(timeout=120).token_ids for f in rest] == [w.token_ids for w in want[6:]]
    survivor = ids[local.workers("decode")[1].address]
    wait_until(
        lambda: indexed_workers(redis_server.url) == {survivor},
        30,
        lambda: f"an index of the survivor only (now {indexed_workers(redis_server.url)})",
        0.2,
    )
