"""API keys on a real cluster's router: who may call what, and key rotation on SIGHUP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.roles import Role
from services.common.router_channel import API_KEY_ENV
from splitserve.v1 import router_pb2
from tests.services.conftest import Client, greedy
from tests.waiting import wait_until

ADMIN = "admin-key-for-the-tests-0123456789"
DATA = "data-key-for-the-tests-0123456789"
ROTATED = "rotated-data-key-0123456789abcdef"
LAUNCHER = "launcher-key-0123456789abcdef"
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(f"{ADMIN} admin\n{DATA} data\n")
    return path


@pytest.fixture(scope="module")
def cluster(start_cluster, key_file):
    local, _ = start_cluster(
        admin_api_key=LAUNCHER, extra_router_flags=("--api-key-file", str(key_file))
    )
    clients = {name: Client(local.router_address, key) for name, key in (
        ("none", ""), ("wrong", "not-a-key-0123456789abcdef"), ("data", DATA), ("admin", ADMIN),
    )}  # fmt: skip
    yield local, clients
    for client in clients.values():
        client.close()


def code_of(call, *args, **kwargs) -> grpc.StatusCode:
    """The status code ``call(*args, **kwargs)`` fails with."""
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value.code()


def test_generate_needs_a_valid_key(cluster):
    _, clients = cluster
    for name in ("none", "wrong"):
        code = code_of(clients[name].generate, token_ids=PROMPT, sampling=greedy(4))
        assert code == grpc.StatusCode.UNAUTHENTICATED
    by_data = clients["data"].generate(token_ids=PROMPT, sampling=greedy(4))
    by_admin = clients["admin"].generate(token_ids=PROMPT, sampling=greedy(4))
    assert len(by_data.token_ids) == 4
    assert by_data.token_ids == by_admin.token_ids


def test_admin_rpcs_refuse_data_keys_and_leave_the_pools_alone(cluster):
    local, clients = cluster
    before = clients["admin"].status()
    scale = router_pb2.ScaleRequest(role=Role.DECODE.to_proto(), num_workers=3)
    status = router_pb2.StatusRequest()
    explain = router_pb2.GenerateRequest(token_ids=PROMPT)
    for name, expected in (
        ("none", grpc.StatusCode.UNAUTHENTICATED),
        ("wrong", grpc.StatusCode.UNAUTHENTICATED),
        ("data", grpc.StatusCode.PERMISSION_DENIED),
    ):
        stub = clients[name].stub
        assert code_of(stub.Scale, scale, timeout=10) == expected
        assert code_of(stub.Status, status, timeout=10) == expected
        assert code_of(stub.Explain, explain, timeout=10) == expected
    after = clients["admin"].status()
    assert [(w.address, w.role) for w in after.workers] == [
        (w.address, w.role) for w in before.workers
    ]
    assert len(local.workers(Role.DECODE)) == 1
    # The admin key gets past authentication (this cluster has no orchestrator to scale it).
    code = code_of(clients["admin"].stub.Scale, scale, timeout=10)
    assert code == grpc.StatusCode.FAILED_PRECONDITION


def test_health_checks_need_no_key(cluster):
    local, _ = cluster
    with grpc.insecure_channel(local.router_address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_cli_commands_present_the_key_from_the_environment(cluster):
    local, _ = cluster

    def splitserve(key: str, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, API_KEY_ENV: key}
        return subprocess.run(
            [sys.executable, "-m", "services.cli", *args, "--target", local.router_address],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    # A data key may generate: the client waits through Generate, not Status.
    client = splitserve(DATA, "client", "--max-tokens", "4", "--json", "hello")
    assert client.returncode == 0, client.stderr
    status = splitserve(DATA, "status")
    assert status.returncode == 2
    assert "PERMISSION_DENIED" in status.stderr
    status = splitserve(ADMIN, "status", "--json")
    assert status.returncode == 0, status.stderr
    assert local.router_address.rsplit(":", 1)[0] in status.stdout


def test_sighup_rereads_the_key_file(cluster, key_file):
    local, clients = cluster
    key_file.write_text(f"{ADMIN} admin\n{ROTATED}\n")
    local.workers(Role.ROUTER)[0].signal(signal.SIGHUP)
    rotated = Client(local.router_address, ROTATED)
    try:

        def accepts_rotated() -> bool:
            try:
                rotated.generate(token_ids=PROMPT, sampling=greedy(2))
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
                return False
            return True

        wait_until(accepts_rotated, 30, "the rotated key accepted")
        code = code_of(clients["data"].generate, token_ids=PROMPT, sampling=greedy(2))
        assert code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        rotated.close()
        key_file.write_text(f"{ADMIN} admin\n{DATA} data\n")
