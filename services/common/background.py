"""Fire-and-forget coroutines that are kept referenced until they finish."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class BackgroundTasks:
    """Runs coroutines whose result nobody awaits (releases, clean-ups) on the running loop.

    asyncio keeps only weak references to tasks, so a task that nobody holds may be garbage
    collected mid-flight; this set holds each one until it is done.
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for every task spawned so far."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
