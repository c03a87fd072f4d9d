"""LoRA adapters through the cluster (a prefill and a decode worker): a request's model names
its adapter, answered token for token as transformers + PEFT; adapters load at run time on
every worker, all or nothing; adapters never share cached blocks."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest
import torch

from loadtest.fixtures.tiny_lora import make_tiny_lora
from services.common.roles import Role
from splitserve.v1 import router_pb2, worker_pb2, worker_pb2_grpc
from tests.engine.test_generate_vs_hf import hf_generate
from tests.services.conftest import greedy
from tests.services.openai.conftest import CLIENT_OPTIONS
from tests.waiting import wait_until

MAX_TOKENS = 8
PROMPT = list(range(7, 47))  # 40 tokens: two full blocks and a part


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster-adapters")
    return {
        "a": make_tiny_lora(tiny_llama_dir, root / "a", rank=8, seed=11),
        "b": make_tiny_lora(tiny_llama_dir, root / "b", rank=4, seed=12, use_rslora=True),
        "head": make_tiny_lora(tiny_llama_dir, root / "head", rank=4, targets=["lm_head"]),
    }


@pytest.fixture(scope="module")
def references(tiny_llama_dir, adapters):
    """Greedy tokens of ``PROMPT`` by transformers (+ PEFT), by adapter ("": none)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def model(adapter: str):
        base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
        return PeftModel.from_pretrained(base, adapters[adapter]) if adapter else base

    return {name: hf_generate(model(name), [PROMPT], MAX_TOKENS)[0] for name in ("", "a", "b")}


@pytest.fixture(scope="module")
def lora_cluster(start_cluster, adapters):
    return start_cluster(
        extra_worker_flags=(
            "--enable-lora",
            *("--lora-modules", f"a={adapters['a']}"),
            *("--max-loras", "3"),
        ),
        extra_router_flags=("--allow-runtime-lora-updating",),
    )


@pytest.fixture(scope="module")
def http(lora_cluster):
    with httpx.Client(base_url=lora_cluster[0].http_url, timeout=120) as client:
        yield client


def _generate(client, model: str, **kwargs):
    return client.generate(token_ids=PROMPT, sampling=greedy(MAX_TOKENS), model=model, **kwargs)


def test_a_requests_model_picks_its_adapter(lora_cluster, references):
    _, client = lora_cluster
    assert _generate(client, "a").token_ids == references["a"]
    assert _generate(client, "").token_ids == references[""]
    assert _generate(client, client.status().model).token_ids == references[""]


def test_an_unknown_model_is_not_found_naming_those_served(lora_cluster, http):
    local, client = lora_cluster
    with pytest.raises(grpc.RpcError) as info:
        _generate(client, "nope")
    assert info.value.code() is grpc.StatusCode.NOT_FOUND
    assert "`nope` does not exist" in info.value.details() and "`a`" in info.value.details()
    with openai.OpenAI(base_url=f"{local.http_url}/v1", **CLIENT_OPTIONS) as sdk:
        with pytest.raises(openai.NotFoundError, match="`a`"):
            sdk.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
        models = {m.id: m for m in sdk.models.list().data}
    base = client.status().model
    assert set(models) == {base, "a"}
    assert models["a"].model_extra["parent"] == base


def test_an_adapter_loaded_at_run_time_serves_through_both_apis(
    lora_cluster, http, adapters, references
):
    local, client = lora_cluster
    response = http.post(
        "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(adapters["b"])}
    )
    assert response.status_code == 200, response.text
    assert set(client.status().lora_adapters) == {"a", "b"}
    expected = _generate(client, "b")
    assert expected.token_ids == references["b"]
    with openai.OpenAI(base_url=f"{local.http_url}/v1", **CLIENT_OPTIONS) as sdk:
        completion = sdk.completions.create(
            model="b", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
        )
        assert completion.model == "b"
        assert completion.choices[0].text == expected.text
        chunks = sdk.completions.create(
            model="b", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    response = http.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
    assert response.status_code == 200, response.text
    assert list(client.status().lora_adapters) == ["a"]
    with pytest.raises(grpc.RpcError) as info:
        _generate(client, "b")
    assert info.value.code() is grpc.StatusCode.NOT_FOUND


def test_an_adapter_a_worker_refuses_is_loaded_nowhere(lora_cluster, http, adapters):
    _, client = lora_cluster
    response = http.post(
        "/v1/load_lora_adapter", json={"lora_name": "head", "lora_path": str(adapters["head"])}
    )
    assert response.status_code == 400
    assert "targets lm_head" in response.json()["error"]["message"]
    assert list(client.status().lora_adapters) == ["a"]
    for worker in client.status().workers:
        assert [adapter.name for adapter in worker.load.lora_adapters] == ["a"]
    missing = http.post("/v1/unload_lora_adapter", json={"lora_name": "never"})
    assert missing.status_code == 400 and "no worker serves" in missing.text


def test_adapters_never_share_cached_blocks(lora_cluster, adapters):
    _, client = lora_cluster
    client.stub.LoadLoraAdapter(
        worker_pb2.LoadLoraAdapterRequest(lora_name="b2", lora_path=str(adapters["b"])),
        timeout=60,
    )
    salt = "isolation"
    first = _generate(client, "a", cache_salt=salt)
    assert first.last.usage.cached_tokens == 0
    for model in ("b2", ""):
        assert _generate(client, model, cache_salt=salt).last.usage.cached_tokens == 0, model
    assert _generate(client, "a", cache_salt=salt).last.usage.cached_tokens >= 32


def test_the_router_finds_an_adapters_cached_prefixes(lora_cluster):
    """The router hashes a prompt with its adapter's key, as the workers do: the prefix index
    matches the blocks a worker cached under that adapter, and none under another."""
    _, client = lora_cluster
    salt = "explained"
    _generate(client, "a", cache_salt=salt)

    def matched(model: str) -> int:
        request = router_pb2.GenerateRequest(
            token_ids=PROMPT, sampling=greedy(MAX_TOKENS), model=model, cache_salt=salt
        )
        explained = client.stub.Explain(request, timeout=30)
        return max(c.matched_blocks for c in explained.prefill)

    wait_until(lambda: matched("a") == 2, 30, "the adapter's blocks in the prefix index")
    assert matched("") == 0


def test_an_adapters_requests_go_only_to_workers_serving_it(start_cluster, adapters, references):
    """An adapter one decode worker of two serves (loaded there alone): only it is a
    candidate for the adapter's requests; the base model's may go to either."""
    local, client = start_cluster(
        num_decode=2, extra_worker_flags=("--enable-lora", "--max-loras", "2")
    )
    only = local.workers(Role.DECODE)[1].address
    with grpc.insecure_channel(only) as channel:
        worker_pb2_grpc.DecodeWorkerStub(channel).LoadLoraAdapter(
            worker_pb2.LoadLoraAdapterRequest(lora_name="a", lora_path=str(adapters["a"])),
            timeout=60,
        )
    wait_until(lambda: list(client.status().lora_adapters) == ["a"], 30, "adapter a served")

    def decode_candidates(model: str) -> set[str]:
        request = router_pb2.GenerateRequest(
            token_ids=PROMPT, sampling=greedy(MAX_TOKENS), model=model
        )
        return {c.address for c in client.stub.Explain(request, timeout=30).decode}

    assert decode_candidates("a") == {only}
    assert len(decode_candidates("")) == 2
    assert _generate(client, "a").token_ids == references["a"]
