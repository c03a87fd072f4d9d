"""Colocated mode (decode workers run whole requests): the router picks the replica by prefix
hits and load, as it picks prefill workers, or round-robin as the cache-blind baseline."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine import LLM, SamplingParams
from splitserve.v1 import router_pb2
from tests.services.conftest import NUM_KV_BLOCKS, greedy

PREFIX_TOKENS = 64  # 4 blocks
MAX_TOKENS = 4


def with_prefix(prefix: list[int], seed: int) -> list[int]:
    rng = random.Random(seed)
    return prefix + [rng.randrange(3, 480) for _ in range(rng.randint(5, 20))]


def fresh_prefix(seed: int) -> list[int]:
    rng = random.Random(10_000 + seed)
    return [rng.randrange(3, 480) for _ in range(PREFIX_TOKENS)]


@pytest.fixture(scope="module", params=["cost", "round_robin"])
def cluster(request, start_cluster):
    local, client = start_cluster(
        num_decode=2, mode="colocated", extra_router_flags=("--prefill-policy", request.param)
    )
    return request.param, local, client


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)


def test_requests_sharing_a_prefix_follow_it_unless_round_robin(cluster, offline):
    policy, _, client = cluster
    prefix = fresh_prefix(0)
    prompts = [with_prefix(prefix, seed) for seed in range(4)]
    got = [client.generate(token_ids=p, sampling=greedy(MAX_TOKENS)) for p in prompts]
    want = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    cached = [g.last.usage.cached_tokens for g in got]
    if policy == "cost":
        assert cached == [0] + [PREFIX_TOKENS] * 3
    else:  # each replica computes the prefix once, then hits it on its next turn
        assert cached == [0, 0, PREFIX_TOKENS, PREFIX_TOKENS]
    client.wait_idle()


def test_a_burst_on_a_new_prefix_stays_on_one_replica_unless_round_robin(cluster):
    policy, _, client = cluster
    prefix = fresh_prefix(1)
    prompts = [with_prefix(prefix, 100 + i) for i in range(6)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        finished = list(
            pool.map(
                lambda p: client.generate(token_ids=p, sampling=greedy(MAX_TOKENS)).last,
                prompts,
            )
        )
    assert all(m.finish_reason == router_pb2.FINISH_REASON_LENGTH for m in finished)
    # The router recorded each request's blocks on the replica it chose.
    request = router_pb2.GenerateRequest(token_ids=with_prefix(prefix, 999), sampling=greedy(2))
    plan = client.stub.Explain(request, timeout=10)
    assert plan.prefill_place == "colocated"
    matched = sorted(c.matched_blocks for c in plan.prefill)
    if policy == "cost":  # the first choice was recorded before the next request came
        assert matched == [0, PREFIX_TOKENS // 16], plan
        assert plan.chosen_decode == next(c.address for c in plan.prefill if c.matched_blocks)
    else:
        assert matched == [PREFIX_TOKENS // 16] * 2, plan
    client.wait_idle()
