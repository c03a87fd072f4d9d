"""Mutual TLS inside a real cluster, TLS on the router's client port (``splitserve certs``
material): who can complete a handshake, and which identities a worker admits."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import LLM, SamplingParams
from services.certs import write_cluster_certs
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.roles import Role
from services.common.tls import Identity, TlsMaterial, member_channel_blocking
from splitserve.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.services.conftest import greedy

HOSTS = ["localhost", "127.0.0.1"]
PROMPT = [5, 17, 42, 99, 123, 7, 64, 301, 12, 88, 150, 33]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """The cluster's certificates, and a second CA's (a rogue one) with the same identities."""
    root = tmp_path_factory.mktemp("certs")
    rogue = tmp_path_factory.mktemp("rogue-certs")
    write_cluster_certs(root, HOSTS)
    write_cluster_certs(rogue, HOSTS)
    return root, rogue


@pytest.fixture(scope="module")
def cluster(start_cluster, certs):
    return start_cluster(tls_dir=str(certs[0]))


def test_generation_over_tls_is_the_offline_engines(cluster, tiny_llama_dir):
    _, client = cluster
    got = client.generate(token_ids=PROMPT, sampling=greedy(8))
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    want = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert got.token_ids == want.token_ids


def status_code(channel: grpc.Channel) -> grpc.StatusCode:
    with channel:
        try:
            router_pb2_grpc.RouterStub(channel).Status(router_pb2.StatusRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_a_client_without_the_cluster_ca_cannot_complete_a_handshake(cluster, certs):
    local, _ = cluster
    root, rogue = certs
    address = local.router_address
    assert status_code(grpc.insecure_channel(address)) == grpc.StatusCode.UNAVAILABLE
    trusts_rogue = grpc.ssl_channel_credentials((rogue / "ca.crt").read_bytes())
    assert status_code(grpc.secure_channel(address, trusts_rogue)) == (grpc.StatusCode.UNAVAILABLE)
    trusts_cluster = grpc.ssl_channel_credentials((root / "ca.crt").read_bytes())
    assert status_code(grpc.secure_channel(address, trusts_cluster)) == grpc.StatusCode.OK


def get_load(address: str, tls: TlsMaterial) -> grpc.StatusCode:
    with member_channel_blocking(address, Identity.DECODE, tls) as channel:
        try:
            worker_pb2_grpc.DecodeWorkerStub(channel).GetLoad(
                worker_pb2.GetLoadRequest(), timeout=5
            )
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_a_worker_admits_only_the_clusters_router_and_controller(cluster, certs):
    local, _ = cluster
    root, rogue = certs
    decode = local.workers(Role.DECODE)[0].address

    def material(cert_dir, identity: Identity) -> TlsMaterial:
        own = TlsMaterial.from_dir(cert_dir / identity.value)
        # Trust the cluster's CA: only the certificate presented differs.
        return TlsMaterial(own.cert_pem, own.key_pem, (root / "ca.crt").read_bytes())

    assert get_load(decode, material(root, Identity.ROUTER)) == grpc.StatusCode.OK
    assert get_load(decode, material(root, Identity.CONTROLLER)) == grpc.StatusCode.OK
    for identity in (Identity.CLIENT, Identity.DECODE, Identity.PREFILL):
        assert get_load(decode, material(root, identity)) == grpc.StatusCode.PERMISSION_DENIED
    # A certificate the cluster CA did not sign fails the handshake, whatever it claims.
    assert get_load(decode, material(rogue, Identity.ROUTER)) == grpc.StatusCode.UNAVAILABLE
    no_certificate = grpc.ssl_channel_credentials((root / "ca.crt").read_bytes())
    options = (*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", Identity.DECODE.service_name))
    with (
        grpc.secure_channel(decode, no_certificate, options=options) as channel,
        pytest.raises(grpc.RpcError) as info,
    ):
        worker_pb2_grpc.DecodeWorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # Health checks are for every cluster certificate (probes know nothing of identities).
    with member_channel_blocking(decode, Identity.DECODE, material(root, Identity.CLIENT)) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
