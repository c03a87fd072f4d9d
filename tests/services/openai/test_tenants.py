"""Tenants through a real cluster (``--api-key-file`` keys naming their tenant,
``--tenant-limits``), with the ``openai`` client and gRPC: two tenants sending the same prompt
never share a cached block; a tenant over its token rate or its concurrency gets 429 with
``Retry-After`` (gRPC: ``RESOURCE_EXHAUSTED`` with ``retry-after``) while another tenant is
served; each tenant's tokens are counted in the router's metrics."""

from __future__ import annotations

import urllib.parse

import grpc
import openai
import pytest

from tests.services.conftest import Client, greedy, scrape
from tests.services.openai.conftest import CLIENT_OPTIONS, start_keyed_cluster
from tests.waiting import wait_until

ADMIN = "tenants-admin-key-0123456789"
KEYS = {
    "acme": "acme-key-0123456789abcdef",  # 5 tokens per second
    "solo": "solo-key-0123456789abcdef",  # one request at a time
    "beta": "beta-key-0123456789abcdef",
    "gamma": "gamma-key-0123456789abcdef",
}
PROMPT = list(range(20, 60))  # 40 tokens: two full blocks of 16


@pytest.fixture(scope="module")
def cluster(start_cluster, tmp_path_factory):
    return start_keyed_cluster(
        start_cluster,
        tmp_path_factory.mktemp("keys"),
        ADMIN,
        KEYS,
        "acme:max_tokens_per_s=5;solo:max_concurrent_requests=1",
    )


@pytest.fixture(scope="module")
def clients(cluster):
    opened = {
        name: openai.OpenAI(base_url=f"{cluster.http_url}/v1", **{**CLIENT_OPTIONS, "api_key": key})
        for name, key in KEYS.items()
    }
    yield opened
    for client in opened.values():
        client.close()


@pytest.fixture(scope="module")
def model(clients) -> str:
    return clients["beta"].models.list().data[0].id


def _cached(client, model: str) -> int:
    usage = client.completions.create(model=model, prompt=PROMPT, max_tokens=2).usage
    return usage.prompt_tokens_details.cached_tokens


def test_two_tenants_sending_the_same_prompt_never_share_a_block(clients, model):
    assert _cached(clients["beta"], model) == 0
    assert _cached(clients["beta"], model) == 32  # its own repeat hits its two full blocks
    assert _cached(clients["gamma"], model) == 0  # the same prompt, another tenant
    assert _cached(clients["gamma"], model) == 32
    # A client's cache_salt subdivides its own tenant's cache only.
    salted = clients["gamma"].completions.create(
        model=model, prompt=PROMPT, max_tokens=2, extra_body={"cache_salt": "x"}
    )
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_a_tenant_over_its_token_rate_gets_429_while_another_is_served(cluster, clients, model):
    acme = clients["acme"]
    # 40 prompt + 8 generated tokens against 5 a second: the bucket is deep in debt.
    acme.completions.create(model=model, prompt=PROMPT, max_tokens=8)
    with pytest.raises(openai.RateLimitError) as caught:
        acme.completions.create(model=model, prompt=PROMPT, max_tokens=1)
    assert "max_tokens_per_s" in caught.value.body["message"]
    assert int(caught.value.response.headers["retry-after"]) >= 1
    assert clients["beta"].completions.create(model=model, prompt="hi", max_tokens=2).choices
    grpc_acme = Client(cluster.router_address, KEYS["acme"])
    try:
        with pytest.raises(grpc.RpcError) as refused:
            grpc_acme.generate(token_ids=PROMPT, sampling=greedy(1))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers = dict(refused.value.trailing_metadata())
        assert int(trailers["retry-after"]) >= 1
    finally:
        grpc_acme.close()


def test_a_tenant_at_its_concurrency_gets_429_until_its_request_ends(clients, model):
    solo = clients["solo"]
    stream = solo.completions.create(
        model=model, prompt="hold", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    with pytest.raises(openai.RateLimitError) as caught:
        solo.completions.create(model=model, prompt="x", max_tokens=1)
    assert "max_concurrent_requests" in caught.value.body["message"]
    assert clients["beta"].completions.create(model=model, prompt="x", max_tokens=1).choices
    stream.close()

    def served() -> bool:
        try:
            return bool(solo.completions.create(model=model, prompt="x", max_tokens=1).choices)
        except openai.RateLimitError:
            return False

    wait_until(served, 30, "solo's next request after its stream closed")


def test_each_tenants_tokens_and_refusals_are_counted(cluster, clients, model):
    clients["beta"].completions.create(model=model, prompt=PROMPT, max_tokens=3)
    samples = scrape(urllib.parse.urlsplit(cluster.http_url).port)

    def tokens(tenant: str, kind: str) -> float:
        labels = (("kind", kind), ("tenant", tenant))
        return samples[("splitserve_router_tenant_tokens_total", labels)]

    assert tokens("beta", "prompt") >= 80 and tokens("beta", "cached") >= 32
    assert tokens("beta", "generated") >= 3
    refused = (("limit", "max_tokens_per_s"), ("tenant", "acme"))
    assert samples[("splitserve_router_tenant_rejected_total", refused)] >= 1
