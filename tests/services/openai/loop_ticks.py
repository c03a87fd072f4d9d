"""Counting the event loop's turns: how a test sees that other tasks ran meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType


class LoopTicks:
    """While open (``async with``), a task that counts one tick per loop turn in ``count``."""

    def __init__(self) -> None:
        self.count = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopTicks:
        self._task = asyncio.create_task(self._tick())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _tick(self) -> None:
        while True:
            self.count += 1
            await asyncio.sleep(0)
