"""SIGTERM loses nothing: a worker stops taking work, ends what is left of its streams when its
grace period is over, and routers continue those streams elsewhere token-exactly."""

from __future__ import annotations

import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine import LLM, SamplingParams
from tests.services.conftest import NUM_KV_BLOCKS, greedy
from tests.waiting import wait_until

GRACE_S = 1.0
NUM_STREAMS = 8


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture(scope="module")
def cluster(start_cluster):
    return start_cluster(
        num_prefill=1, num_decode=2, extra_worker_flags=("--shutdown-grace-s", str(GRACE_S))
    )


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 480) for _ in range(rng.randrange(5, 80))] for _ in range(n)]


def test_sigterm_on_a_decode_worker_with_open_streams_fails_none(cluster, offline):
    local, client = cluster
    batch = prompts(seed=1, n=NUM_STREAMS)
    want = offline.generate(batch, SamplingParams(temperature=0.0, max_tokens=800, ignore_eos=True))
    with ThreadPoolExecutor(max_workers=NUM_STREAMS) as pool:
        futures = [
            pool.submit(client.generate, token_ids=p, sampling=greedy(800, ignore_eos=True))
            for p in batch
        ]

        def open_by_address() -> dict[str, int]:
            return {
                w.address: w.load.num_running + w.load.num_waiting + w.load.num_waiting_for_kv
                for w in client.status().workers
                if w.role == 2
            }

        wait_until(
            lambda: sum(open_by_address().values()) == NUM_STREAMS,
            120,
            f"{NUM_STREAMS} streams open on the decode workers",
        )
        busiest = max(open_by_address().items(), key=lambda item: item[1])[0]
        victim = next(p for p in local.workers("decode") if p.address == busiest)
        victim.signal(signal.SIGTERM)
        got = [f.result(timeout=180).token_ids for f in futures]
    assert got == [w.token_ids for w in want]
    assert victim.popen.wait(timeout=30) == 0
    client.wait_idle()


def test_sigterm_on_the_prefill_worker_mid_traffic_fails_none(cluster, offline):
    local, client = cluster
    batch = prompts(seed=2, n=NUM_STREAMS)
    want = offline.generate(batch, SamplingParams(temperature=0.0, max_tokens=40))
    with ThreadPoolExecutor(max_workers=NUM_STREAMS) as pool:
        futures = [pool.submit(client.generate, token_ids=p, sampling=greedy(40)) for p in batch]
        # Pacing, not waiting: SIGTERM 50 ms into the burst, while its prefills are under way
        # (they take a few ms each: too short a moment to poll for).
        time.sleep(0.05)
        prefill = local.workers("prefill")[0]
        prefill.signal(signal.SIGTERM)
        got = [f.result(timeout=180).token_ids for f in futures]
    assert got == [w.token_ids for w in want]
    assert prefill.popen.wait(timeout=30) == 0
