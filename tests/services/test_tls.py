"""Mutual TLS inside a real cluster, TLS on the router's client port (``splitserve certs``
material): who can complete a handshake, which identities a worker admits, and what a decode
worker does with a ``kv_peer`` outside the cluster."""

from __future__ import annotations

import dataclasses
import ssl
from collections.abc import Callable
from pathlib import Path

import grpc
import openai
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import LLM, SamplingParams
from kvtransfer.base import KVRef
from kvtransfer.registry import make_backend
from kvtransfer.tls import KVTransferTls
from services.certs import write_cluster_certs
from services.common.convert import kv_ref_to_proto, peer_info_to_proto, sampling_params_to_worker
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.roles import Role
from services.common.tls import TlsMaterial, member_channel_blocking, service_name
from splitserve.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.services.conftest import greedy, tiny_engine_config

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
    # tcp: KV transfers under the cluster's mutual TLS too (nixl has none).
    return start_cluster(tls_dir=str(certs[0]), extra_worker_flags=("--kv-transfer", "tcp"))


def test_generation_over_tls_is_the_offline_engines(cluster, tiny_llama_dir):
    _, client = cluster
    got = client.generate(token_ids=PROMPT, sampling=greedy(8))
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    want = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert got.token_ids == want.token_ids


def call_code(channel: grpc.Channel, call: Callable[[grpc.Channel], object]) -> grpc.StatusCode:
    """The status of ``call(channel)`` (OK when it returns); the channel is closed after."""
    with channel:
        try:
            call(channel)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def status_code(channel: grpc.Channel) -> grpc.StatusCode:
    return call_code(
        channel,
        lambda ch: router_pb2_grpc.RouterStub(ch).Status(router_pb2.StatusRequest(), timeout=5),
    )


def test_a_client_without_the_cluster_ca_cannot_complete_a_handshake(cluster, certs):
    local, _ = cluster
    root, rogue = certs
    address = local.router_address
    assert status_code(grpc.insecure_channel(address)) == grpc.StatusCode.UNAVAILABLE
    trusts_rogue = grpc.ssl_channel_credentials((rogue / "ca.crt").read_bytes())
    assert status_code(grpc.secure_channel(address, trusts_rogue)) == (grpc.StatusCode.UNAVAILABLE)
    trusts_cluster = grpc.ssl_channel_credentials((root / "ca.crt").read_bytes())
    assert status_code(grpc.secure_channel(address, trusts_cluster)) == grpc.StatusCode.OK


def material(cert_dir: Path, identity: Role, ca_dir: Path) -> TlsMaterial:
    """``identity``'s certificate and key from ``cert_dir``, trusting ``ca_dir``'s CA."""
    own = TlsMaterial.from_dir(cert_dir / identity.value)
    return TlsMaterial(own.cert_pem, own.key_pem, (ca_dir / "ca.crt").read_bytes())


def get_load(address: str, tls: TlsMaterial) -> grpc.StatusCode:
    return call_code(
        member_channel_blocking(address, Role.DECODE, tls),
        lambda ch: worker_pb2_grpc.DecodeWorkerStub(ch).GetLoad(
            worker_pb2.GetLoadRequest(), timeout=5
        ),
    )


def test_a_worker_admits_only_the_clusters_router_and_controller(cluster, certs):
    local, _ = cluster
    root, rogue = certs
    decode = local.workers(Role.DECODE)[0].address

    assert get_load(decode, material(root, Role.ROUTER, root)) == grpc.StatusCode.OK
    assert get_load(decode, material(root, Role.CONTROLLER, root)) == grpc.StatusCode.OK
    for identity in (Role.CLIENT, Role.DECODE, Role.PREFILL):
        assert get_load(decode, material(root, identity, root)) == grpc.StatusCode.PERMISSION_DENIED
    # A certificate the cluster CA did not sign fails the handshake, whatever it claims.
    assert get_load(decode, material(rogue, Role.ROUTER, root)) == grpc.StatusCode.UNAVAILABLE
    no_certificate = grpc.ssl_channel_credentials((root / "ca.crt").read_bytes())
    options = (*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", service_name(Role.DECODE)))
    with (
        grpc.secure_channel(decode, no_certificate, options=options) as channel,
        pytest.raises(grpc.RpcError) as info,
    ):
        worker_pb2_grpc.DecodeWorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # Health checks are for every cluster certificate (probes know nothing of identities).
    with member_channel_blocking(decode, Role.DECODE, material(root, Role.CLIENT, root)) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("attacker", ["plaintext", "another CA"])
def test_a_decode_request_naming_a_forged_kv_peer_pulls_nothing(
    cluster, certs, tiny_llama_dir, attacker
):
    """Even a call with the router's own identity (a compromised router) cannot make a decode
    worker pull from a source outside the cluster: the KV connection's mutual TLS refuses it,
    the worker computes the prompt itself, and what it caches is the true KV."""
    local, _ = cluster
    root, rogue = certs
    # Full blocks, cached once computed; one prompt per case, so none hits another's blocks.
    offset = len(attacker)
    prompt = [(7 * i + offset) % 250 + 1 for i in range(40)]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    offline = LLM.from_config(tiny_engine_config(tiny_llama_dir))
    want = offline.generate([prompt], params)[0].token_ids
    tls = None
    if attacker == "another CA":
        tls = KVTransferTls.from_dir(rogue / "prefill", {"decode"})
    source = make_backend("tcp", f"attacker-{attacker}", tls=tls)
    spec = offline.engine.kv_cache_spec
    kv_cache = torch.full_like(offline.engine.kv_cache, 7.0)  # bytes no forward pass produces
    peer = source.register_kv_cache(kv_cache, spec)
    block_ids = list(range(-(-len(prompt) // spec.block_size)))
    kv_ref = KVRef(peer.engine_id, "bait", tuple(block_ids), len(prompt))
    kv_ref = dataclasses.replace(kv_ref, grant=source.publish("bait", block_ids))
    decode = local.workers(Role.DECODE)[0].address
    as_router = material(root, Role.ROUTER, root)

    def decode_call(request_id: str, **kv) -> list[worker_pb2.DecodeResponse]:
        request = worker_pb2.DecodeRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            output_token_ids=want[:1],
            sampling=sampling_params_to_worker(params),
            **kv,
        )
        with member_channel_blocking(decode, Role.DECODE, as_router) as channel:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
            return list(stub.Decode(request, timeout=60))

    try:
        forged = decode_call(
            f"forged-{attacker}", kv_ref=kv_ref_to_proto(kv_ref), kv_peer=peer_info_to_proto(peer)
        )
        assert source.take_released() == []  # the source never heard from the decode worker
    finally:
        source.close()
    tokens = [token for response in forged for token in response.token_ids]
    assert want[:1] + tokens == want
    assert forged[-1].kv_transfer_failed and forged[-1].num_transferred_blocks == 0
    assert forged[-1].num_cached_tokens == 0
    # The same prompt again, prefilled there: it hits the blocks the worker computed, which hold
    # the true KV (its tokens are the offline engine's), not the attacker's bytes.
    again = decode_call(f"again-{attacker}")
    assert want[:1] + [token for response in again for token in response.token_ids] == want
    assert again[-1].num_cached_tokens >= 32


def test_the_http_api_serves_https_with_the_router_certificate(cluster, certs):
    """The OpenAI API on the same certificate: the cluster CA verifies it, a rogue CA and
    plaintext do not get an answer."""
    local, client = cluster
    root, rogue = certs
    assert local.http_url.startswith("https://127.0.0.1:")
    options = {"base_url": f"{local.http_url}/v1", "api_key": "unused", "max_retries": 0}
    trusted = ssl.create_default_context(cafile=str(root / "ca.crt"))
    with openai.OpenAI(**options, http_client=openai.DefaultHttpxClient(verify=trusted)) as api:
        got = api.completions.create(
            model=client.status().model, prompt=PROMPT, max_tokens=8, temperature=0
        )
    assert got.choices[0].text == client.generate(token_ids=PROMPT, sampling=greedy(8)).text
    untrusted = ssl.create_default_context(cafile=str(rogue / "ca.crt"))
    rogue_client = openai.DefaultHttpxClient(verify=untrusted)
    with (
        openai.OpenAI(**options, http_client=rogue_client) as api,
        pytest.raises(openai.APIConnectionError),
    ):
        api.models.list()
    plain = {**options, "base_url": options["base_url"].replace("https://", "http://")}
    with openai.OpenAI(**plain) as api, pytest.raises(openai.APIConnectionError):
        api.models.list()
