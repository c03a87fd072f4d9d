"""Tier-aware routing through real processes and a real Redis: a prefix the prefill worker
evicted into its second tier is still matched by the router, priced as a load (``Explain``
shows its tier blocks), loaded back instead of recomputed with the same tokens, and the router's
predicted tier hits are the ones the worker realized. The worker reports what it measured of
its tier's loads and of its prefill, which the router prices the tier by."""

from __future__ import annotations

import random

import grpc
import pytest

from services.common.roles import Role
from splitserve.v1 import router_pb2, worker_pb2, worker_pb2_grpc
from tests.services.conftest import greedy, scrape
from tests.waiting import wait_until

BLOCK_SIZE = 16
PROMPT_TOKENS = 6 * BLOCK_SIZE + 8  # six full blocks
NUM_KV_BLOCKS = 24  # four other prompts of seven blocks evict all of one


@pytest.fixture(scope="module")
def cluster(start_cluster, redis_server):
    return start_cluster(
        num_prefill=1,
        num_decode=1,
        extra_worker_flags=(
            "--redis-url", redis_server.url, "--heartbeat-ttl-s", "1",
            "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-model-len", "256",
            "--kv-offload-gib", "0.05",
        ),
        extra_router_flags=("--redis-url", redis_server.url),
    )  # fmt: skip


def tier_hits(metrics_port: int, kind: str) -> float:
    name = f"splitserve_router_prefix_tier_hit_blocks_{kind}_total"
    return scrape(metrics_port).get((name, ()), 0.0)


def test_a_prefix_evicted_into_the_tier_is_routed_priced_and_loaded_back(cluster) -> None:
    local, client = cluster
    rng = random.Random(0)
    prompt, *others = ([rng.randrange(3, 480) for _ in range(PROMPT_TOKENS)] for _ in range(5))
    first = client.generate(token_ids=prompt, sampling=greedy(4))
    for other in others:
        client.generate(token_ids=other, sampling=greedy(2))
    request = router_pb2.GenerateRequest(token_ids=prompt, sampling=greedy(4))

    def all_in_the_tier() -> router_pb2.ExplainResponse | None:
        explain = client.stub.Explain(request, timeout=10)
        (candidate,) = explain.prefill
        return explain if candidate.tier_blocks == candidate.matched_blocks == 6 else None

    explain = wait_until(all_in_the_tier, 30, "the prompt in the prefill worker's tier alone")
    assert explain.prefill[0].cost == 0.0  # no load from the tier measured yet: priced free
    router_port = local.workers(Role.ROUTER)[0].metrics_port
    predicted, realized = tier_hits(router_port, "predicted"), tier_hits(router_port, "realized")
    again = client.generate(token_ids=prompt, sampling=greedy(4))
    assert again.token_ids == first.token_ids
    assert again.last.usage.cached_tokens == 6 * BLOCK_SIZE
    assert tier_hits(router_port, "predicted") - predicted == 6
    assert tier_hits(router_port, "realized") - realized == 6

    with grpc.insecure_channel(local.workers(Role.PREFILL)[0].address) as channel:
        stub = worker_pb2_grpc.PrefillWorkerStub(channel)
        load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
        assert load.tier_load_s_per_block > 0 and load.prefill_s_per_token > 0
        assert load.num_tier_hit_blocks >= 6
        # Evicted again, the prefix costs its six loads at the worker's measured price.
        for other in others:
            client.generate(token_ids=other, sampling=greedy(2))

        def priced_as_measured() -> bool:
            candidate = client.stub.Explain(request, timeout=10).prefill[0]
            load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
            load_cost = load.tier_load_s_per_block / (load.prefill_s_per_token * BLOCK_SIZE)
            return candidate.tier_blocks == 6 and candidate.cost == pytest.approx(6 * load_cost)

        wait_until(priced_as_measured, 30, "the tier's blocks priced at the measured cost")
