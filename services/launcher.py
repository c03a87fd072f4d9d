"""``splitserve up --no-ray``: run a router and its workers as local processes.

Each process is the plain service (``python -m services.prefill`` / ``.decode`` / ``.router``),
exactly what a Kubernetes pod runs; the launcher only picks ports, passes the engine flags to
every worker, waits for gRPC health, and tears everything down on Ctrl-C or when one of the
processes it cannot lose (the router) exits. ``services.cluster`` runs the same services as Ray
actors.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.config import EngineConfig
from engine.flags import to_argv
from services.common.grpc_server import CHANNEL_OPTIONS

logger = logging.getLogger(__name__)

_HEALTH_POLL_S = 0.2


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass(slots=True)
class ServiceProcess:
    """One child process and the gRPC address it serves."""

    role: str
    address: str
    metrics_port: int
    argv: list[str]
    popen: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str]) -> None:
        self.popen = subprocess.Popen(self.argv, env=env, start_new_session=True)

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            assert self.popen is not None
            os.killpg(self.popen.pid, sig)


@dataclass(slots=True)
class LocalCluster:
    """Router + workers on this machine. ``start()`` returns once everything is healthy."""

    engine: EngineConfig
    num_prefill: int = 1
    num_decode: int = 1
    num_routers: int = 1
    mode: str = "disaggregated"
    host: str = "127.0.0.1"
    port: int = 0
    extra_worker_flags: Sequence[str] = ()
    extra_router_flags: Sequence[str] = ()
    # Flags for the workers of one role only ("prefill" / "decode"), after the shared ones.
    extra_role_flags: Mapping[str, Sequence[str]] = field(default_factory=dict)
    # --cpu-cores of each worker in start order (prefill ones first); empty: no pinning.
    worker_cpu_cores: Sequence[str] = ()
    log_level: str = "WARNING"
    processes: list[ServiceProcess] = field(default_factory=list)

    @property
    def router_address(self) -> str:
        return self.workers("router")[0].address

    def workers(self, role: str) -> list[ServiceProcess]:
        return [p for p in self.processes if p.role == role]

    def start(self, timeout_s: float = 300.0) -> str:
        """Spawn workers, wait for their health, then the routers (sharing the workers); return
        the first router's address."""
        if self.mode == "colocated":
            self.num_prefill = 0
        env = dict(os.environ, SPLITSERVE_LOG_LEVEL=self.log_level)
        python = sys.executable
        worker_argv = [*to_argv(self._engine_for_workers()), *self.extra_worker_flags]
        num_workers = self.num_prefill + self.num_decode
        if self.worker_cpu_cores and len(self.worker_cpu_cores) != num_workers:
            raise ValueError(f"worker_cpu_cores needs one entry per worker ({num_workers})")
        cpu_cores = iter(self.worker_cpu_cores)
        for role, count in (("prefill", self.num_prefill), ("decode", self.num_decode)):
            for _ in range(count):
                port, metrics_port = free_port(self.host), free_port(self.host)
                argv = [
                    python, "-m", f"services.{role}", "--host", self.host, "--port", str(port),
                    "--metrics-port", str(metrics_port),
                ]  # fmt: skip
                argv += [*worker_argv, *self.extra_role_flags.get(role, ())]
                if self.worker_cpu_cores:
                    argv += ["--cpu-cores", next(cpu_cores)]
                address = f"{self.host}:{port}"
                self.processes.append(ServiceProcess(role, address, metrics_port, argv))
        for process in self.processes:
            process.start(env)
        deadline_s = time.monotonic() + timeout_s
        for process in self.processes:
            wait_healthy(process, deadline_s)
        routers = [
            self._router_process(self.port if i == 0 and self.port else free_port(self.host))
            for i in range(self.num_routers)
        ]
        self.processes.extend(routers)
        for router in routers:
            router.start(env)
        for router in routers:
            wait_healthy(router, deadline_s)
        return self.router_address

    def _router_process(self, port: int) -> ServiceProcess:
        metrics_port = free_port(self.host)
        return ServiceProcess(
            "router",
            f"{self.host}:{port}",
            metrics_port,
            [
                sys.executable, "-m", "services.router",
                "--model", self.engine.model,
                "--host", self.host,
                "--port", str(port),
                "--mode", self.mode,
                "--metrics-port", str(metrics_port),
                "--prefill-workers", ",".join(p.address for p in self.workers("prefill")),
                "--decode-workers", ",".join(p.address for p in self.workers("decode")),
                *self.extra_router_flags,
            ],
        )  # fmt: skip

    def _engine_for_workers(self) -> EngineConfig:
        return split_threads(self.engine, self.num_prefill + self.num_decode)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM everything (router first), then SIGKILL what is left after ``timeout_s``."""
        for process in reversed(self.processes):
            process.signal(signal.SIGTERM)
        deadline_s = time.monotonic() + timeout_s
        for process in self.processes:
            if process.popen is None:
                continue
            try:
                process.popen.wait(max(deadline_s - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.signal(signal.SIGKILL)
                process.popen.wait()


def split_threads(engine: EngineConfig, num_engines: int) -> EngineConfig:
    """Split the cores between ``num_engines`` engine processes unless the thread count was
    given."""
    if engine.num_threads is not None:
        return engine
    threads = max((os.cpu_count() or 1) // max(num_engines, 1), 1)
    return dataclasses.replace(engine, num_threads=threads)


def wait_healthy(process: ServiceProcess, deadline_s: float) -> None:
    """Block until ``process`` answers SERVING on gRPC health; raise if it dies or times out."""
    with grpc.insecure_channel(process.address, options=CHANNEL_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if not process.alive:
                raise RuntimeError(f"{process.role} process ({' '.join(process.argv)}) exited")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline_s:
                raise TimeoutError(f"{process.role} at {process.address} is not healthy in time")
            time.sleep(_HEALTH_POLL_S)
