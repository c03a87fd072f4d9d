"""A worker's side of the prefix index: publish its prefix-cache events, heartbeat, and publish
everything again whenever the index lost track of it.

The engine thread hands each step's events to ``submit`` (on the asyncio loop, in order); one
task applies them to the index and heartbeats every ``ttl_s / 3``. A heartbeat answered "not
live before" (the first one, a lapse, a Redis restarted empty) triggers a full republication:
the worker's index entries are cleared and replaced by a snapshot of every block the engine
holds, in its cache or its tier alone. While the index is unreachable, events are dropped and
the next successful heartbeat republishes: the index is a hint, so it may lag, but it never
keeps a worker's stale blocks after the worker came back. Every ``reconcile_interval_s`` the
worker's entries are trimmed to what its engine holds (blocks a router predicted for a prefill
that never ran); on ``stop`` (a drain, SIGTERM) they are removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from engine.block_hash import BlockHash
from engine.block_pool import KVCacheEvent, KVMedium
from services.common.logs import rate_limited
from services.common.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)

_FORGET_TIMEOUT_S = 2.0


class KVEventPublisher:
    """Keeps ``index`` in step with one worker's prefix cache. Runs on the asyncio loop."""

    def __init__(
        self,
        index: PrefixIndex,
        worker_id: str,
        snapshot: Callable[[], Awaitable[dict[BlockHash, KVMedium]]],
        ttl_s: float = 3.0,
        reconcile_interval_s: float = 30.0,
    ) -> None:
        self.index = index
        self.worker_id = worker_id
        self.num_republished = 0
        self._snapshot = snapshot
        self._ttl_s = ttl_s
        self._reconcile_interval_s = reconcile_interval_s
        self._pending: list[KVCacheEvent] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def submit(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events (called on the loop, in step order)."""
        self._pending.extend(events)
        self._wakeup.set()

    async def stop(self) -> None:
        """Stop publishing and remove the worker's entries (best effort: a worker that cannot
        reach the index leaves them to the routers' reaping once its heartbeat expires)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            await asyncio.wait_for(self.index.forget(self.worker_id), _FORGET_TIMEOUT_S)
        except Exception as exc:
            logger.warning("worker %s left its prefix index entries (%r)", self.worker_id, exc)
        await self.index.close()

    async def _run(self) -> None:
        interval_s = self._ttl_s / 3
        synced = False
        next_heartbeat_s = 0.0
        loop = asyncio.get_running_loop()
        next_reconcile_s = loop.time() + self._reconcile_interval_s
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), interval_s)
            self._wakeup.clear()
            try:
                if loop.time() >= next_heartbeat_s:
                    next_heartbeat_s = loop.time() + interval_s
                    if not await self.index.heartbeat(self.worker_id, self._ttl_s) or not synced:
                        await self._republish()
                        synced = True
                if not synced:  # the index is unreachable: retry at the next heartbeat only
                    self._pending.clear()
                    continue
                events, self._pending = self._pending, []
                await self.index.apply(self.worker_id, events)
                if loop.time() >= next_reconcile_s:
                    next_reconcile_s = loop.time() + self._reconcile_interval_s
                    await self.index.retain(self.worker_id, list(await self._snapshot()))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down or restarting: republish once it is back
                if synced:
                    logger.warning(
                        "prefix index unreachable (%s); will republish",
                        exc,
                        extra=rate_limited("redis"),
                    )
                synced = False
                self._pending.clear()

    async def _republish(self) -> None:
        # Events queued so far are part of the snapshot taken after them.
        self._pending.clear()
        held = await self._snapshot()
        await self.index.clear(self.worker_id)
        for medium in KVMedium:
            block_hashes = [h for h, held_in in held.items() if held_in is medium]
            await self.index.store(self.worker_id, block_hashes, medium)
        self.num_republished += 1
        logger.info(
            "worker %s published %d cached blocks to the prefix index",
            self.worker_id,
            len(held),
        )
