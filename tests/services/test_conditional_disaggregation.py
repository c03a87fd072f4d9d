"""Conditional disaggregation and the decode choice, through real processes and a real Redis:
short uncached parts are prefilled on the decode worker, long ones on a prefill worker, and a
decode worker that caches a prompt's prefix is preferred and computes only the rest."""

from __future__ import annotations

import random

import pytest

from splitserve.v1 import router_pb2
from tests.services.conftest import Client, greedy, scrape
from tests.waiting import wait_until

LOCAL_MAX_TOKENS = 48


@pytest.fixture(scope="module")
def cluster(start_cluster, redis_server):
    local, client = start_cluster(
        num_prefill=1,
        num_decode=2,
        extra_worker_flags=("--redis-url", redis_server.url, "--heartbeat-ttl-s", "1"),
        extra_router_flags=(
            "--redis-url", redis_server.url,
            "--local-prefill-max-tokens", str(LOCAL_MAX_TOKENS),
        ),
    )  # fmt: skip
    return local, client


def explain(client: Client, prompt: list[int]) -> router_pb2.ExplainResponse:
    request = router_pb2.GenerateRequest(token_ids=prompt, sampling=greedy(2))
    return client.stub.Explain(request, timeout=10)


def local_prefills(metrics_port: int, reason: str) -> float:
    return scrape(metrics_port).get(
        ("splitserve_router_local_prefills_total", (("reason", reason),)), 0.0
    )


def test_a_short_prompt_is_prefilled_on_the_decode_worker(cluster):
    local, client = cluster
    port = local.workers("router")[0].metrics_port
    prompt = [random.Random(0).randrange(3, 480) for _ in range(30)]
    plan = explain(client, prompt)
    assert plan.prefill_place == "short_uncached" and plan.chosen_prefill == ""
    assert plan.chosen_decode and len(plan.decode) == 2
    before = local_prefills(port, "short_uncached")
    assert client.generate(token_ids=prompt, sampling=greedy(3)).last.finish_reason
    assert local_prefills(port, "short_uncached") == before + 1


def test_a_decode_worker_caching_the_prefix_is_chosen_and_computes_only_the_rest(cluster):
    _, client = cluster
    rng = random.Random(1)
    prompt = [rng.randrange(3, 480) for _ in range(100)]  # 6 full blocks, 100 > 48 tokens
    plan = explain(client, prompt)
    assert plan.prefill_place == "prefill_worker" and plan.chosen_prefill
    served = client.generate(token_ids=prompt, sampling=greedy(2))
    assert served.last.finish_reason
    # The decode worker pulled the prompt's blocks; once it has published them, the same
    # prompt plus 20 tokens is cheapest there, and only 24 tokens are left to compute there.
    # (Both idle again, too: the load the router polls lags the end of a request.)
    longer = prompt + [rng.randrange(3, 480) for _ in range(20)]

    def published_and_idle() -> router_pb2.ExplainResponse | None:
        plan = explain(client, longer)
        held = max(d.matched_blocks for d in plan.decode) >= 6
        return plan if held and not any(d.active_requests for d in plan.decode) else None

    plan = wait_until(
        published_and_idle,
        10,
        lambda: f"a plan with the 6 blocks published, both idle (now {explain(client, longer)})",
        0.1,
    )
    holder, other = plan.decode
    assert (holder.matched_blocks, other.matched_blocks) == (6, 0)
    assert holder.cost < other.cost and plan.chosen_decode == holder.address
    assert plan.prefill_place == "short_uncached" and plan.chosen_prefill == ""
    again = client.generate(token_ids=longer, sampling=greedy(2))
    assert again.last.usage.cached_tokens >= 96
