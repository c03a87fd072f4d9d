"""The router's view of one pool of workers: channels, health and load.

Health and load come from polling each worker's ``GetLoad`` every ``health_check_interval_s``;
a failed call marks the worker unhealthy until a later poll succeeds. A worker that fails
``fence_after_failed_polls`` polls in a row is fenced: the router cancels its own calls open on
it (``WorkerHandle.fence``), so that streams on a hung worker continue elsewhere instead of
waiting for it. Between polls the router
counts its own in-flight requests per worker (``num_inflight``); the choosers
(``prefill_choice``, ``decode_choice``) weigh both.

Membership is static (the router's flags) or set at run time by an orchestrator
(``WorkerPool.set_members``): an added worker becomes routable once a poll succeeds; a draining
one keeps its in-flight requests but is chosen for nothing new.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.common.background import BackgroundTasks
from services.common.logs import rate_limited
from services.common.roles import Role
from services.common.tls import TlsMaterial, member_channel
from splitserve.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

_POLL_TIMEOUT_S = 2.0
_RETIRED_POLL_S = 0.5
_RETIRED_CLOSE_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class ServedTarget:
    """What a request needs of a worker: its served model (``WorkerInfo.served_model_name``)
    and, unless empty, a LoRA adapter of it."""

    model: str
    lora_name: str = ""


@dataclass(slots=True, eq=False)
class WorkerHandle:
    """One worker as the router sees it. ``num_inflight`` counts the router's own requests."""

    address: str
    role: Role
    channel: grpc.aio.Channel
    stub: Any  # its role's generated stub: PrefillWorkerStub or DecodeWorkerStub
    healthy: bool = False
    info: worker_pb2.WorkerInfo | None = None
    load: worker_pb2.WorkerLoad = field(default_factory=worker_pb2.WorkerLoad)
    last_error: str = ""
    num_inflight: int = 0
    # This router's prefill calls open on it, by priority (lower first).
    prefill_priorities: Counter[int] = field(default_factory=Counter)
    draining: bool = False
    fence_after_failed_polls: int = 2
    num_failed_polls: int = 0
    _open_calls: set[grpc.aio.Call] = field(default_factory=set, repr=False)
    _fenced_calls: set[grpc.aio.Call] = field(default_factory=set, repr=False)

    @property
    def routable(self) -> bool:
        """May be chosen for a new request (not while it drains or shuts down)."""
        return self.healthy and not self.draining and not self.load.shutting_down

    def serves(self, target: ServedTarget | None) -> bool:
        """Whether it serves ``target``'s model and adapter, as its info and latest load report
        say (None: any request; a worker that never answered serves none)."""
        if target is None:
            return True
        if not self.serves_model(target.model):
            return False
        return not target.lora_name or self.serves_adapter(target.lora_name)

    def serves_model(self, model: str) -> bool:
        """Whether its info names ``model`` as the one it serves."""
        return self.info is not None and self.info.served_model_name == model

    def serves_adapter(self, lora_name: str) -> bool:
        """Whether its latest load report lists LoRA adapter ``lora_name``."""
        return any(a.name == lora_name for a in self.load.lora_adapters)

    @property
    def schedules_by_priority(self) -> bool:
        """Its engine admits and preempts by priority (``--scheduling-policy priority``)."""
        return self.info is not None and self.info.scheduling_policy == "priority"

    def prefills_only_worse_than(self, priority: int) -> bool:
        """Whether this router has prefills open on it and every one has a worse (higher)
        priority than ``priority``: a prompt of ``priority`` would wait behind them."""
        return bool(self.prefill_priorities) and min(self.prefill_priorities) > priority

    def mark_failed(self, error: str) -> None:
        if self.healthy:
            limited = rate_limited(self.address)
            self._log(logging.WARNING, "marked unhealthy: %s", error, extra=limited)
        self.healthy = False
        self.last_error = error

    def open_call(self, call: grpc.aio.Call) -> None:
        """Track ``call`` until ``close_call``, so that ``fence`` can cancel it."""
        self._open_calls.add(call)

    def close_call(self, call: grpc.aio.Call) -> bool:
        """Stop tracking ``call``; True if ``fence`` cancelled it (the awaiting code then sees
        ``asyncio.CancelledError`` without its own task being cancelled)."""
        self._open_calls.discard(call)
        if call in self._fenced_calls:
            self._fenced_calls.discard(call)
            return True
        return False

    def fenced(self, call: grpc.aio.Call) -> bool:
        """Whether the ``CancelledError`` just raised by ``call`` is this worker's fencing (the
        request moves on) rather than the cancellation of the request's own task; stops
        tracking ``call``."""
        task = asyncio.current_task()
        return self.close_call(call) and not (task is not None and task.cancelling() > 0)

    def fence(self, reason: str) -> None:
        """Cancel every call this router has open on the worker (it is unhealthy already)."""
        if self._open_calls:
            num_calls = len(self._open_calls)
            self._log(logging.WARNING, "fenced: cancelling %d open calls (%s)", num_calls, reason)
        for call in self._open_calls:
            self._fenced_calls.add(call)
            call.cancel()

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
            self.num_failed_polls += 1
            self.mark_failed(f"{exc.code().name}: {exc.details()}")
            if self.num_failed_polls >= self.fence_after_failed_polls:
                self.fence(f"{self.num_failed_polls} health polls in a row failed")
            return
        self.num_failed_polls = 0
        if not self.healthy:
            self._log(logging.INFO, "is healthy")
        self.healthy = True
        self.last_error = ""

    def _log(self, level: int, what: str, *args: object, extra: Any = None) -> None:
        """Log ``what`` (a %-format over ``args``) as "<role> worker <address> <what>"."""
        logger.log(level, "%s worker %s " + what, self.role, self.address, *args, extra=extra)


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
    """All workers of one role, in the order they joined."""

    def __init__(
        self,
        role: Role,
        addresses: tuple[str, ...],
        fence_after_failed_polls: int = 2,
        tls: TlsMaterial | None = None,
    ) -> None:
        self.role = role
        self.fence_after_failed_polls = fence_after_failed_polls
        self._tls = tls
        self._stub_cls = (
            worker_pb2_grpc.PrefillWorkerStub
            if role is Role.PREFILL
            else worker_pb2_grpc.DecodeWorkerStub
        )
        self.workers: list[WorkerHandle] = [self._connect(address) for address in addresses]
        # Removed from the pool, channel still open for the calls in flight on it.
        self._retired: set[WorkerHandle] = set()
        self._background = BackgroundTasks()

    def _connect(self, address: str) -> WorkerHandle:
        channel = member_channel(address, self.role, self._tls)
        return WorkerHandle(
            address,
            self.role,
            channel,
            self._stub_cls(channel),
            fence_after_failed_polls=self.fence_after_failed_polls,
        )

    def routable_workers(self, target: ServedTarget | None = None) -> list[WorkerHandle]:
        """The workers that may take a new request (for ``target``; None: any)."""
        return [w for w in self.workers if w.routable and w.serves(target)]

    def model_workers(self, model: str) -> list[WorkerHandle]:
        """The workers that reported serving ``model``, routable or not."""
        return [w for w in self.workers if w.serves_model(model)]

    def get(self, address: str) -> WorkerHandle | None:
        return next((w for w in self.workers if w.address == address), None)

    async def set_members(self, members: dict[str, bool]) -> None:
        """Make the pool exactly ``members`` (address -> draining). New workers are polled
        before this returns (routable if they answered); a removed one's channel is closed once
        the calls still open on it have ended."""
        removed = [w for w in self.workers if w.address not in members]
        added: list[WorkerHandle] = []
        for address, draining in members.items():
            worker = self.get(address)
            if worker is None:
                worker = self._connect(address)
                added.append(worker)
                self.workers.append(worker)
            if worker.draining != draining:
                logger.info(
                    "%s worker %s %s",
                    worker.role,
                    address,
                    "draining" if draining else "routable again",
                )
            worker.draining = draining
        self.workers = [w for w in self.workers if w.address in members]
        for worker in removed:
            logger.info("%s worker %s removed from the pool", worker.role, worker.address)
            self._retired.add(worker)
            self._background.spawn(self._close_when_idle(worker))
        await asyncio.gather(*(w.poll() for w in added))

    async def _close_when_idle(self, worker: WorkerHandle) -> None:
        # Closing a channel cancels its calls as if our own client had gone away: wait for the
        # ones still open to end (a dead worker's fail fast; a drained worker has none).
        deadline_s = time.monotonic() + _RETIRED_CLOSE_TIMEOUT_S
        while worker.num_inflight and time.monotonic() < deadline_s:
            await asyncio.sleep(_RETIRED_POLL_S)
        self._retired.discard(worker)
        await worker.channel.close()

    async def poll_all(self) -> None:
        await asyncio.gather(*(w.poll() for w in self.workers))

    async def close(self) -> None:
        await asyncio.gather(*(w.channel.close() for w in (*self.workers, *self._retired)))
