"""The router's view of one pool of workers: channels, health, load, and the least-loaded pick.

Health and load come from polling each worker's ``GetLoad`` every ``health_check_interval_s``;
a failed call marks the worker unhealthy until a later poll succeeds. Between polls the router
counts its own in-flight requests per worker, which is what the pick mostly looks at (the
prefix-aware policy replaces this in its own module).
"""

from __future__ import annotations

import asyncio
import logging
import random
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


class WorkerPool:
    """All workers of one role."""

    def __init__(
        self, role: worker_pb2.WorkerRole.ValueType, addresses: tuple[str, ...], rng: random.Random
    ) -> None:
        self.role = role
        self._rng = rng
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

    def pick(self, exclude: set[str] | None = None) -> WorkerHandle | None:
        """The healthy worker with the fewest router requests in flight, then the lowest KV
        usage; ties broken at random. None when no worker is healthy."""
        candidates = [w for w in self.healthy_workers() if w.address not in (exclude or set())]
        if not candidates:
            return None
        best = min((w.num_inflight, w.load.kv_usage) for w in candidates)
        tied = [w for w in candidates if (w.num_inflight, w.load.kv_usage) == best]
        return self._rng.choice(tied)

    async def poll_all(self) -> None:
        await asyncio.gather(*(w.poll() for w in self.workers))

    async def close(self) -> None:
        await asyncio.gather(*(w.channel.close() for w in self.workers))
