"""Real local clusters (router + worker processes over loopback gRPC) and a small client."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import EngineConfig
from loadtest.fixtures.redis_server import RedisServer
from services.common.router_channel import open_router_channel
from services.launcher import LocalCluster
from services.service_process import PortReservation
from splitserve.v1 import router_pb2, router_pb2_grpc, worker_pb2
from tests.waiting import wait_until

NUM_KV_BLOCKS = 256


def tiny_engine_config(model_dir) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, num_threads=1
    )


@dataclass(slots=True)
class Generation:
    """Everything a client saw for one request."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[worker_pb2.TokenLogprob] = field(default_factory=list)
    messages: list[router_pb2.GenerateResponse] = field(default_factory=list)

    @property
    def last(self) -> router_pb2.GenerateResponse:
        return self.messages[-1]


class Client:
    """Synchronous gRPC client of one router."""

    def __init__(self, address: str, api_key: str = "", ca_file: str = "") -> None:
        self.channel = open_router_channel(address, api_key, ca_file)
        self.stub = router_pb2_grpc.RouterStub(self.channel)

    def generate(self, timeout_s: float = 120.0, **request_fields) -> Generation:
        request = router_pb2.GenerateRequest(**request_fields)
        out = Generation()
        for message in self.stub.Generate(request, timeout=timeout_s):
            out.messages.append(message)
            out.token_ids.extend(message.token_ids)
            out.text += message.text
            out.logprobs.extend(message.logprobs)
        return out

    def status(self) -> router_pb2.StatusResponse:
        # Generous: a fresh poll of every worker, on two cores shared with every engine.
        return self.stub.Status(router_pb2.StatusRequest(), timeout=30)

    def wait_idle(self, timeout_s: float = 10.0) -> router_pb2.StatusResponse:
        """Poll Status until no worker holds a block, a lease or a request; return it."""

        def idle() -> router_pb2.StatusResponse | None:
            status = self.status()
            busy = [
                w.address
                for w in status.workers
                if w.healthy
                and (w.load.num_used_blocks or w.load.num_kv_leases or w.load.num_running)
            ]
            return status if not busy and status.num_inflight_requests == 0 else None

        return wait_until(idle, timeout_s, lambda: f"idle workers (status now: {self.status()})")

    def close(self) -> None:
        self.channel.close()


@contextmanager
def serving(local: LocalCluster, timeout_s: float = 600) -> Iterator[tuple[LocalCluster, Client]]:
    """Start ``local`` and yield it with a client of its first router; stop both on exit (on a
    failed start too)."""
    try:
        client = Client(local.start(timeout_s=timeout_s))
    except BaseException:
        local.stop()
        raise
    try:
        yield local, client
    finally:
        client.close()
        local.stop()


def greedy(max_tokens: int, **extra) -> router_pb2.SamplingParams:
    return router_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)


@pytest.fixture(scope="module")
def start_cluster(tiny_llama_dir) -> Iterator[Callable[..., tuple[LocalCluster, Client]]]:
    """Factory: ``start_cluster(num_prefill=1, num_decode=1, mode=..., ...)``; all stopped at the
    end of the module. Every prompt goes through a prefill worker (``--local-prefill-max-tokens
    0``) unless ``extra_router_flags`` sets another threshold."""
    started: list[tuple[LocalCluster, Client]] = []

    def start(**kwargs) -> tuple[LocalCluster, Client]:
        router_flags = ("--local-prefill-max-tokens", "0", *kwargs.pop("extra_router_flags", ()))
        cluster = LocalCluster(
            engine=tiny_engine_config(tiny_llama_dir), extra_router_flags=router_flags, **kwargs
        )
        try:
            address = cluster.start(timeout_s=180)
        except BaseException:
            cluster.stop()
            raise
        ca_file = f"{cluster.tls_dir}/ca.crt" if cluster.tls_dir else ""
        client = Client(address, cluster.admin_api_key, ca_file)
        started.append((cluster, client))
        return cluster, client

    yield start
    for cluster, client in started:
        client.close()
        cluster.stop()


def scrape(
    port: int, host: str = "127.0.0.1"
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of a process's /metrics as {(name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory) -> Iterator[RedisServer]:
    """A real ``redis-server`` on a free loopback port for the test module."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


def stop_like_ctrl_c(proc: subprocess.Popen) -> None:
    """Ctrl-C a ``splitserve up`` process, as a user would (it stops its services), then kill
    whatever it left behind."""
    if proc.poll() is not None:
        return
    services = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    _, alive = psutil.wait_procs(services, timeout=10)
    for service in alive:
        service.kill()


@contextmanager
def up_no_ray(*flags: str) -> Iterator[str]:
    """``splitserve up --no-ray`` with ``flags`` on a free port, until its banner says it
    listens; yields the router's address, then stops it as Ctrl-C does."""
    reservation = PortReservation()  # held while `up` binds it
    port = reservation.port
    argv = [sys.executable, "-m", "services.cli", "up", *flags, "--port", str(port), "--no-ray"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        banner = proc.stdout.readline()
        assert f"listening on 127.0.0.1:{port}" in banner, banner
        yield f"127.0.0.1:{port}"
    finally:
        stop_like_ctrl_c(proc)
        reservation.close()
