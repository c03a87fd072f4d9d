"""Each installed KV transfer backend end to end, through real worker processes: greedy output
identical to the offline engine, suffix-only pulls, lease expiry, and a prefill worker killed
during a transfer (the decode side fails the read, recomputes, and the request completes)."""

from __future__ import annotations

import random
import signal
import threading

import pytest

from engine import LLM, SamplingParams
from kvtransfer.registry import available_backends
from services.common.convert import sampling_params_to_worker
from splitserve.v1 import worker_pb2
from tests.services.conftest import NUM_KV_BLOCKS, greedy, scrape
from tests.services.worker_calls import Workers
from tests.waiting import wait_until

LEASE_TTL_S = 1.0
KV_IO_TIMEOUT_S = 2.0
BLOCK_SIZE = 16
BACKENDS = [name for name in available_backends() if name != "inproc"]


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture(scope="module", params=BACKENDS)
def cluster(request, start_cluster):
    flags = ("--kv-transfer", request.param, "--lease-ttl-s", str(LEASE_TTL_S),
             "--kv-io-timeout-s", str(KV_IO_TIMEOUT_S))  # fmt: skip
    local, client = start_cluster(num_prefill=1, num_decode=1, extra_worker_flags=flags)
    return request.param, local, client


@pytest.fixture(scope="module")
def workers(cluster):
    local = cluster[1]
    workers = Workers(local.workers("prefill")[0], local.workers("decode")[0])
    yield workers
    workers.close()


def make_prompts(seed: int, lens) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 480) for _ in range(n)] for n in lens]


def test_status_shows_the_backend_of_every_worker(cluster):
    name, _, client = cluster
    assert {w.info.kv_transfer_backend for w in client.status().workers} == {name}


def test_greedy_output_is_identical_to_the_offline_engine(cluster, offline):
    _, _, client = cluster
    prompts = make_prompts(seed=0, lens=(1, 5, 16, 17, 48, 97, 200))
    want = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    for prompt, expected in zip(prompts, want, strict=True):
        assert client.generate(token_ids=prompt, sampling=greedy(12)).token_ids == (
            expected.token_ids
        )
    client.wait_idle()


def test_decode_worker_holding_the_prefix_pulls_only_the_suffix(workers, offline):
    shared = make_prompts(seed=1, lens=(48,))[0]  # three full blocks
    first_prompt = [*shared, 5, 6]  # 50 tokens: 4 blocks
    second_prompt = [*shared, *range(9, 26)]  # 65 tokens: 5 blocks, 3 cached on the decode side
    want = offline.generate(
        [first_prompt, second_prompt], SamplingParams(temperature=0.0, max_tokens=4)
    )
    token_ids, last = workers.prefill_then_decode("suffix-a", first_prompt, 4)
    assert token_ids == want[0].token_ids
    assert last.num_transferred_blocks == 4 and not last.kv_transfer_failed
    token_ids, last = workers.prefill_then_decode("suffix-b", second_prompt, 4)
    assert token_ids == want[1].token_ids
    assert last.num_transferred_blocks == 2 and not last.kv_transfer_failed
    assert last.num_cached_tokens == len(second_prompt)


def test_decode_worker_exports_its_pulls(cluster, workers, offline):
    name, local, client = cluster
    model = ("model_name", client.status().model)
    before = scrape(local.workers("decode")[0].metrics_port)
    workers.prefill_then_decode("metrics", make_prompts(seed=5, lens=(40,))[0], 2)
    after = scrape(local.workers("decode")[0].metrics_port)
    done = ("splitserve_kv_pull_seconds_count", (("backend", name), model, ("outcome", "done")))
    assert after[done] - before.get(done, 0) == 1
    blocks = ("splitserve_kv_pulled_blocks_total", (("backend", name), model))
    assert after[blocks] - before.get(blocks, 0) == 3  # 40 tokens: 3 blocks, none cached
    num_bytes = ("splitserve_kv_pulled_bytes_total", (("backend", name), model))
    assert (
        after[num_bytes] - before.get(num_bytes, 0) == 3 * offline.engine.kv_cache_spec.block_bytes
    )
    # The decode worker stepped at least once per generated token after the first.
    steps = ("splitserve_engine_step_seconds_count", (model,))
    assert after[steps] - before.get(steps, 0) >= 1


def test_unpulled_lease_expires_and_frees_the_prefill_blocks(workers):
    response = workers.prefill_only("orphan", [11] * 40, max_tokens=8)
    assert len(response.kv_ref.block_ids) == 3
    load = workers.prefill.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
    assert load.num_kv_leases == 1

    def lease_gone() -> worker_pb2.WorkerLoad | None:
        load = workers.prefill.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
        return None if load.num_kv_leases else load

    load = wait_until(lease_gone, LEASE_TTL_S + 5, "the unpulled lease's expiry", 0.1)
    assert load.num_kv_leases == 0 and load.num_leases_expired >= 1
    assert load.num_used_blocks == 0


def test_prefill_killed_during_the_transfer_is_recomputed_on_the_decode_side(workers, offline):
    """Runs last: it kills the prefill worker. The worker is stopped (so its KV cannot be read)
    before the decode side starts pulling, and killed while the pull waits on it."""
    prompt = make_prompts(seed=2, lens=(90,))[0]
    want = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10))[0]
    sampling = sampling_params_to_worker(SamplingParams(temperature=0, max_tokens=10))
    first = workers.prefill_only("killed", prompt, max_tokens=10)
    workers.prefill_process.signal(signal.SIGSTOP)
    killer = threading.Timer(0.5, workers.prefill_process.signal, args=(signal.SIGKILL,))
    killer.start()
    try:
        token_ids, last = workers.decode_with("killed", prompt, sampling, first)
    finally:
        killer.join()
    assert last.kv_transfer_failed and last.num_transferred_blocks == 0
    assert token_ids == want.token_ids

    def retired() -> worker_pb2.WorkerLoad | None:
        load = workers.decode.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
        return None if load.num_running else load

    # The last message leaves before the engine retires the request: give it a moment.
    load = wait_until(retired, 5, "the decode engine retiring the request")
    assert load.num_transfers_failed == 1 and load.num_running == 0
