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

import contextlib
import dataclasses
import enum
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.config import EngineConfig
from engine.flags import env_name, to_argv
from services.common.roles import ClusterMode, Role
from services.common.router_channel import api_key_metadata
from services.common.tls import (
    Identity,
    TlsMaterial,
    identity_tls_dir,
    member_channel_blocking,
    read_tls_dir,
)
from services.startup import WorkerFailure, last_line
from splitserve.v1 import router_pb2, router_pb2_grpc

logger = logging.getLogger(__name__)

_HEALTH_POLL_S = 0.2
_HEALTH_CHECK_TIMEOUT_S = 1.0
_STDERR_TAIL_LINES = 20
# How long the last lines of an exited process may take to come through its pipe.
_STDERR_DRAIN_S = 1.0


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, and free for anyone to take: for an address nothing should
    answer on. A port that a child process is to bind is a ``PortReservation``'s."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
    return port


class PortReservation:
    """A free port on ``host``, held until ``close`` for a child process to bind.

    The port is bound (``SO_REUSEADDR``, never listening): Linux lets another socket with
    ``SO_REUSEADDR`` bind and listen on it meanwhile (every server we start sets it: gRPC, the
    HTTP servers, Prometheus', redis-server), but hands it to no one else (neither ``bind`` to
    port 0 nor a connection's ephemeral port), so there is no window between picking the port
    and the child's bind in which another process takes it. Hold it for as long as the child
    may bind the port again (a restart). Not inherited by children; a context manager.
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._socket = socket.socket()
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, 0))
        self.port: int = self._socket.getsockname()[1]

    def close(self) -> None:
        """Stop holding the port (idempotent)."""
        self._socket.close()

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class ProcessState(enum.Enum):
    STARTING = "starting"  # spawned, not answering SERVING on gRPC health yet
    SERVING = "serving"
    EXITED = "exited"  # seen gone by LocalCluster.supervise (reported once)


@dataclass(slots=True)
class ServiceProcess:
    """One child process and the gRPC address it serves. Its stderr passes through to ours
    (file descriptor 2); the last lines are kept to tell why it exited (``exit_reason``).
    ``reservations`` hold the ports it binds until ``release_ports``."""

    role: Role
    address: str
    metrics_port: int
    argv: list[str]
    http_port: int | None = None  # a router's HTTP API (None: none)
    reservations: list[PortReservation] = field(default_factory=list, repr=False)
    popen: subprocess.Popen[bytes] | None = None
    state: ProcessState = ProcessState.STARTING
    num_restarts: int = 0
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=_STDERR_TAIL_LINES))
    _stderr_pump: threading.Thread | None = field(default=None, init=False, repr=False)
    _stand_in: grpc.Server | None = field(default=None, init=False, repr=False)

    def start(self, env: dict[str, str]) -> None:
        self.stderr_tail.clear()
        self.popen = subprocess.Popen(
            self.argv, env=env, start_new_session=True, stderr=subprocess.PIPE
        )
        self.state = ProcessState.STARTING
        assert self.popen.stderr is not None
        self._stderr_pump = threading.Thread(
            target=_pass_through,
            args=(self.popen.stderr, self.stderr_tail),
            name=f"{self.role}-{self.address}-stderr",
            daemon=True,
        )
        self._stderr_pump.start()

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            assert self.popen is not None
            os.killpg(self.popen.pid, sig)

    def exit_reason(self) -> str:
        """How the (exited) process ended: its exit status and the last line it wrote."""
        assert self.popen is not None and self.popen.returncode is not None
        if self._stderr_pump is not None:
            self._stderr_pump.join(_STDERR_DRAIN_S)
        code = self.popen.returncode
        status = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        line = last_line("".join(self.stderr_tail))
        return f"{status}: {line}" if line else status

    def answer_in_place(self, details: str, tls: TlsMaterial | None = None) -> None:
        """Serve on the (exited) process's address (TLS with its own ``tls``): every call gets
        UNAVAILABLE with ``details``. Logs and does nothing if the address cannot be bound."""
        server = grpc.server(
            ThreadPoolExecutor(max_workers=1),
            handlers=(_Unavailable(details),),
            # Never share the port with a process that would take it back.
            options=(("grpc.so_reuseport", 0),),
        )
        try:
            if tls is None:
                bound = server.add_insecure_port(self.address)
            else:
                credentials = tls.server_credentials(require_client_auth=False)
                bound = server.add_secure_port(self.address, credentials)
        except RuntimeError:
            bound = 0
        if not bound:
            logger.warning("cannot answer in place of %s at %s", self.role, self.address)
            return
        server.start()
        self._stand_in = server

    def close_stand_in(self) -> None:
        if self._stand_in is not None:
            self._stand_in.stop(None)
            self._stand_in = None

    def release_ports(self) -> None:
        """Stop holding the process's ports (it will not bind them again)."""
        for reservation in self.reservations:
            reservation.close()


class _Unavailable(grpc.GenericRpcHandler):
    """Answers every method with UNAVAILABLE and fixed details."""

    def __init__(self, details: str) -> None:
        self._handler = grpc.unary_unary_rpc_method_handler(self._abort)
        self._details = details

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        return self._handler

    def _abort(self, request: bytes, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.UNAVAILABLE, self._details)


def _pass_through(pipe: IO[bytes], tail: deque[str]) -> None:
    """Copy a child's stderr to ours line by line until it closes, keeping the last lines."""
    with pipe:
        for line in pipe:
            tail.append(line.decode(errors="replace"))
            # Our stderr gone (a closed pipe): keep draining, or the child would block on it.
            with contextlib.suppress(OSError):
                view = memoryview(line)
                while view:
                    view = view[os.write(2, view) :]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one process of a ``LocalCluster`` runs: the address it binds and advertises
    (gRPC, metrics, KV) and the command its own is run under (``argv_prefix``, e.g.
    ``ip netns exec NS`` for a test host of ``loadtest.netns_hosts``)."""

    host: str
    argv_prefix: tuple[str, ...] = ()


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
        self._tls = read_tls_dir(identity_tls_dir(self.tls_dir, Identity.CONTROLLER))
        env = self._env = dict(os.environ, SPLITSERVE_LOG_LEVEL=self.log_level)
        if self.admin_api_key:
            env[env_name("admin_api_key")] = self.admin_api_key
        python = sys.executable
        worker_argv = [*to_argv(self._engine_for_workers()), *self.extra_worker_flags]
        num_workers = self.num_prefill + self.num_decode
        if self.worker_cpu_cores and len(self.worker_cpu_cores) != num_workers:
            raise ValueError(f"worker_cpu_cores needs one entry per worker ({num_workers})")
        cpu_cores = iter(self.worker_cpu_cores)
        for role, count in ((Role.PREFILL, self.num_prefill), (Role.DECODE, self.num_decode)):
            for i in range(count):
                where = self.where(role, i)
                reservations: list[PortReservation] = []
                port, metrics_port = self._reserve(reservations), self._reserve(reservations)
                argv = [
                    *where.argv_prefix, python, "-m", f"services.{role}", "--host", where.host,
                    "--port", str(port), "--metrics-port", str(metrics_port),
                ]  # fmt: skip
                argv += [*worker_argv, *self._tls_flags(Identity(role))]
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
            elif process.state is ProcessState.STARTING and _serves(process, self._tls):
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

    def _tls_flags(self, identity: Identity) -> list[str]:
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
                *self._tls_flags(Identity.ROUTER),
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


def wait_healthy(
    process: ServiceProcess, deadline_s: float, tls: TlsMaterial | None = None
) -> None:
    """Block until ``process`` answers SERVING on gRPC health (calling with ``tls``, if it
    serves TLS); raise if it dies or times out."""
    _wait(
        lambda: _serves(process, tls),
        deadline_s,
        lambda: f"{process.role} at {process.address} is not healthy in time",
        process,
    )
    process.state = ProcessState.SERVING


def _wait_routed(
    router: ServiceProcess, deadline_s: float, api_key: str, tls: TlsMaterial | None
) -> None:
    """Block until ``router`` reports every worker it was given as healthy."""
    _wait(
        lambda: _routes(router, api_key, tls),
        deadline_s,
        lambda: f"router at {router.address} sees no healthy workers",
        router,
    )


def _routes(router: ServiceProcess, api_key: str, tls: TlsMaterial | None) -> bool:
    """One ``Router.Status`` (presenting ``api_key``): does ``router`` report every worker it
    was given as healthy?"""
    with member_channel_blocking(router.address, Identity.ROUTER, tls) as channel:
        try:
            status = router_pb2_grpc.RouterStub(channel).Status(
                router_pb2.StatusRequest(),
                timeout=_HEALTH_CHECK_TIMEOUT_S * 5,
                metadata=api_key_metadata(api_key),
            )
        except grpc.RpcError:
            return False
    return all(w.healthy for w in status.workers)


def _wait(
    done: Callable[[], bool],
    deadline_s: float,
    timeout_message: Callable[[], str],
    process: ServiceProcess,
) -> None:
    while not done():
        if not process.alive:
            raise RuntimeError(
                f"{process.role} at {process.address} exited ({process.exit_reason()}): "
                f"{' '.join(process.argv)}"
            )
        if time.monotonic() > deadline_s:
            raise TimeoutError(timeout_message())
        time.sleep(_HEALTH_POLL_S)


def _serves(process: ServiceProcess, tls: TlsMaterial | None) -> bool:
    """One gRPC health check: does ``process`` answer SERVING?"""
    identity = Identity(process.role)
    with member_channel_blocking(process.address, identity, tls) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=_HEALTH_CHECK_TIMEOUT_S
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
