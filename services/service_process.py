"""One service process of a local cluster: started with its stderr passed through, watched,
answered for in place once it cannot serve, and waited on until gRPC health says SERVING.

``PortReservation`` holds a port from the moment it is picked until its process binds it (see
``services.launcher``); ``free_port`` is for an address nothing should answer on.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.roles import Role
from services.common.tls import TlsMaterial, member_channel_blocking
from services.startup import last_line

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


def wait_healthy(
    process: ServiceProcess, deadline_s: float, tls: TlsMaterial | None = None
) -> None:
    """Block until ``process`` answers SERVING on gRPC health (calling with ``tls``, if it
    serves TLS); raise if it dies or times out."""
    wait_while_alive(
        lambda: serves(process, tls),
        deadline_s,
        lambda: f"{process.role} at {process.address} is not healthy in time",
        process,
    )
    process.state = ProcessState.SERVING


def wait_while_alive(
    done: Callable[[], bool],
    deadline_s: float,
    timeout_message: Callable[[], str],
    process: ServiceProcess,
) -> None:
    """Block until ``done()``; raise ``RuntimeError`` (with its exit reason) if ``process``
    exits first, ``TimeoutError`` (``timeout_message()``) past ``deadline_s``."""
    while not done():
        if not process.alive:
            raise RuntimeError(
                f"{process.role} at {process.address} exited ({process.exit_reason()}): "
                f"{' '.join(process.argv)}"
            )
        if time.monotonic() > deadline_s:
            raise TimeoutError(timeout_message())
        time.sleep(_HEALTH_POLL_S)


def serves(process: ServiceProcess, tls: TlsMaterial | None) -> bool:
    """One gRPC health check: does ``process`` answer SERVING?"""
    identity = process.role
    with member_channel_blocking(process.address, identity, tls) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=_HEALTH_CHECK_TIMEOUT_S
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
