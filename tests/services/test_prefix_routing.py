"""Prefix-aware prefill choice through real processes: with the router's in-process index, with
the workers publishing to a real Redis, and with the router matching in its replica of that
index (the change stream on), requests sharing a prefix go to the prefill worker that caches
it; with Redis gone the router routes on load alone and no request fails."""

from __future__ import annotations

import random

import grpc
import pytest

from splitserve.v1 import router_pb2
from tests.services.conftest import greedy, scrape

SHARED_TOKENS = 64  # four full blocks


@pytest.fixture(scope="module", params=["in-process", "redis", "redis-replica"])
def cluster(request, start_cluster, redis_server):
    worker_flags: tuple[str, ...] = ()
    router_flags: tuple[str, ...] = ()
    if request.param.startswith("redis"):
        stream = (
            ("--redis-kv-event-stream-len", "10000") if request.param.endswith("replica") else ()
        )
        worker_flags = ("--redis-url", redis_server.url, "--heartbeat-ttl-s", "1", *stream)
        router_flags = ("--redis-url", redis_server.url, *stream)
    local, client = start_cluster(
        num_prefill=2,
        num_decode=1,
        extra_worker_flags=worker_flags,
        extra_router_flags=router_flags,
    )
    return request.param, local, client


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 480) for _ in range(SHARED_TOKENS)]
    return [shared + [rng.randrange(3, 480) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


def test_requests_sharing_a_prefix_go_to_the_worker_that_caches_it(cluster):
    _, local, client = cluster
    router_port = local.processes[-1].metrics_port
    before = scrape(router_port)
    cached = [
        client.generate(token_ids=prompt, sampling=greedy(2)).last.usage.cached_tokens
        for prompt in prompts(seed=0, n=8)
    ]
    assert cached[0] == 0 and all(c >= SHARED_TOKENS for c in cached[1:]), cached
    after = scrape(router_port)
    delta = {
        kind: after[(f"splitserve_router_prefix_hit_blocks_{kind}_total", ())]
        - before.get((f"splitserve_router_prefix_hit_blocks_{kind}_total", ()), 0)
        for kind in ("predicted", "realized")
    }
    assert delta["predicted"] >= 7 * SHARED_TOKENS // 16
    assert delta["realized"] == delta["predicted"]  # the index was right every time


def test_explain_shows_each_candidate_and_the_choice_without_reserving(cluster):
    client = cluster[2]
    prompt = prompts(seed=0, n=1)[0]  # its shared prefix is cached by the previous test
    request = router_pb2.GenerateRequest(token_ids=prompt, sampling=greedy(2))
    first = client.stub.Explain(request, timeout=10)
    assert first.prompt_tokens == len(prompt) and first.prompt_blocks == len(prompt) // 16
    assert len(first.prefill) == 2
    best, other = first.prefill
    assert best.address == first.chosen_prefill and best.cost <= other.cost
    assert best.matched_blocks >= SHARED_TOKENS // 16 and other.matched_blocks == 0
    assert client.stub.Explain(request, timeout=10).prefill == first.prefill  # nothing reserved
    with pytest.raises(grpc.RpcError) as info:
        client.stub.Explain(router_pb2.GenerateRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    served = client.generate(token_ids=prompt, sampling=greedy(2))
    assert served.last.usage.cached_tokens >= best.matched_blocks * 16


def test_cache_salt_isolates_tenants_prefix_caches(cluster):
    client = cluster[2]
    prompt = prompts(seed=5, n=1)[0]

    def run(salt: str) -> tuple[list[int], int]:
        out = client.generate(token_ids=prompt, sampling=greedy(4), cache_salt=salt)
        return out.token_ids, out.last.usage.cached_tokens

    tokens, cached = run("tenant-a")
    assert cached == 0
    assert run("tenant-a")[1] >= SHARED_TOKENS  # one salt shares its blocks
    assert run("tenant-b") == (tokens, 0)  # another salt sees none of them, same output
    assert run("") == (tokens, 0)  # nor does a request without a salt
    explained = client.stub.Explain(
        router_pb2.GenerateRequest(token_ids=prompt, cache_salt="tenant-c"), timeout=10
    )
    assert all(c.matched_blocks == 0 for c in explained.prefill)
    with pytest.raises(grpc.RpcError) as info:
        client.generate(token_ids=prompt, sampling=greedy(2), cache_salt="x" * 257)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cache_salt" in info.value.details()


def test_without_redis_the_router_routes_on_load_and_nothing_fails(cluster, redis_server):
    mode, local, client = cluster
    if not mode.startswith("redis"):
        pytest.skip("only the Redis index can go away")
    redis_server.stop()
    try:
        for prompt in prompts(seed=1, n=4):
            assert client.generate(token_ids=prompt, sampling=greedy(2)).last.finish_reason
        errors = scrape(local.processes[-1].metrics_port)[
            ("splitserve_router_prefix_index_errors_total", ())
        ]
        assert errors >= 4
    finally:
        redis_server.start()
