"""Failures degrade, never lose: lease expiry, a decode worker dying mid-stream, the prefill
worker dying mid-run. Real processes, killed with SIGKILL."""

from __future__ import annotations

import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from engine import LLM, SamplingParams
from services.common.convert import sampling_params_to_worker
from splitserve.v1 import router_pb2, worker_pb2, worker_pb2_grpc
from tests.services.conftest import NUM_KV_BLOCKS, greedy
from tests.waiting import wait_until

LEASE_TTL_S = 1.0


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture(scope="module")
def cluster(start_cluster):
    return start_cluster(
        num_prefill=1, num_decode=2, extra_worker_flags=("--lease-ttl-s", str(LEASE_TTL_S))
    )


def prompts(seed: int, n: int, max_len: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 480) for _ in range(rng.randrange(1, max_len))] for _ in range(n)]


def test_lease_expires_when_no_decode_worker_pulls(cluster):
    local, _ = cluster
    prefill = local.workers("prefill")[0]
    with grpc.insecure_channel(prefill.address) as channel:
        stub = worker_pb2_grpc.PrefillWorkerStub(channel)
        response = stub.Prefill(
            worker_pb2.PrefillRequest(
                request_id="orphan",
                prompt_token_ids=[11] * 40,
                sampling=sampling_params_to_worker(SamplingParams(temperature=0, max_tokens=8)),
            ),
            timeout=30,
        )
        assert not response.finished and len(response.kv_ref.block_ids) == 3
        load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
        assert load.num_kv_leases == 1 and load.num_used_blocks == 3

        def expired_and_freed() -> worker_pb2.WorkerLoad | None:
            load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
            return None if load.num_kv_leases or load.num_used_blocks else load

        load = wait_until(expired_and_freed, LEASE_TTL_S + 0.5, "the lease's expiry")
        assert load.num_kv_leases == 0 and load.num_used_blocks == 0
        assert load.num_leases_expired == 1
        # Release after expiry is a harmless no-op.
        released = stub.Release(worker_pb2.ReleaseRequest(request_id="orphan"), timeout=5)
        assert not released.released


# The router fences a worker after 2 failed health polls (0.5 s apart, 2 s timeout each): a
# stream on a hung decode worker continues elsewhere within about 6 s. The test allows 60 s.
HUNG_WORKER_BOUND_S = 60.0


def test_decode_worker_hung_mid_stream_continues_elsewhere_without_client_deadline(
    cluster, offline
):
    local, client = cluster
    prompt = prompts(seed=7, n=1)[0]
    want = offline.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    )
    request = router_pb2.GenerateRequest(token_ids=prompt, sampling=greedy(200, ignore_eos=True))
    call = client.stub.Generate(request)  # no deadline
    first = [*next(call).token_ids]
    while len(first) < 10:
        first.extend(next(call).token_ids)
    busy = [w for w in client.status().workers if w.role == 2 and w.load.num_running]
    assert len(busy) == 1
    victim = next(p for p in local.workers("decode") if p.address == busy[0].address)
    victim.signal(signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            rest = pool.submit(lambda: [t for m in call for t in m.token_ids])
            try:
                token_ids = first + rest.result(timeout=HUNG_WORKER_BOUND_S)
            except TimeoutError:
                call.cancel()
                raise
    finally:
        victim.signal(signal.SIGCONT)
    assert token_ids == want[0].token_ids
    wait_until(
        lambda: all(w.healthy for w in client.status().workers),
        30,
        "the resumed worker healthy again",
        0.2,
    )
    client.wait_idle()


def test_decode_worker_death_mid_stream_continues_elsewhere(cluster, offline):
    local, client = cluster
    prompt = prompts(seed=1, n=1)[0]
    want = offline.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    )
    call = client.stub.Generate(
        router_pb2.GenerateRequest(token_ids=prompt, sampling=greedy(300, ignore_eos=True)),
        timeout=120,
    )
    token_ids: list[int] = []
    killed = False
    for message in call:
        token_ids.extend(message.token_ids)
        if not killed and len(token_ids) >= 20:
            busy = [w for w in client.status().workers if w.role == 2 and w.load.num_running]
            assert len(busy) == 1
            victim = next(p for p in local.workers("decode") if p.address == busy[0].address)
            victim.signal(signal.SIGKILL)
            killed = True
    assert killed
    assert token_ids == want[0].token_ids
    status = client.status()
    assert sum(not w.healthy for w in status.workers) == 1


def test_prefill_worker_death_does_not_fail_requests(cluster, offline):
    local, client = cluster
    batch = prompts(seed=2, n=8)
    want = offline.generate(batch, SamplingParams(temperature=0.0, max_tokens=40))
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(client.generate, token_ids=p, sampling=greedy(40)) for p in batch]
        # Pacing, not waiting: the kill lands 50 ms into the burst, while its prefills are under
        # way (they take a few ms each: too short a moment to poll for).
        time.sleep(0.05)
        local.workers("prefill")[0].signal(signal.SIGKILL)
        got = [f.result(timeout=120) for f in futures]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]

    after = prompts(seed=3, n=4)
    want = offline.generate(after, SamplingParams(temperature=0.0, max_tokens=16))
    for prompt, expected in zip(after, want, strict=True):
        got = client.generate(token_ids=prompt, sampling=greedy(16))
        assert got.token_ids == expected.token_ids
        # The decode worker prefilled locally: every prompt token was computed there.
        assert got.last.usage.prompt_tokens == len(prompt)
    prefill_status = [w for w in client.status().workers if w.role == 1]
    assert not prefill_status[0].healthy


def test_overload_gets_resource_exhausted(start_cluster):
    _, client = start_cluster(
        num_decode=1, mode="colocated", extra_router_flags=("--max-inflight-requests", "1")
    )
    call = client.stub.Generate(
        router_pb2.GenerateRequest(token_ids=[6] * 20, sampling=greedy(900, ignore_eos=True)),
        timeout=60,
    )
    next(iter(call))
    with pytest.raises(grpc.RpcError) as info:
        client.generate(token_ids=[6], sampling=greedy(2))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    call.cancel()
    client.wait_idle()
    assert client.generate(token_ids=[6], sampling=greedy(2)).last.finish_reason
