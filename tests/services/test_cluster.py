"""End to end through real processes: client → router → prefill → KV (default backend) → decode.

References: the offline engine in this process (same weights, float32) and Hugging Face
transformers' greedy ``generate``.
"""

from __future__ import annotations

import math
import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from engine import LLM, SamplingParams
from kvtransfer.registry import default_backend
from splitserve.v1 import router_pb2, worker_pb2
from tests.engine.test_generate_vs_hf import hf_greedy
from tests.services.conftest import NUM_KV_BLOCKS, greedy, scrape

MAX_TOKENS = 12
PROMPT_LENS = (1, 5, 16, 17, 31, 48, 97)


def make_prompts(seed: int = 0, lens=PROMPT_LENS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 480) for _ in range(n)] for n in lens]


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def cluster(request, start_cluster):
    if request.param == "colocated":
        return start_cluster(num_decode=1, mode="colocated")
    return start_cluster(num_prefill=1, num_decode=1)


@pytest.fixture(scope="module")
def client(cluster):
    return cluster[1]


def test_status_shows_both_pools(cluster):
    local, client = cluster
    status = client.status()
    roles = sorted(w.role for w in status.workers)
    assert status.mode == local.mode
    expected = [2] if local.mode == "colocated" else [1, 2]  # PREFILL = 1, DECODE = 2
    assert roles == expected
    assert all(w.healthy and w.load.num_total_blocks == NUM_KV_BLOCKS for w in status.workers)
    assert all(w.info.kv_transfer_backend == default_backend() for w in status.workers)


def test_greedy_matches_offline_engine_and_transformers(client, offline, tiny_llama_dir):
    prompts = make_prompts()
    want_hf = hf_greedy(tiny_llama_dir, prompts, MAX_TOKENS)
    want = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for prompt, expected, expected_hf in zip(prompts, want, want_hf, strict=True):
        got = client.generate(token_ids=prompt, sampling=greedy(MAX_TOKENS))
        assert got.token_ids == expected.token_ids == expected_hf
        assert got.text == expected.text
        usage = got.last.usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), len(got.token_ids))
    client.wait_idle()


def test_text_prompt_chat_seed_stop_and_logprobs_match_offline(client, offline):
    seeded = SamplingParams(temperature=0.8, top_k=50, seed=11, max_tokens=MAX_TOKENS)
    want = offline.generate(["a quick brown fox"], seeded)[0]
    got = client.generate(
        prompt="a quick brown fox",
        sampling=router_pb2.SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.8, top_k=50, seed=11
        ),
    )
    assert got.token_ids == want.token_ids and got.text == want.text

    chat = [{"role": "user", "content": "hello there"}]
    want = offline.chat(chat, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    got = client.generate(
        messages=[router_pb2.ChatMessage(role="user", content="hello there")],
        sampling=greedy(MAX_TOKENS),
    )
    assert got.token_ids == want.token_ids

    base = offline.generate(["the stop test"], SamplingParams(temperature=0.0, max_tokens=20))[0]
    stop = base.text[len(base.text) // 2 :][:3]
    want = offline.generate(
        ["the stop test"], SamplingParams(temperature=0.0, max_tokens=20, stop=[stop])
    )[0]
    got = client.generate(prompt="the stop test", sampling=greedy(20, stop=[stop]))
    assert got.text == want.text and stop not in got.text
    assert got.token_ids == want.token_ids
    assert got.last.finish_reason == router_pb2.FINISH_REASON_STOP
    assert got.last.stop_reason == stop

    want = offline.generate(
        ["log probs"], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3)
    )[0]
    got = client.generate(prompt="log probs", sampling=greedy(6, logprobs=3))
    assert [lp.token_id for lp in got.logprobs] == want.token_ids
    for mine, ref in zip(got.logprobs, want.logprobs, strict=True):
        assert mine.logprob == pytest.approx(ref.logprob, abs=1e-4)
        assert [t.token_id for t in mine.top] == [t for t, _ in ref.top]
    client.wait_idle()


def test_one_token_request_finishes_at_prefill(client, offline):
    want = offline.generate([[7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=1))[0]
    got = client.generate(token_ids=[7, 8, 9], sampling=greedy(1))
    assert got.token_ids == want.token_ids
    assert got.last.finish_reason == router_pb2.FINISH_REASON_LENGTH
    assert len(got.messages) == 1
    client.wait_idle()


def test_32_concurrent_streams_all_complete_correctly(client, offline):
    prompts = make_prompts(seed=5, lens=[random.Random(i).randrange(1, 120) for i in range(32)])
    want = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    with ThreadPoolExecutor(max_workers=32) as pool:
        futures = [pool.submit(client.generate, token_ids=p, sampling=greedy(24)) for p in prompts]
        got = [f.result(timeout=300) for f in futures]
    for i, (mine, ref) in enumerate(zip(got, want, strict=True)):
        assert mine.token_ids == ref.token_ids, f"stream {i}"
    client.wait_idle()


def test_cancel_mid_stream_frees_every_block(client):
    request = router_pb2.GenerateRequest(
        token_ids=make_prompts(seed=3, lens=(70,))[0],
        sampling=greedy(900, ignore_eos=True),
    )
    call = client.stub.Generate(request, timeout=120)
    for i, _ in enumerate(call):
        if i == 5:
            break
    status = client.status()
    assert sum(w.load.num_used_blocks for w in status.workers) > 0
    call.cancel()
    status = client.wait_idle()
    for worker in status.workers:
        assert worker.load.num_used_blocks == 0 and worker.load.num_kv_leases == 0


def test_expired_deadline_aborts_and_frees_blocks(client):
    with pytest.raises(grpc.RpcError) as info:
        client.generate(timeout_s=0.3, token_ids=[5] * 40, sampling=greedy(950, ignore_eos=True))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    client.wait_idle()


_sp = router_pb2.SamplingParams
BAD_REQUESTS = {
    "empty prompt": (dict(prompt=""), "prompt"),
    "no input": (dict(), "prompt"),
    "prompt and token_ids": (dict(prompt="hi", token_ids=[1, 2]), "only one of"),
    "token id out of vocabulary": (dict(token_ids=[1, 10**6]), "token_ids"),
    "max_tokens < 1": (dict(prompt="hi", sampling=_sp(max_tokens=0)), "max_tokens"),
    "max_tokens beyond context": (dict(prompt="hi", sampling=greedy(5000)), "max_tokens"),
    "prompt longer than context": (dict(token_ids=[3] * 2048), "prompt"),
    "negative temperature": (dict(prompt="hi", sampling=_sp(temperature=-0.5)), "temperature"),
    "top_p zero": (dict(prompt="hi", sampling=_sp(top_p=0.0)), "top_p"),
    "top_p above one": (dict(prompt="hi", sampling=_sp(top_p=1.5)), "top_p"),
    "top_k below -1": (dict(prompt="hi", sampling=_sp(top_k=-2)), "top_k"),
    "negative seed": (dict(prompt="hi", sampling=_sp(seed=-1)), "seed"),
    "too many stop strings": (dict(prompt="hi", sampling=_sp(stop=["x"] * 17)), "stop"),
    "stop string too long": (dict(prompt="hi", sampling=_sp(stop=["x" * 1025])), "stop"),
    "too many stop ids": (dict(prompt="hi", sampling=_sp(stop_token_ids=[1] * 1025)), "stop"),
    "prompt too large": (dict(prompt="x" * (4 * 2**20 + 1)), "prompt"),
    "too many messages": (
        dict(messages=[router_pb2.ChatMessage(role="user", content="x")] * 1025),
        "messages",
    ),
    "bad chat role": (dict(messages=[router_pb2.ChatMessage(role="robot", content="x")]), "role"),
}  # fmt: skip
# NaN and infinities in every float field (NaN passes any "< bound" check; one used to kill
# every engine that sampled with it).
BAD_REQUESTS |= {
    f"{field.name}={value}": (dict(prompt="hi", sampling=_sp(**{field.name: value})), field.name)
    for field in router_pb2.SamplingParams.DESCRIPTOR.fields
    if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE)
    for value in (math.nan, math.inf, -math.inf)
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS), ids=list(BAD_REQUESTS))
def test_malformed_request_gets_invalid_argument(cluster, case):
    local, client = cluster
    fields, field_name = BAD_REQUESTS[case]
    with pytest.raises(grpc.RpcError) as info:
        client.generate(**fields)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_name in info.value.details()
    for process in local.processes:
        assert process.alive, f"{process.role} died"


# Field 1 announced as 255 bytes long, then cut: no message type parses it.
TRUNCATED = b"\x0a\xff"
UNDECODABLE_CALLS = [
    ("router", "/splitserve.v1.Router/Generate", True),
    ("router", "/splitserve.v1.Router/Status", False),
    ("decode", "/splitserve.v1.DecodeWorker/Decode", True),
    ("decode", "/splitserve.v1.DecodeWorker/GetLoad", False),
]


@pytest.mark.parametrize("role,method,streaming", UNDECODABLE_CALLS)
def test_undecodable_request_bytes_get_invalid_argument(cluster, role, method, streaming):
    local, _ = cluster
    (process,) = [p for p in local.processes if p.role == role][:1]
    with grpc.insecure_channel(process.address) as channel:
        factory = channel.unary_stream if streaming else channel.unary_unary
        call = factory(method, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            reply = call(TRUNCATED, timeout=10)
            if streaming:
                list(reply)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request does not parse" in info.value.details()
    assert all(p.alive for p in local.processes)


def test_servers_stay_healthy_after_bad_input(cluster, offline):
    local, client = cluster
    for process in local.processes:
        with grpc.insecure_channel(process.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    want = offline.generate([[9, 9, 9]], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert client.generate(token_ids=[9, 9, 9], sampling=greedy(4)).token_ids == want.token_ids


def test_requests_sharing_a_request_id_are_served_apart(client, offline):
    """The client's request_id is a label: the router keys requests by its own ids."""
    first = [4] * 30
    want = offline.generate([first], SamplingParams(temperature=0.0, max_tokens=60))[0]
    call = client.stub.Generate(
        router_pb2.GenerateRequest(request_id="dup", token_ids=first, sampling=greedy(60)),
        timeout=60,
    )
    messages = [next(iter(call))]
    second = client.generate(request_id="dup", token_ids=[4, 5], sampling=greedy(2))
    messages.extend(call)
    assert [t for m in messages for t in m.token_ids] == want.token_ids
    assert {m.request_id for m in (*messages, *second.messages)} == {"dup"}
    want_second = offline.generate([[4, 5]], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert second.token_ids == want_second.token_ids
    client.wait_idle()


def test_prometheus_metrics_agree_with_status(cluster):
    local, client = cluster
    client.generate(token_ids=[3, 4, 5], sampling=greedy(4, ignore_eos=True))
    status = client.wait_idle()
    by_address = {w.address: w for w in status.workers}
    for process in local.processes:
        samples = scrape(process.metrics_port)
        if process.role == "router":
            finished = samples[("splitserve_router_requests_total", (("outcome", "length"),))]
            assert finished >= 1
            assert samples[("splitserve_router_inflight_requests", ())] == 0
            assert samples[("splitserve_router_time_to_first_token_seconds_count", ())] >= 1
            continue
        worker = by_address[process.address]
        labels = (("role", process.role), ("worker_id", worker.info.worker_id))
        assert samples[("splitserve_worker_num_total_blocks", labels)] == NUM_KV_BLOCKS
        assert samples[("splitserve_worker_num_used_blocks", labels)] == 0
        assert samples[("splitserve_worker_num_cached_blocks", labels)] == (
            worker.load.num_cached_blocks
        )
        drafts = samples[("splitserve_worker_spec_decode_draft_tokens_total", labels)]
        accepted = samples[("splitserve_worker_spec_decode_accepted_tokens_total", labels)]
        assert (drafts, accepted) == (
            worker.load.num_draft_tokens,
            worker.load.num_accepted_draft_tokens,
        )
        assert 0 <= accepted <= drafts


def test_every_server_offers_reflection(cluster):
    local, _ = cluster
    expected = {
        "router": "splitserve.v1.Router",
        "prefill": "splitserve.v1.PrefillWorker",
        "decode": "splitserve.v1.DecodeWorker",
    }
    for process in local.processes:
        with grpc.insecure_channel(process.address) as channel:
            services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert {expected[process.role], "grpc.health.v1.Health"} <= services


def test_scale_without_an_orchestrator_is_failed_precondition(cluster):
    _, client = cluster
    request = router_pb2.ScaleRequest(role=worker_pb2.WORKER_ROLE_DECODE, num_workers=2)
    with pytest.raises(grpc.RpcError) as info:
        client.stub.Scale(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no-ray" in info.value.details()
    assert not client.status().pools  # a fixed cluster reports no pool sizes
