"""Expensive work kept to a share of the time: pieces run one at a time, each starting no sooner
than a pause after the previous one that keeps their busy time to ``share`` of the wall clock.

The router parses large request bodies in a helper process through one ``DutyCycle``: a stream
of expensive bodies (100,000-string ``guided_choice`` lists, each 20 to 40 ms of parsing) slows
itself down, not the host's other work, and a cheap piece (a long prompt) waits a few ms at most.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class DutyCycle:
    """Runs awaitables one at a time within ``share`` (0 < share <= 1) of the wall-clock time;
    used on one event loop."""

    def __init__(self, share: float) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self._idle_per_busy = 1 / share - 1
        self._turn = asyncio.Lock()
        self._next_s = 0.0  # time.monotonic() before which nothing else starts

    async def run(self, work: Callable[[], Awaitable[T]]) -> T:
        """``await work()``'s result (or exception), once the previous piece's pause has
        passed; a piece's time counts whether it returns or raises."""
        async with self._turn:
            await asyncio.sleep(max(0.0, self._next_s - time.monotonic()))
            start_s = time.monotonic()
            try:
                return await work()
            finally:
                end_s = time.monotonic()
                self._next_s = end_s + (end_s - start_s) * self._idle_per_busy
