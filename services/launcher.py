"""``splitserve up --no-ray``: run a router and its workers as local processes.

Each process is the plain service (``python -m services.prefill`` / ``.decode`` / ``.router``),
exactly what a Kubernetes pod runs; the launcher only picks ports, passes the engine flags to
every worker, starts the routers alongside the workers, waits for gRPC health, and tears
everything down on Ctrl-C or when one of the processes it cannot lose (the router) exits.
``services.cluster`` runs the same services as Ray actors.

Ports are handed over without a window in which another process could take them: the launcher
holds each port it picks (``PortReservation``) for as long as its process may bind it, restarts
included, and the process binds it while it is held. A port that is taken anyway fails the
process's start (the servers never share a port: no ``SO_REUSEPORT``).

Each process's stderr passes through to the launcher's, which keeps its last lines: a process
that exits is reported with its exit status and the last line it wrote (a worker that fails to
load its model: the exception). A worker that exits after it served (its engine died, it was
killed) is restarted on the same address, where the routers find it again. One that exits
before it ever served is not (it would only fail again): the launcher answers on its address
in its place, every call with UNAVAILABLE and that reason, so that the routers, and through
them ``Router.Status`` and every client, say why it does not serve.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from engine.config import EngineConfig
from engine.flags import env_name, to_argv
from services.common.roles import ClusterMode, Role
from services.common.router_channel import api_key_metadata
from services.common.tls import (
    TlsMaterial,
    identity_tls_dir,
    member_channel_blocking,
    read_tls_dir,
)
from services.service_process import (
    PortReservation,
    ProcessState,
    ServiceProcess,
    serves,
    wait_healthy,
    wait_while_alive,
)
from services.startup import WorkerFailure
from splitserve.v1 import router_pb2, router_pb2_grpc

logger = logging.getLogger(__name__)

# A router's Status call, which polls every worker, may take a few health checks' time.
_STATUS_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one process of a ``LocalCluster`` runs: the address it binds and advertises
    (gRPC, metrics, KV) and the command its own is run under (``argv_prefix``, e.g.
    ``ip netns exec NS`` for a test host of ``loadtest.fixtures.netns_hosts``)."""

    host: str
    argv_prefix: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelWorkers:
    """Another served model's workers in a ``LocalCluster``: how many of each role, and the
    flags that make them that model (``--model``, ``--served-model-name``, its own flags),
    set over the shared ones."""

    num_prefill: int
    num_decode: int
    flags: tuple[str, ...]


@dataclass(slots=True)
class LocalCluster:
    """Router + workers on this machine. ``start()`` returns once everything is healthy."""

    engine: EngineConfig
    num_prefill: int = 1
    num_decode: int = 1
    num_routers: int = 1
    mode: ClusterMode = ClusterMode.DISAGGREGATED
    host: str = "127.0.0.1"
    port: int = 0
    # The first router's HTTP API port (the next ones: +1, +2, ...; 0: free ports; None: off).
    http_port: int | None = 0
    extra_worker_flags: Sequence[str] = ()
    extra_router_flags: Sequence[str] = ()
    # Flags for the workers of one role only, after the shared ones.
    extra_role_flags: Mapping[Role, Sequence[str]] = field(default_factory=dict)
    # More models' workers beside ``engine``'s (the routers learn each from its workers).
    extra_models: Sequence[ModelWorkers] = ()
    # --cpu-cores of each worker in start order (prefill ones first); empty: no pinning.
    worker_cpu_cores: Sequence[str] = ()
    log_level: str = "WARNING"
    # The key of the launcher's own Status calls when the routers take API keys (the routers
    # get it through their environment, SPLITSERVE_ADMIN_API_KEY).
    admin_api_key: str = field(default="", repr=False)
    # The root of `splitserve certs`' output: every process serves (mutual) TLS with its
    # role's directory, and the launcher calls them as the controller (empty: plaintext).
    tls_dir: str = ""
    # Where each process runs, by role and index among its role (None: all on ``host``). The
    # ports are then picked free on loopback: each placed host has a network of its own.
    placement: Callable[[Role, int], Placement] | None = None
    processes: list[ServiceProcess] = field(default_factory=list)
    _env: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    _tls: TlsMaterial | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        # Given as its name (a test, a caller's literal): the member, so that `is` holds.
        self.mode = ClusterMode(self.mode)

    @property
    def router_address(self) -> str:
        return self.workers(Role.ROUTER)[0].address

    def workers(self, role: Role) -> list[ServiceProcess]:
        return [p for p in self.processes if p.role == role]

    def start(self, timeout_s: float = 300.0) -> str:
        """``launch``, then block until every process serves and every router routes to every
        worker; return the first router's address. Raises ``RuntimeError`` naming a process
        that exits (see ``ServiceProcess.exit_reason``), ``TimeoutError`` after ``timeout_s``.
        """
        self.launch()
        deadline_s = time.monotonic() + timeout_s
        for process in self.processes:
            wait_healthy(process, deadline_s, self._tls)
        for router in self.workers(Role.ROUTER):
            _wait_routed(router, deadline_s, self.admin_api_key, self._tls)
        return self.router_address

    def launch(self) -> None:
        """Spawn every worker and the routers at once (each router is given every worker's
        address and routes to a worker once it serves); returns without waiting."""
        if self.mode is ClusterMode.COLOCATED:
            self.num_prefill = 0
        self._tls = read_tls_dir(identity_tls_dir(self.tls_dir, Role.CONTROLLER))
        env = self._env = dict(os.environ, SPLITSERVE_LOG_LEVEL=self.log_level)
        if self.admin_api_key:
            env[env_name("admin_api_key")] = self.admin_api_key
        python = sys.executable
        worker_argv = [*to_argv(self._engine_for_workers()), *self.extra_worker_flags]
        groups = [ModelWorkers(self.num_prefill, self.num_decode, ()), *self.extra_models]
        if self.mode is ClusterMode.COLOCATED:
            groups = [dataclasses.replace(g, num_prefill=0) for g in groups]
        num_workers = sum(g.num_prefill + g.num_decode for g in groups)
        if self.worker_cpu_cores and len(self.worker_cpu_cores) != num_workers:
            raise ValueError(f"worker_cpu_cores needs one entry per worker ({num_workers})")
        cpu_cores = iter(self.worker_cpu_cores)
        workers = [
            (role, group.flags)
            for group in groups
            for role, count in ((Role.PREFILL, group.num_prefill), (Role.DECODE, group.num_decode))
            for _ in range(count)
        ]
        workers.sort(key=lambda worker: worker[0] is not Role.PREFILL)  # prefill ones first
        index = dict.fromkeys((Role.PREFILL, Role.DECODE), 0)
        for role, model_flags in workers:
            where = self.where(role, index[role])
            index[role] += 1
            reservations: list[PortReservation] = []
            port, metrics_port = self._reserve(reservations), self._reserve(reservations)
            argv = [
                *where.argv_prefix, python, "-m", f"services.{role}", "--host", where.host,
                "--port", str(port), "--metrics-port", str(metrics_port),
            ]  # fmt: skip
            argv += [*worker_argv, *model_flags, *self._tls_flags(role)]
            argv += self.extra_role_flags.get(role, ())
            if self.worker_cpu_cores:
                argv += ["--cpu-cores", next(cpu_cores)]
            address = f"{where.host}:{port}"
            self.processes.append(
                ServiceProcess(role, address, metrics_port, argv, reservations=reservations)
            )
        self.processes.extend(self._router_process(i) for i in range(self.num_routers))
        for process in self.processes:
            process.start(env)

    def _reserve(self, reservations: list[PortReservation]) -> int:
        """A port reserved for a process of this cluster (added to ``reservations``), none of
        the ports given explicitly (``port``, ``http_port``). With ``placement`` it is reserved
        on this host's loopback: a placed host has a network of its own, where only the
        cluster's processes bind, and the reservation keeps their ports distinct."""
        given = {self.port} if self.port else set()
        if self.http_port:
            given.update(self.http_port + i for i in range(self.num_routers))
        host = self.host if self.placement is None else "127.0.0.1"
        rejected: list[PortReservation] = []
        reservation = PortReservation(host)
        while reservation.port in given:
            rejected.append(reservation)
            reservation = PortReservation(host)
        for other in rejected:
            other.close()
        reservations.append(reservation)
        return reservation.port

    def supervise(self) -> list[WorkerFailure]:
        """One round of watching the processes (``splitserve up --no-ray``): note those that
        now serve, and return one ``WorkerFailure`` for each that exited since the last round.
        A worker that had served is restarted at once; one that exited while starting is
        answered for in place (``ServiceProcess.answer_in_place``) until ``stop``."""
        failures = []
        for process in self.processes:
            if process.state is ProcessState.EXITED:
                continue
            restart = process.role.is_pool and process.state is ProcessState.SERVING
            if not process.alive and restart:
                process.num_restarts += 1
                reason = process.exit_reason()
                logger.warning(
                    "%s at %s exited (%s); restarting it", process.role, process.address, reason
                )
                self.restart(process)
                failures.append(
                    WorkerFailure(
                        process.role, process.address, reason, process.num_restarts, 0.0, True
                    )
                )
            elif not process.alive:
                during = " during startup" if process.state is ProcessState.STARTING else ""
                process.state = ProcessState.EXITED
                reason = process.exit_reason()
                if process.role.is_pool:
                    process.answer_in_place(
                        f"exited{during} ({reason}); not restarted",
                        read_tls_dir(identity_tls_dir(self.tls_dir, process.role)),
                    )
                failures.append(WorkerFailure(process.role, process.address, reason, 1, None))
            elif process.state is ProcessState.STARTING and serves(process, self._tls):
                process.state = ProcessState.SERVING
        return failures

    def restart(self, process: ServiceProcess) -> None:
        """Start ``process`` (one of ours, exited) again with the same flags and address."""
        if process.popen is not None:
            process.popen.wait()
        process.close_stand_in()
        process.start(self._env)

    def serving(self) -> bool:
        """Every process answered SERVING (as last seen by ``supervise``) and every router
        reports every worker healthy (its channel to a worker that came up after it may still
        be backing off from the refusals while it started)."""
        return all(p.state is ProcessState.SERVING for p in self.processes) and all(
            _routes(router, self.admin_api_key, self._tls) for router in self.workers(Role.ROUTER)
        )

    def where(self, role: Role, index: int) -> Placement:
        """Where the ``index``-th process of ``role`` runs."""
        return Placement(self.host) if self.placement is None else self.placement(role, index)

    def _tls_flags(self, identity: Role) -> list[str]:
        return ["--tls-dir", identity_tls_dir(self.tls_dir, identity)] if self.tls_dir else []

    @property
    def http_url(self) -> str:
        """The first router's HTTP API, e.g. ``http://127.0.0.1:8000`` (https with TLS)."""
        router = self.workers(Role.ROUTER)[0]
        if router.http_port is None:
            raise ValueError("this cluster's routers serve no HTTP API")
        scheme = "https" if self.tls_dir else "http"
        return f"{scheme}://{self.where(Role.ROUTER, 0).host}:{router.http_port}"

    def _router_process(self, index: int) -> ServiceProcess:
        """The ``index``-th router, on the ports given (the first one's ``port``; ``http_port``
        + ``index``) or reserved."""
        where = self.where(Role.ROUTER, index)
        reservations: list[PortReservation] = []
        port = self.port if index == 0 and self.port else self._reserve(reservations)
        http_port = None
        if self.http_port is not None:
            http_port = self.http_port + index if self.http_port else self._reserve(reservations)
        metrics_port = self._reserve(reservations)
        http_flags = ["--no-http"] if http_port is None else ["--http-port", str(http_port)]
        return ServiceProcess(
            Role.ROUTER,
            f"{where.host}:{port}",
            metrics_port,
            [
                *where.argv_prefix, sys.executable, "-m", "services.router",
                "--model", self.engine.model,
                *_router_model_flags(self.engine),
                *self._tls_flags(Role.ROUTER),
                "--host", where.host,
                "--port", str(port),
                "--mode", self.mode,
                "--metrics-port", str(metrics_port),
                *http_flags,
                "--prefill-workers", ",".join(p.address for p in self.workers(Role.PREFILL)),
                "--decode-workers", ",".join(p.address for p in self.workers(Role.DECODE)),
                *self.extra_router_flags,
            ],
            http_port,
            reservations,
        )  # fmt: skip

    def _engine_for_workers(self) -> EngineConfig:
        return split_threads(self.engine, self.num_prefill + self.num_decode)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM everything (routers first), then SIGKILL what is left after ``timeout_s``;
        stop answering in place of exited workers."""
        for process in reversed(self.processes):
            process.signal(signal.SIGTERM)
        deadline_s = time.monotonic() + timeout_s
        for process in self.processes:
            process.close_stand_in()
            if process.popen is not None:
                try:
                    process.popen.wait(max(deadline_s - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    process.signal(signal.SIGKILL)
                    process.popen.wait()
            process.release_ports()


def _router_model_flags(engine: EngineConfig) -> list[str]:
    """The router's ``--revision`` and ``--served-model-name``: the workers' own, when set."""
    flags: list[str] = []
    if engine.revision is not None:
        flags += ["--revision", engine.revision]
    if engine.served_model_name is not None:
        flags += ["--served-model-name", engine.served_model_name]
    return flags


def split_threads(engine: EngineConfig, num_engines: int) -> EngineConfig:
    """Split the cores between ``num_engines`` engine processes unless the thread count was
    given."""
    if engine.num_threads is not None:
        return engine
    threads = max((os.cpu_count() or 1) // max(num_engines, 1), 1)
    return dataclasses.replace(engine, num_threads=threads)


def _wait_routed(
    router: ServiceProcess, deadline_s: float, api_key: str, tls: TlsMaterial | None
) -> None:
    """Block until ``router`` reports every worker it was given as healthy."""
    wait_while_alive(
        lambda: _routes(router, api_key, tls),
        deadline_s,
        lambda: f"router at {router.address} sees no healthy workers",
        router,
    )


def _routes(router: ServiceProcess, api_key: str, tls: TlsMaterial | None) -> bool:
    """One ``Router.Status`` (presenting ``api_key``): does ``router`` report every worker it
    was given as healthy?"""
    with member_channel_blocking(router.address, Role.ROUTER, tls) as channel:
        try:
            status = router_pb2_grpc.RouterStub(channel).Status(
                router_pb2.StatusRequest(),
                timeout=_STATUS_TIMEOUT_S,
                metadata=api_key_metadata(api_key),
            )
        except grpc.RpcError:
            return False
    return all(w.healthy for w in status.workers)
