"""What the controller reads from the running cluster.

Worker loads come over gRPC (``GetLoad``, one cached channel per worker); the routers' calls
in flight on each worker and their latency samples come through Ray calls to the router actors.
A worker or router that does not answer reads as idle: there is nothing to wait for on one that
cannot serve, and the controller's reaper replaces it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from services.cluster.members import Member, PoolKey, busy_units
from services.cluster.planner import PoolSignals, percentile
from services.common.background import BackgroundTasks
from services.common.roles import Role
from services.common.tls import TlsMaterial, member_channel
from services.router.latency import LatencySamples
from splitserve.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 5.0


class ClusterProbes:
    """Reads loads, in-flight counts and latency samples (calling workers as the controller,
    over mutual TLS with ``tls``); ``forget`` a removed worker."""

    def __init__(self, tls: TlsMaterial | None = None) -> None:
        self._tls = tls
        self._stubs: dict[str, tuple[grpc.aio.Channel, Any]] = {}
        self._background = BackgroundTasks()

    async def load(self, worker: Member) -> worker_pb2.WorkerLoad:
        """The worker's ``GetLoad`` (empty if it does not answer)."""
        if worker.address not in self._stubs:
            channel = member_channel(worker.address, worker.role, self._tls)
            stub_class = (
                worker_pb2_grpc.PrefillWorkerStub
                if worker.role is Role.PREFILL
                else worker_pb2_grpc.DecodeWorkerStub
            )
            self._stubs[worker.address] = (channel, stub_class(channel))
        stub = self._stubs[worker.address][1]
        try:
            return await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            logger.warning("%s %s: GetLoad failed (%s)", worker.role, worker.name, exc.code().name)
            return worker_pb2.WorkerLoad()

    async def busy(self, workers: Sequence[Member], routers: Sequence[Member]) -> dict[str, int]:
        """``busy_units`` of each worker (by name): its load plus every router's calls on it."""
        if not workers:
            return {}
        inflight_maps, loads = await asyncio.gather(
            asyncio.gather(*(self._router_inflight(r) for r in routers)),
            asyncio.gather(*(self.load(w) for w in workers)),
        )
        return {
            w.name: busy_units(load, sum(i.get(w.address, 0) for i in inflight_maps))
            for w, load in zip(workers, loads, strict=True)
        }

    async def signals(
        self, routers: Sequence[Member], pools: Mapping[PoolKey, tuple[int, Sequence[Member]]]
    ) -> dict[PoolKey, PoolSignals]:
        """This window's ``PoolSignals`` per pool (``pools``: (served model, role) -> (desired
        size, ready workers)): a prefill pool is judged by its model's TTFT, a decode pool by
        its model's ITL. Drains the routers' latency windows (every model's)."""
        by_router: list[dict[str, LatencySamples]] = await asyncio.gather(
            *(self._latency_samples(r) for r in routers)
        )
        signals = {}
        for (model, role), (desired, ready) in pools.items():
            samples = [s[model] for s in by_router if model in s]
            latencies_s = [
                t for s in samples for t in (s.ttft_s if role is Role.PREFILL else s.itl_s)
            ]
            loads = await asyncio.gather(*(self.load(w) for w in ready))
            num = max(len(ready), 1)
            latency_s = percentile(latencies_s, 0.9)
            queued = sum(
                load.num_waiting + (load.num_waiting_for_kv if role is Role.DECODE else 0)
                for load in loads
            )
            signals[(model, role)] = PoolSignals(
                num_workers=desired,
                latency_ms=latency_s * 1000 if latency_s is not None else None,
                queue_per_worker=queued / num,
                kv_usage=sum(load.kv_usage for load in loads) / num,
            )
        return signals

    @staticmethod
    async def route_all(routers: Sequence[Member], workers: set[str]) -> bool:
        """Whether every router would choose among all ``workers`` (addresses): a router's
        first health poll can miss a worker that answers slowly; its next one catches up."""
        try:
            views = await asyncio.gather(
                *(
                    asyncio.wait_for(r.actor.routable_addresses.remote(), CALL_TIMEOUT_S)
                    for r in routers
                )
            )
        except Exception as exc:  # a router that does not answer is not routing yet
            logger.debug("router view unavailable (%r)", exc)
            return False
        return all(workers <= view for view in views)

    def forget(self, address: str) -> None:
        """Close the channel to a removed worker."""
        entry = self._stubs.pop(address, None)
        if entry is not None:
            self._background.spawn(entry[0].close())

    @staticmethod
    async def _router_inflight(router: Member) -> dict[str, int]:
        try:
            return await asyncio.wait_for(
                router.actor.num_inflight_by_worker.remote(), CALL_TIMEOUT_S
            )
        except Exception as exc:
            logger.warning("router %s: no in-flight counts (%r)", router.name, exc)
            return {}

    @staticmethod
    async def _latency_samples(router: Member) -> dict[str, LatencySamples]:
        try:
            return await asyncio.wait_for(
                router.actor.take_latency_samples.remote(), CALL_TIMEOUT_S
            )
        except Exception as exc:
            logger.warning("router %s: no latency samples (%r)", router.name, exc)
            return {}
