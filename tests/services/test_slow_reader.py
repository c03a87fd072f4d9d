"""A reader that stops reading: the decode worker pauses the request (its memory stays bounded)
and aborts it after --stream-idle-timeout-s, freeing its blocks."""

from __future__ import annotations

import time

import grpc
import psutil
import pytest

from engine import SamplingParams
from services.common.convert import sampling_params_to_worker
from splitserve.v1 import worker_pb2, worker_pb2_grpc
from tests.services.conftest import greedy
from tests.waiting import wait_until

IDLE_TIMEOUT_S = 3.0
# A tiny receive window, so that gRPC flow control stops the worker's writes soon after the
# reader stops (BDP probing would grow the window to megabytes on loopback).
SLOW_READER_OPTIONS = (("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0))


@pytest.fixture(scope="module")
def cluster(start_cluster):
    return start_cluster(
        num_decode=1,
        mode="colocated",
        extra_worker_flags=("--stream-idle-timeout-s", str(IDLE_TIMEOUT_S)),
    )


def test_a_stalled_reader_pauses_its_request_then_gets_it_aborted(cluster):
    local, client = cluster
    decode = local.workers("decode")[0]
    worker_rss = psutil.Process(decode.popen.pid).memory_info().rss
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True, logprobs=20)
    with grpc.insecure_channel(decode.address, options=SLOW_READER_OPTIONS) as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        call = stub.Decode(
            worker_pb2.DecodeRequest(
                request_id="stalled",
                prompt_token_ids=[5, 6, 7],
                sampling=sampling_params_to_worker(params),
            )
        )
        first = next(call)  # then read nothing more
        assert first.token_ids

        def load() -> worker_pb2.WorkerLoad:
            return stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)

        # Unread, 1000 tokens take the tiny model well under a second; the request is paused
        # instead, holding its blocks, until the idle timeout aborts it. The second is the
        # point: the request must still be there after it.
        time.sleep(1.0)
        assert load().num_running == 1
        wait_until(
            lambda: not load().num_running and not load().num_used_blocks,
            IDLE_TIMEOUT_S + 30,
            "the abort of the stalled stream",
            0.1,
        )
        received = [first]
        with pytest.raises(grpc.RpcError) as info:
            received.extend(call)
        assert info.value.code() == grpc.StatusCode.ABORTED
        assert "--stream-idle-timeout-s" in info.value.details()
        assert sum(len(m.token_ids) for m in received) < 1000
    growth_mib = (psutil.Process(decode.popen.pid).memory_info().rss - worker_rss) / 2**20
    assert growth_mib < 64, f"the decode worker grew by {growth_mib:.0f} MiB"
    # The worker serves on.
    assert client.generate(token_ids=[5, 6, 7], sampling=greedy(4)).last.finish_reason
