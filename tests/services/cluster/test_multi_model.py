"""Two models of different shapes behind one router, on Ray (``--extra-models``): each request
is answered by its model's pools, ``scale`` acts on one model's pool only, and the prefix index
never offers one model's cached blocks to the other's requests.

Both tiny models share one tokenizer (trained on the same text), so one prompt has the same
token ids and block hashes under both: only the router keeping models apart keeps the second
model's requests off the first model's cache.
"""

from __future__ import annotations

import json

import grpc
import pytest

from engine import LLM, SamplingParams
from loadtest.fixtures.tiny_model import make_tiny_model
from splitserve.v1 import router_pb2
from tests.services.cluster.conftest import ROLES, router_client
from tests.services.conftest import NUM_KV_BLOCKS, Client, greedy
from tests.waiting import wait_until

OTHER = "tiny-qwen2"
MAX_TOKENS = 6
PROMPT = list(range(20, 60))  # 40 tokens: two full blocks of 16 and a part


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    """A qwen2 model of another shape than the tiny llama (one layer, a wider MLP)."""
    root = tmp_path_factory.mktemp("other-model")
    return make_tiny_model(root / "qwen2", "qwen2", seed=7, num_hidden_layers=1)


def _reference(model_dir) -> list[int]:
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate([PROMPT], params)[0].token_ids


def _pools(status: router_pb2.StatusResponse) -> dict[tuple[str, str], router_pb2.PoolStatus]:
    names = {v: k for k, v in ROLES.items()}
    return {(p.model, names[p.role]): p for p in status.pools}


def _generate(client: Client, model: str):
    return client.generate(
        token_ids=PROMPT, sampling=greedy(MAX_TOKENS, ignore_eos=True), model=model
    )


def test_two_models_behind_one_router(start_ray_cluster, tiny_llama_dir, other_dir):
    extra = [{"name": OTHER, "model": str(other_dir), "num_decode_workers": 1}]
    cluster = start_ray_cluster(
        num_prefill_workers=1, num_decode_workers=1, extra_models=json.dumps(extra)
    )
    client = router_client(cluster)
    status = client.status()
    primary = status.model
    assert list(status.models) == [primary, OTHER]
    assert set(_pools(status)) == {(m, r) for m in (primary, OTHER) for r in ROLES}
    by_model = {
        m: {w.address for w in status.workers if w.info.served_model_name == m}
        for m in (primary, OTHER)
    }
    assert all(len(addresses) == 2 for addresses in by_model.values())

    # The first model caches the prompt; the other model's index lookup offers none of it.
    expected = {primary: _reference(tiny_llama_dir), OTHER: _reference(other_dir)}
    assert expected[primary] != expected[OTHER]
    assert _generate(client, primary).token_ids == expected[primary]
    explained = {
        model: client.stub.Explain(
            router_pb2.GenerateRequest(token_ids=PROMPT, sampling=greedy(1), model=model),
            timeout=30,
        )
        for model in (primary, OTHER)
    }
    for model, explain in explained.items():
        candidates = {c.address for c in (*explain.prefill, *explain.decode)}
        assert candidates and candidates <= by_model[model]
    assert max(c.matched_blocks for c in explained[primary].prefill) == 2
    assert max(c.matched_blocks for c in explained[OTHER].prefill) == 0
    other = _generate(client, OTHER)
    assert other.token_ids == expected[OTHER]
    assert other.last.usage.cached_tokens == 0

    # A missing model is a 404 naming both; scale acts on the named model's pool only.
    with pytest.raises(grpc.RpcError) as info:
        _generate(client, "nope")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert f"`{primary}`, `{OTHER}`" in info.value.details()
    request = router_pb2.ScaleRequest(role=ROLES["decode"], num_workers=2, model="nope")
    with pytest.raises(grpc.RpcError) as info:
        client.stub.Scale(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "`nope` is not served" in info.value.details()

    request = router_pb2.ScaleRequest(role=ROLES["decode"], num_workers=2, model=OTHER)
    pools = {
        (p.model, p.role): p.desired_workers for p in client.stub.Scale(request, timeout=30).pools
    }
    assert pools[(OTHER, ROLES["decode"])] == 2
    assert pools[(primary, ROLES["decode"])] == pools[(primary, ROLES["prefill"])] == 1

    def scaled() -> bool:
        status = client.status()
        pools = _pools(status)
        decode = [
            w
            for w in status.workers
            if w.info.served_model_name == OTHER and w.role == ROLES["decode"] and w.healthy
        ]
        return len(decode) == 2 and all(
            p.num_ready == p.desired_workers and not p.num_starting for p in pools.values()
        )

    wait_until(scaled, 180, "the other model's decode pool at 2 workers", 0.2)
    final = _pools(client.status())
    assert (final[(primary, "decode")].num_ready, final[(OTHER, "decode")].num_ready) == (1, 2)
    views = cluster.members()
    assert sorted(m.model for m in views if m.role == "decode") == [primary, OTHER, OTHER]
    for _ in range(3):  # on either of its decode workers, still its own model's tokens
        assert _generate(client, OTHER).token_ids == expected[OTHER]
    assert _generate(client, "").token_ids == expected[primary]
    client.close()
