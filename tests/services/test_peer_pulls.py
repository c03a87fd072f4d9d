"""Peer pulls through real processes and a real Redis: a hot system prompt spread over two
prefill workers is computed once in the cluster, not once per worker.

The router sends consecutive requests to alternate prefill workers (``--prefill-policy
round_robin``: what bounded load does to a hot prefix under load, made deterministic). The
second worker, which does not cache the system prompt, pulls it from a peer that does (the
first prefill worker, or the decode worker that pulled it for decoding) instead of computing
it. Counted from the usage the client sees: every prompt token is computed exactly once, and
the tokens are those of the offline engine.
"""

from __future__ import annotations

import random

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.services.conftest import greedy, scrape

BLOCK_SIZE = 16
SYSTEM_TOKENS = 6 * BLOCK_SIZE
SUFFIX_TOKENS = 24
NUM_REQUESTS = 6
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def cluster(start_cluster, redis_server):
    return start_cluster(
        num_prefill=2,
        num_decode=1,
        extra_worker_flags=("--redis-url", redis_server.url, "--heartbeat-ttl-s", "1"),
        extra_router_flags=(
            "--redis-url", redis_server.url, "--prefill-policy", "round_robin",
        ),
    )  # fmt: skip


def peer_pulls(metrics_port: int, outcome: str) -> float:
    return scrape(metrics_port).get(
        ("splitserve_router_peer_pulls_total", (("outcome", outcome),)), 0.0
    )


def prompt_tokens_served(metrics_port: int) -> float:
    """The prompt tokens of the requests a worker finished (``vllm:prompt_tokens``)."""
    samples = scrape(metrics_port)
    return sum(v for (name, _), v in samples.items() if name == "vllm:prompt_tokens_total")


def test_a_hot_system_prompt_on_two_prefill_workers_is_computed_once(
    cluster, tiny_llama_dir
) -> None:
    local, client = cluster
    router_port = local.workers("router")[0].metrics_port
    rng = random.Random(0)
    system = [rng.randrange(3, 480) for _ in range(SYSTEM_TOKENS)]
    prompts = [
        system + [rng.randrange(3, 480) for _ in range(SUFFIX_TOKENS)] for _ in range(NUM_REQUESTS)
    ]
    pulled_before = peer_pulls(router_port, "pulled")

    prefill_ports = [w.metrics_port for w in local.workers("prefill")]
    served_before = [prompt_tokens_served(port) for port in prefill_ports]

    computed = 0
    outputs = []
    for prompt in prompts:
        served = client.generate(token_ids=prompt, sampling=greedy(MAX_TOKENS))
        usage = served.last.usage
        assert usage.prompt_tokens == len(prompt)
        computed += usage.prompt_tokens - usage.cached_tokens
        outputs.append(served.token_ids)

    served_after = [prompt_tokens_served(port) for port in prefill_ports]
    assert all(a > b for a, b in zip(served_after, served_before, strict=True))  # both served
    # Once in the cluster: the system prompt by the first request, each suffix by its own.
    assert computed == SYSTEM_TOKENS + NUM_REQUESTS * SUFFIX_TOKENS
    # One pull: the second worker's first request; it caches the prompt after that.
    assert peer_pulls(router_port, "pulled") == pulled_before + 1
    offline = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    want = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert outputs == [w.token_ids for w in want]
