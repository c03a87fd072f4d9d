"""Two router processes sharing one Redis and two prefill workers: a burst of one hot prefix
spreads within the load bound across both routers' reservations, and a Redis restart in the
middle of traffic fails no request and ends with the index rebuilt."""

from __future__ import annotations

import math
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from engine import LLM, SamplingParams
from splitserve.v1 import router_pb2
from tests.services.conftest import NUM_KV_BLOCKS, Client, greedy
from tests.waiting import wait_until

SHARED_TOKENS = 64  # four full blocks
LOAD_BOUND = 1.25


@pytest.fixture(scope="module")
def cluster(start_cluster, redis_server):
    local, first = start_cluster(
        num_prefill=2,
        num_decode=1,
        num_routers=2,
        # Every step checks the block pools (a double free or a leaked block kills the engine).
        extra_worker_flags=(
            "--redis-url", redis_server.url, "--heartbeat-ttl-s", "1", "--check-kv-integrity",
        ),
        extra_router_flags=(
            "--redis-url", redis_server.url, "--prefill-load-bound", str(LOAD_BOUND),
            "--prefill-load-bound-slack", "0",
            "--router-heartbeat-ttl-s", "2",
        ),
    )  # fmt: skip
    second = Client(local.workers("router")[1].address)
    yield local, (first, second)
    second.close()


def test_two_routers_sending_one_request_id_serve_each_its_own_prompt(cluster, tiny_llama_dir):
    local, routers = cluster
    pids = [p.popen.pid for p in local.processes]
    batch = prompts(seed=9, n=8)
    want = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS).generate(
        batch, SamplingParams(temperature=0.0, max_tokens=24)
    )
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [
            pool.submit(
                routers[i % 2].generate, request_id="same", token_ids=p, sampling=greedy(24)
            )
            for i, p in enumerate(batch)
        ]
        got = [f.result(timeout=120) for f in futures]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert {m.request_id for g in got for m in g.messages} == {"same"}
    for router in routers:
        router.wait_idle()
    # No engine died of a failed integrity check (--check-kv-integrity) or anything else.
    assert [p.popen.pid for p in local.processes] == pids and all(p.alive for p in local.processes)


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 480) for _ in range(SHARED_TOKENS)]
    return [shared + [rng.randrange(3, 480) for _ in range(rng.randrange(8, 40))] for _ in range(n)]


def reservations(url: str) -> dict[str, list[str]]:
    """Every prefill worker's reservations in Redis, by worker id."""
    client = redis.Redis.from_url(url)
    try:
        keys = [k.decode() for k in client.scan_iter("splitserve:resv:*")]
        return {k.rsplit(":", 1)[1]: [m.decode() for m in client.zrange(k, 0, -1)] for k in keys}
    finally:
        client.close()


def best_match(router: Client, prompt: list[int]) -> int:
    """The most leading blocks of ``prompt`` that the index says a prefill worker caches."""
    request = router_pb2.GenerateRequest(token_ids=prompt, sampling=greedy(2))
    explained = router.stub.Explain(request, timeout=10)
    return max((c.matched_blocks for c in explained.prefill), default=0)


def test_two_routers_spread_a_burst_of_one_prefix_within_the_bound(cluster, redis_server):
    local, routers = cluster
    warm, *burst = prompts(seed=0, n=9)
    routers[0].generate(token_ids=warm, sampling=greedy(2))
    wait_until(
        lambda: best_match(routers[1], burst[0]) >= SHARED_TOKENS // 16,
        10,
        "the second router seeing the warmed prefix in the index",
    )
    prefill = local.workers("prefill")
    for process in prefill:  # hold every prefill so that the whole burst is in flight at once
        process.signal(signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(len(burst)) as pool:
            futures = [
                pool.submit(routers[i % 2].generate, token_ids=p, sampling=greedy(3))
                for i, p in enumerate(burst)
            ]
            wait_until(
                lambda: sum(map(len, reservations(redis_server.url).values())) == 8,
                10,
                "8 reservations in Redis",
            )
            held = reservations(redis_server.url)
            for process in prefill:
                process.signal(signal.SIGCONT)
            results = [f.result(timeout=120) for f in futures]
    finally:
        for process in prefill:
            process.signal(signal.SIGCONT)
    counts = sorted((len(m) for m in held.values()), reverse=True)
    assert counts[0] <= math.ceil(LOAD_BOUND * 8 / 2), held
    assert len({m.split("|")[0] for ms in held.values() for m in ms}) == 2  # both routers
    assert all(r.last.finish_reason and len(r.token_ids) == 3 for r in results)
    wait_until(
        lambda: not any(reservations(redis_server.url).values()), 10, "every reservation released"
    )


def test_redis_restart_mid_traffic_fails_no_request_and_the_index_is_rebuilt(cluster, redis_server):
    routers = cluster[1]
    stop = threading.Event()
    outcomes: list[str] = []
    num_ended = [0, 0]  # requests ended (either way), by router

    def traffic(router: Client, i: int) -> None:
        rng = random.Random(i)
        while not stop.is_set():
            prompt = rng.choice(prompts(seed=1, n=4))
            try:
                result = router.generate(token_ids=prompt, sampling=greedy(2), timeout_s=60)
                outcomes.append(str(result.last.finish_reason))
            except Exception as exc:
                outcomes.append(f"error: {exc!r}")
            num_ended[i] += 1

    def each_router_ends(num_requests: int) -> None:
        """Wait until each router has ended ``num_requests`` more requests than now."""
        targets = [n + num_requests for n in num_ended]
        wait_until(
            lambda: all(n >= t for n, t in zip(num_ended, targets, strict=True)),
            60,
            f"{num_requests} more requests through each router",
        )

    threads = [threading.Thread(target=traffic, args=(r, i)) for i, r in enumerate(routers)]
    for thread in threads:
        thread.start()
    try:
        each_router_ends(3)  # traffic flows
        redis_server.stop()
        time.sleep(1.0)  # Redis stays down for 1 s of traffic: no request may fail meanwhile
        redis_server.start()  # empty: nothing persisted
        each_router_ends(3)  # traffic flows on through the restarted Redis
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
    assert outcomes and not [o for o in outcomes if o.startswith("error")], outcomes
    # The workers published what they cache again, and the prefix routes to its worker.
    prompt = prompts(seed=1, n=5)[-1]
    wait_until(
        lambda: best_match(routers[1], prompt) >= SHARED_TOKENS // 16,
        10,
        "the rebuilt index matching the shared prefix",
    )
    cached = routers[0].generate(token_ids=prompt, sampling=greedy(2)).last.usage.cached_tokens
    assert cached >= SHARED_TOKENS
