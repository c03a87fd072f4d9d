"""Tenant priority end to end: decode workers with ``--scheduling-policy priority`` and one
slot (``--max-num-seqs 1``); a low-priority tenant's long stream holds the slot, a high-priority
tenant's request preempts it and is answered at once, and the low-priority stream then resumes
and finishes whole. A request cannot ask for a better priority than its tenant's."""

from __future__ import annotations

import openai
import pytest

from services.common.roles import Role
from tests.services.conftest import Client
from tests.services.openai.conftest import CLIENT_OPTIONS, start_keyed_cluster

ADMIN = "priority-admin-key-0123456789"
KEYS = {"gold": "gold-key-0123456789abcdef", "bronze": "bronze-key-0123456789abcdef"}
HOLD_TOKENS = 900  # seconds of decoding on the tiny model; its context is 1024


@pytest.fixture(scope="module")
def cluster(start_cluster, tmp_path_factory):
    return start_keyed_cluster(
        start_cluster,
        tmp_path_factory.mktemp("keys"),
        ADMIN,
        KEYS,
        "gold:priority=0;bronze:priority=10",
        extra_role_flags={Role.DECODE: ("--scheduling-policy", "priority", "--max-num-seqs", "1")},
    )


def _client(cluster, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{cluster.http_url}/v1", **{**CLIENT_OPTIONS, "api_key": KEYS[tenant]}
    )


def _decode_preemptions(cluster) -> int:
    admin = Client(cluster.router_address, ADMIN)
    try:
        status = admin.status()
    finally:
        admin.close()
    return sum(w.load.num_preemptions for w in status.workers if w.role == Role.DECODE.to_proto())


def test_a_high_priority_tenant_preempts_a_low_priority_stream(cluster):
    with _client(cluster, "gold") as gold, _client(cluster, "bronze") as bronze:
        model = gold.models.list().data[0].id
        before = _decode_preemptions(cluster)
        chunks = iter(_hold(bronze, model))
        # The first token is the prefill worker's; the second shows the decode worker runs it.
        held = [next(chunks), next(chunks)]
        answer = gold.completions.create(model=model, prompt="urgent", max_tokens=4)
        assert answer.usage.completion_tokens == 4
        assert _decode_preemptions(cluster) > before
        held += list(chunks)
    text = "".join(c.choices[0].text for c in held if c.choices)
    assert held[-1].choices[0].finish_reason == "length" and text


def test_a_request_never_gets_a_better_priority_than_its_tenants(cluster):
    with _client(cluster, "bronze") as bronze:
        model = bronze.models.list().data[0].id
        before = _decode_preemptions(cluster)
        chunks = iter(_hold(bronze, model))
        next(chunks), next(chunks)
        # Asking for -100 gets bronze's 10: it waits for the slot instead of preempting.
        done = bronze.completions.create(
            model=model, prompt="x", max_tokens=2, extra_body={"priority": -100}
        )
        assert done.usage.completion_tokens == 2
        assert _decode_preemptions(cluster) == before
        assert list(chunks)[-1].choices[0].finish_reason == "length"


def _hold(client: openai.OpenAI, model: str):
    """A stream long enough to hold the decode worker's one slot while the test acts."""
    return client.completions.create(
        model=model,
        prompt="hold the slot",
        max_tokens=HOLD_TOKENS,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
