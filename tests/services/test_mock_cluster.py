"""``--engine mock`` at cluster scale: 1 router, 4 prefill and 8 decode simulated workers (what
``splitserve up --no-ray --engine mock`` starts) behind a real Redis. They serve a loadtest with
prefix-aware routing (hits in ``Status`` and in the Redis index), move the prompt's KV as real
bytes (each decode worker checks every byte it pulled), and a decode worker killed or drained
mid-stream costs the stream nothing: it completes with the ids an offline mock engine gives."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from engine import EngineConfig, SamplingParams
from engine.block_hash import hash_block_tokens
from engine.llm import LLM
from services.common.prefix_index import RedisPrefixIndex
from services.launcher import LocalCluster
from splitserve.v1 import router_pb2, worker_pb2
from tests.services.conftest import Client, greedy, scrape, serving

BLOCK_SIZE = 16
SHARED_TOKENS = 64  # four full blocks
NUM_PREFILL, NUM_DECODE = 4, 8
# Slow enough that a stream of a few hundred tokens is still running when a worker goes.
MOCK_FLAGS = {
    "mock_step_ms": 4.0,
    "mock_prefill_us_per_token": 20.0,
    "mock_decode_us_per_seq": 50.0,
}


def _engine_config(model_dir: Path) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir), engine="mock", num_kv_blocks=512, num_threads=1, **MOCK_FLAGS
    )


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, redis_server) -> Iterator[tuple[LocalCluster, Client]]:
    local = LocalCluster(
        engine=_engine_config(tiny_llama_dir),
        num_prefill=NUM_PREFILL,
        num_decode=NUM_DECODE,
        extra_worker_flags=("--redis-url", redis_server.url, "--heartbeat-ttl-s", "1"),
        extra_router_flags=("--redis-url", redis_server.url, "--local-prefill-max-tokens", "0"),
    )
    with serving(local) as running:
        yield running


@pytest.fixture(scope="module")
def offline(tiny_llama_dir) -> LLM:
    """The reference: one mock engine in this process (the ids depend on the prompt alone)."""
    return LLM.from_config(_engine_config(tiny_llama_dir))


def _expected(offline: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    (out,) = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return out.token_ids


def _prompts(seed: int, n: int, shared: int = SHARED_TOKENS) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 480) for _ in range(shared)]
    return [prefix + [rng.randrange(3, 480) for _ in range(rng.randrange(8, 40))] for _ in range(n)]


def _redis_matches(url: str, prompt: list[int]) -> dict[str, int]:
    async def match() -> dict[str, int]:
        index = RedisPrefixIndex(aioredis.from_url(url))
        try:
            return await index.match(hash_block_tokens(prompt, BLOCK_SIZE))
        finally:
            await index.close()

    return asyncio.run(match())


def _pulled_bytes(local: LocalCluster) -> float:
    return sum(
        value
        for worker in local.workers("decode")
        if worker.alive
        for (name, _), value in scrape(worker.metrics_port).items()
        if name == "splitserve_kv_pulled_bytes_total"
    )


def test_every_worker_serves(cluster):
    _, client = cluster
    status = client.status()
    assert len(status.workers) == NUM_PREFILL + NUM_DECODE
    assert all(w.healthy for w in status.workers)


def test_shared_prefixes_hit_the_caching_worker_in_status_and_in_redis(
    cluster, offline, redis_server
):
    local, client = cluster
    before = client.status()
    batch = _prompts(seed=0, n=8)
    served = [client.generate(token_ids=p, sampling=greedy(8)) for p in batch]
    assert [g.token_ids for g in served] == [_expected(offline, p, 8) for p in batch]
    cached = [g.last.usage.cached_tokens for g in served]
    assert cached[0] == 0 and all(c >= SHARED_TOKENS for c in cached[1:]), cached
    after = client.status()
    hits = after.prefix_hit_blocks_realized - before.prefix_hit_blocks_realized
    assert hits >= 7 * SHARED_TOKENS // BLOCK_SIZE
    matched = _redis_matches(redis_server.url, batch[0])
    prefill_ids = {
        w.info.worker_id for w in after.workers if w.role == worker_pb2.WORKER_ROLE_PREFILL
    }
    assert any(blocks >= SHARED_TOKENS // BLOCK_SIZE and worker in prefill_ids
               for worker, blocks in matched.items()), matched  # fmt: skip
    # Every decode worker checks the KV it pulled, byte for byte (a wrong byte fails the request).
    assert _pulled_bytes(local) > 0


def test_a_loadtest_completes_every_request(cluster, tmp_path):
    local, _ = cluster
    out = tmp_path / "report"
    argv = [
        sys.executable, "-m", "services.cli", "loadtest", "--target", local.router_address,
        "--workload", "shared-prefix", "--rate", "20", "--duration", "3",
        "--num-requests", "48", "--seed", "3", "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    summary = run["summary"]
    assert summary["errors"] == {} and summary["num_completed"] == summary["num_sent"] > 0
    assert summary["prefix_hit_rate"] > 0


@pytest.mark.parametrize(
    ("how", "seed"), [(signal.SIGTERM, 10), (signal.SIGKILL, 11)], ids=["drained", "killed"]
)
def test_a_decode_worker_gone_mid_stream_costs_the_stream_nothing(cluster, offline, how, seed):
    local, client = cluster
    prompt = _prompts(seed=seed, n=1, shared=40)[0]
    want = _expected(offline, prompt, 300)
    call = client.stub.Generate(
        router_pb2.GenerateRequest(token_ids=prompt, sampling=greedy(300)), timeout=120
    )
    token_ids: list[int] = []
    victim = None
    for message in call:
        token_ids.extend(message.token_ids)
        if victim is None and len(token_ids) >= 20:
            busy = [
                w.address
                for w in client.status().workers
                if w.healthy and w.role == worker_pb2.WORKER_ROLE_DECODE and w.load.num_running
            ]
            assert len(busy) == 1, busy
            victim = next(p for p in local.workers("decode") if p.address == busy[0])
            victim.signal(how)
    assert victim is not None
    assert token_ids == want
