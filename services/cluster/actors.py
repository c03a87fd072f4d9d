"""Ray actor classes: each runs one plain service in its own process, on the actor's loop.

A thin wrapper: the service is exactly what ``python -m services.<role>`` runs (the same
``start_*`` function), so an actor's death is the service's death and nothing else differs.
The controller places them (custom resources ``{"prefill": 1}`` / ``{"decode": 1}``, GPUs)
and drives them through these methods; clients and routers talk to the services over gRPC.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
from dataclasses import dataclass
from typing import Any, ClassVar

import ray

from services.common.grpc_server import freeze_startup_heap
from services.common.logs import configure_logging
from services.common.roles import Role
from services.router.app import RunningRouter, start_router
from services.router.config import RouterConfig
from services.router.latency import LatencySamples
from services.router.scaler import PoolSize
from services.service_process import PortReservation
from services.worker.config import WorkerConfig
from services.worker.runtime import RunningWorker

_ANY_ADDRESS = ("0.0.0.0", "::", "")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a started service is reached (``address`` is what routers and clients dial)."""

    address: str
    metrics_port: int
    pid: int
    hostname: str  # the pod's name on Kubernetes


def _metrics_port(port: int, host: str) -> tuple[int, PortReservation | None]:
    """``port`` if set, else a port reserved on ``host`` with its reservation, which the actor
    holds for its life (its service binds the port at start)."""
    if port:
        return port, None
    reservation = PortReservation(host)
    return reservation.port, reservation


def _advertised_host(host: str) -> str:
    """The address peers dial for a server bound to ``host`` (the node's IP for a wildcard)."""
    return ray.util.get_node_ip_address() if host in _ANY_ADDRESS else host


class _ServiceActor:
    """What every actor does alike: say where its started service is reached, answer pings."""

    _host: str  # the address its service binds
    _metrics_port: int

    def _started(self, port: int) -> Endpoint:
        """Its service serves on ``port`` now: what it allocated to start stays for good (out
        of the cyclic GC's passes), and peers reach it at the returned endpoint."""
        freeze_startup_heap()
        address = f"{_advertised_host(self._host)}:{port}"
        return Endpoint(address, self._metrics_port, os.getpid(), socket.gethostname())

    async def ping(self) -> int:
        return os.getpid()


class _WorkerActor(_ServiceActor):
    """A prefill or decode worker; ``start`` loads the model and returns once it serves."""

    role: ClassVar[Role]

    def __init__(self, config: WorkerConfig, log_level: str) -> None:
        configure_logging(log_level)
        # Several actors share a node: each gets its own ports (gRPC: port 0, bound at start;
        # metrics: reserved); peers dial the node's address.
        metrics_port, self._metrics_reservation = _metrics_port(config.metrics_port, config.host)
        kv_advertise_host = config.kv_advertise_host or _advertised_host(config.kv_bind_host)
        self._config = dataclasses.replace(
            config, port=0, metrics_port=metrics_port, kv_advertise_host=kv_advertise_host
        )
        self._host, self._metrics_port = config.host, metrics_port
        self._worker: RunningWorker | None = None
        self._watcher: asyncio.Task[None] | None = None

    async def start(self) -> Endpoint:
        self._worker = await self._start_worker(self._config)
        self._watcher = asyncio.create_task(self._exit_when_engine_dies(self._worker))
        return self._started(self._worker.port)

    async def _start_worker(self, config: WorkerConfig) -> RunningWorker:
        raise NotImplementedError

    @staticmethod
    async def _exit_when_engine_dies(worker: RunningWorker) -> None:
        """A dead engine ends the actor's process, as it ends ``python -m services.<role>``:
        the controller's next ping fails and it starts a replacement."""
        await worker.engine_died.wait()
        await worker.stop(grace_s=1.0)
        os._exit(1)

    async def stop(self, grace_s: float) -> None:
        """Stop serving (open calls get ``grace_s``) and free the engine; the actor stays."""
        if self._worker is not None:
            await self._worker.stop(grace_s)
            self._worker = None


class PrefillActor(_WorkerActor):
    role = Role.PREFILL

    async def _start_worker(self, config: WorkerConfig) -> RunningWorker:
        from services.prefill.server import start_prefill_worker

        return await start_prefill_worker(config)


class DecodeActor(_WorkerActor):
    role = Role.DECODE

    async def _start_worker(self, config: WorkerConfig) -> RunningWorker:
        from services.decode.server import start_decode_worker

        return await start_decode_worker(config)


class ControllerScaler:
    """The router's ``PoolScaler``: forwards ``Scale`` and pool sizes to the controller."""

    def __init__(self, controller: Any) -> None:
        self._controller = controller

    async def scale(self, model: str, role: Role, num_workers: int) -> list[PoolSize]:
        try:
            return await self._controller.scale.remote(model, role, num_workers)
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, ValueError):  # the message without Ray's traceback
                raise ValueError(str(exc.cause)) from None
            raise

    async def pools(self) -> list[PoolSize]:
        return await self._controller.pools.remote()


class RouterActor(_ServiceActor):
    """A router; pool membership comes from the controller through ``set_pool``."""

    role: ClassVar[Role] = Role.ROUTER

    def __init__(self, config: RouterConfig, controller: Any, log_level: str) -> None:
        configure_logging(log_level)
        metrics_port, self._metrics_reservation = _metrics_port(config.metrics_port, config.host)
        self._config = dataclasses.replace(config, metrics_port=metrics_port)
        self._host, self._metrics_port = config.host, metrics_port
        self._controller = controller
        self._router: RunningRouter | None = None

    async def start(self) -> Endpoint:
        self._router = await start_router(self._config, ControllerScaler(self._controller))
        return self._started(self._router.port)

    async def set_pool(self, role: Role, members: dict[str, bool]) -> None:
        """See ``RouterServicer.set_pool``."""
        assert self._router is not None, "set_pool before start"
        await self._router.servicer.set_pool(role, members)

    async def take_latency_samples(self) -> dict[str, LatencySamples]:
        """Each served model's TTFT and ITL samples since the last call (for the planner)."""
        if self._router is None:
            return {}
        return self._router.servicer.models.take_latency_samples()

    async def num_inflight_by_worker(self) -> dict[str, int]:
        if self._router is None:
            return {}
        return self._router.servicer.num_inflight_by_worker()

    async def routable_addresses(self) -> set[str]:
        """See ``RouterServicer.routable_addresses`` (empty before ``start``)."""
        if self._router is None:
            return set()
        return self._router.servicer.routable_addresses()

    async def stop(self, grace_s: float) -> None:
        if self._router is not None:
            await self._router.stop(grace_s)
            self._router = None


ACTOR_CLASSES: dict[Role, type] = {
    Role.PREFILL: PrefillActor,
    Role.DECODE: DecodeActor,
    Role.ROUTER: RouterActor,
}
