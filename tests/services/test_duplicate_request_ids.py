"""A worker refuses, with ALREADY_EXISTS, a request id that is live on it or whose KV it holds
under a lease: a reused id must never take over another request's blocks. Real worker
processes, called directly over gRPC as the router calls them."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from engine import SamplingParams
from services.common.convert import sampling_params_to_worker
from services.launcher import LocalCluster
from splitserve.v1 import worker_pb2, worker_pb2_grpc
from tests.services.test_slow_reader import SLOW_READER_OPTIONS
from tests.services.worker_calls import Workers

FIRST_PROMPT = list(range(3, 43))
SECOND_PROMPT = list(range(100, 140))


@pytest.fixture(scope="module")
def cluster(start_cluster) -> LocalCluster:
    # A lease far longer than the test, so that only the test releases it.
    local, _ = start_cluster(extra_worker_flags=("--lease-ttl-s", "600"))
    return local


@pytest.fixture(scope="module")
def workers(cluster: LocalCluster) -> Iterator[Workers]:
    workers = Workers(cluster.workers("prefill")[0], cluster.workers("decode")[0])
    yield workers
    workers.close()


def test_a_prefill_worker_refuses_the_id_of_a_request_whose_kv_it_leases(workers: Workers):
    release = worker_pb2.ReleaseRequest(request_id="dup")
    assert workers.prefill_only("dup", FIRST_PROMPT, 8).HasField("kv_ref")
    with pytest.raises(grpc.RpcError) as refused:
        workers.prefill_only("dup", SECOND_PROMPT, 8)
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "'dup'" in refused.value.details() and "lease" in refused.value.details()
    # The refusal left the lease alone: the test releases it, once.
    assert workers.prefill.Release(release, timeout=30).released
    assert workers.prefill_only("dup", SECOND_PROMPT, 8).HasField("kv_ref")  # free again
    assert workers.prefill.Release(release, timeout=30).released


def test_a_decode_worker_refuses_the_id_of_a_request_it_is_streaming(cluster: LocalCluster):
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True, logprobs=20)
    request = worker_pb2.DecodeRequest(
        request_id="dup", prompt_token_ids=[5, 6, 7], sampling=sampling_params_to_worker(params)
    )
    address = cluster.workers("decode")[0].address
    with grpc.insecure_channel(address, options=SLOW_READER_OPTIONS) as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        # Unread after its first message, the stream stays open (the request pauses).
        streaming = stub.Decode(request, timeout=60)
        assert next(streaming).token_ids
        with pytest.raises(grpc.RpcError) as refused:
            next(stub.Decode(request, timeout=60))
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "'dup'" in refused.value.details()
        streaming.cancel()
