"""The router's view of one pool of workers: channels, health and load.

Health and load come from polling each worker's ``GetLoad`` every ``health_check_interval_s``;
a failed call marks the worker unhealthy until a later poll succeeds. Between polls the router
counts its own in-flight requests per worker (``num_inflight``); the choosers
(``prefill_choice``, ``decode_choice``) weigh both.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc

from services.common.convert import ROLE_NAMES
from services.common.grpc_server import CHANNEL_OPTIONS
from splitserve.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

_POLL_TIMEOUT_S = 2.0


@dataclass(slots=True, eq=False)
class WorkerHandle:
    """One worker as the router sees it. ``num_inflight`` counts the router's own requests."""

    address: str
    role: worker_pb2.WorkerRole.ValueType
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.PrefillWorkerStub | worker_pb2_grpc.DecodeWorkerStub
    healthy: bool = False
    info: worker_pb2.WorkerInfo | None = None
    load: worker_pb2.WorkerLoad = field(default_factory=worker_pb2.WorkerLoad)
    last_error: str = ""
    num_inflight: int = 0

    def mark_failed(self, error: str) -> None:
        if self.healthy:
            logger.warning("%s worker %s marked unhealthy: %s", self.role_name, self.address, error)
        self.healthy = False
        self.last_error = error

    @property
    def role_name(self) -> str:
        return ROLE_NAMES[self.role]

    async def poll(self) -> None:
        """Refresh info (once) and load; updates ``healthy``. Never raises."""
        try:
            if self.info is None:
                self.info = await self.stub.GetInfo(
                    worker_pb2.GetInfoRequest(), timeout=_POLL_TIMEOUT_S
                )
            self.load = await self.stub.GetLoad(
                worker_pb2.GetLoadRequest(), timeout=_POLL_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            self.mark_failed(f"{exc.code().name}: {exc.details()}")
            return
        if not self.healthy:
            logger.info("%s worker %s is healthy", self.role_name, self.address)
        self.healthy = True
        self.last_error = ""


class InflightSlot:
    """One request counted in ``num_inflight`` of the worker it is assigned to, moving with it."""

    def __init__(self) -> None:
        self.worker: WorkerHandle | None = None

    def move_to(self, worker: WorkerHandle | None) -> None:
        """Count the request on ``worker`` (None: on no worker) instead of its current one."""
        if self.worker is not None:
            self.worker.num_inflight -= 1
        self.worker = worker
        if worker is not None:
            worker.num_inflight += 1


class WorkerPool:
    """All workers of one role."""

    def __init__(self, role: worker_pb2.WorkerRole.ValueType, addresses: tuple[str, ...]) -> None:
        self.role = role
        stub_cls = (
            worker_pb2_grpc.PrefillWorkerStub
            if role == worker_pb2.WORKER_ROLE_PREFILL
            else worker_pb2_grpc.DecodeWorkerStub
        )
        self.workers: list[WorkerHandle] = []
        for address in addresses:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self.workers.append(WorkerHandle(address, role, channel, stub_cls(channel)))

    def healthy_workers(self) -> list[WorkerHandle]:
        return [w for w in self.workers if w.healthy]

    async def poll_all(self) -> None:
        await asyncio.gather(*(w.poll() for w in self.workers))

    async def close(self) -> None:
        await asyncio.gather(*(w.channel.close() for w in self.workers))
