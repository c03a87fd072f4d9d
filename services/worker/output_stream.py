"""One request's outputs on their way from the engine thread to the gRPC handler reading them.

Bounded: a reader that falls ``max_queued`` outputs behind (a slow or stalled client, through
gRPC flow control) pauses its request in the engine, which keeps its KV blocks but stops
generating for it, until the reader has caught up to ``resume_at``. Memory per stream is
therefore bounded by ``max_queued`` deltas, however long the generation; a reader that stays
stalled is the handler's to end (the decode worker's write timeout).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from engine.outputs import RequestOutput

MAX_QUEUED_OUTPUTS = 16
RESUME_AT_OUTPUTS = 4


class OutputStream:
    """Created and used on the asyncio loop only. ``set_paused`` pauses or resumes the request
    in the engine."""

    def __init__(
        self,
        set_paused: Callable[[bool], None],
        max_queued: int = MAX_QUEUED_OUTPUTS,
        resume_at: int = RESUME_AT_OUTPUTS,
    ) -> None:
        self._queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._set_paused = set_paused
        self._max_queued = max_queued
        self._resume_at = resume_at
        self.paused = False

    def put(self, item: RequestOutput | Exception) -> None:
        """Queue an output (pausing the request when the reader is too far behind) or an error
        for the reader to raise."""
        self._queue.put_nowait(item)
        if not self.paused and self._queue.qsize() >= self._max_queued:
            self.paused = True
            self._set_paused(True)

    async def get(self) -> RequestOutput | Exception:
        """The next output or error, resuming a paused request once the reader caught up."""
        item = await self._queue.get()
        if self.paused and self._queue.qsize() <= self._resume_at:
            self.paused = False
            self._set_paused(False)
        return item
