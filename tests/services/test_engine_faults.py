"""An engine error fails one request, not the engine; an engine that dies is replaced.

Real processes: a model whose embedding of one token is NaN (requests holding it get
non-finite logits), and a fault injected into worker processes (``faults/sitecustomize.py``)
that kills the engine loop of the first worker to see a token.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from engine import LLM, SamplingParams
from loadtest.fixtures.tiny_model import make_poisoned_model
from services.common.convert import sampling_params_to_worker
from services.common.failures import FailureKind, failure_kind
from services.launcher import LocalCluster
from services.service_process import ProcessState
from splitserve.v1 import router_pb2, worker_pb2, worker_pb2_grpc
from tests.services.conftest import NUM_KV_BLOCKS, Client, greedy, tiny_engine_config
from tests.waiting import wait_until

POISON = 7
FAULTS_DIR = Path(__file__).parent / "faults"


def clean_prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [t for t in (rng.randrange(3, 480) for _ in range(rng.randrange(8, 60))) if t != POISON]
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)


def start(cluster: LocalCluster) -> Client:
    try:
        return Client(cluster.start(timeout_s=180))
    except BaseException:
        cluster.stop()
        raise


@pytest.fixture(scope="module")
def poisoned_cluster(tiny_llama_dir, tmp_path_factory):
    model = make_poisoned_model(tiny_llama_dir, tmp_path_factory.mktemp("poisoned") / "m", POISON)
    cluster = LocalCluster(
        engine=tiny_engine_config(model),
        num_prefill=1,
        num_decode=1,
        extra_router_flags=("--local-prefill-max-tokens", "0"),
    )
    client = start(cluster)
    yield cluster, client
    client.close()
    cluster.stop()


def test_nan_logits_fail_only_their_request(poisoned_cluster, offline):
    local, client = poisoned_cluster
    pids = [p.popen.pid for p in local.processes]
    clean = clean_prompts(seed=1, n=6)
    want = offline.generate(clean, SamplingParams(temperature=0.0, max_tokens=24))
    poisoned = [*clean_prompts(seed=2, n=1)[0], POISON, 5, 9]
    sampled = router_pb2.SamplingParams(max_tokens=24, temperature=1.0, seed=3)
    with ThreadPoolExecutor(max_workers=8) as pool:
        bad = [
            pool.submit(client.generate, token_ids=poisoned, sampling=params)
            for params in (greedy(24), sampled)
        ]
        good = [pool.submit(client.generate, token_ids=p, sampling=greedy(24)) for p in clean]
        assert [f.result(timeout=120).token_ids for f in good] == [w.token_ids for w in want]
        for future in bad:
            with pytest.raises(grpc.RpcError) as info:
                future.result(timeout=120)
            assert info.value.code() == grpc.StatusCode.INTERNAL
            assert "non-finite logits" in info.value.details()
    status = client.wait_idle()
    assert all(w.healthy for w in status.workers)
    assert [p.popen.pid for p in local.processes] == pids and all(p.alive for p in local.processes)
    again = clean_prompts(seed=4, n=3)
    want = offline.generate(again, SamplingParams(temperature=0.0, max_tokens=16))
    got = [client.generate(token_ids=p, sampling=greedy(16)).token_ids for p in again]
    assert got == [w.token_ids for w in want]


def test_decode_worker_marks_a_failed_request_as_not_retryable(poisoned_cluster):
    local, client = poisoned_cluster
    with grpc.insecure_channel(local.workers("decode")[0].address) as channel:
        call = worker_pb2_grpc.DecodeWorkerStub(channel).Decode(
            worker_pb2.DecodeRequest(
                request_id="direct",
                prompt_token_ids=[5, POISON, 9],
                sampling=sampling_params_to_worker(SamplingParams(temperature=0, max_tokens=4)),
            ),
            timeout=60,
        )
        with pytest.raises(grpc.RpcError) as info:
            list(call)
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert failure_kind(info.value) is FailureKind.REQUEST
    client.wait_idle()


def test_an_engine_that_dies_is_replaced_and_its_streams_finish_elsewhere(
    tiny_llama_dir, offline, tmp_path, monkeypatch
):
    marker = tmp_path / "engine-died"
    monkeypatch.setenv("PYTHONPATH", f"{FAULTS_DIR}:{Path.cwd()}")
    monkeypatch.setenv("SPLITSERVE_TEST_ENGINE_FAULT", f"{POISON}:{marker}")
    cluster = LocalCluster(
        engine=tiny_engine_config(tiny_llama_dir),
        num_decode=2,
        mode="colocated",
    )
    client = start(cluster)
    try:
        prompts = [*clean_prompts(seed=5, n=5), [4, 5, POISON, 6]]
        params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
        want = offline.generate(prompts, params)
        with ThreadPoolExecutor(max_workers=6) as pool:
            futures = [
                pool.submit(client.generate, token_ids=p, sampling=greedy(80, ignore_eos=True))
                for p in prompts
            ]
            got = [f.result(timeout=120).token_ids for f in futures]
        assert got == [w.token_ids for w in want]
        dead_pid = int(marker.read_text())
        victim = next(p for p in cluster.workers("decode") if p.popen.pid == dead_pid)
        deadline_s = time.monotonic() + 120  # for the restart and the router seeing it

        def restarted() -> bool:
            for failure in cluster.supervise():
                assert failure.restarting and "exit code 1" in failure.error
            return victim.num_restarts > 0 and victim.state is ProcessState.SERVING

        wait_until(restarted, 120, "the dead worker's restart", 0.2)
        assert victim.popen.pid != dead_pid
        wait_until(
            lambda: all(w.healthy for w in client.status().workers),
            deadline_s - time.monotonic(),
            "the router seeing the new worker",
            0.2,
        )
        again = clean_prompts(seed=6, n=4)
        want = offline.generate(again, SamplingParams(temperature=0.0, max_tokens=12))
        with ThreadPoolExecutor(max_workers=4) as pool:
            futures = [
                pool.submit(client.generate, token_ids=p, sampling=greedy(12)) for p in again
            ]
            assert [f.result(timeout=120).token_ids for f in futures] == [w.token_ids for w in want]
    finally:
        client.close()
        cluster.stop()
