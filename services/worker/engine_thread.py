"""The one thread that builds a worker's engine and then steps it.

An engine loaded on one thread and stepped on another holds two OpenMP pools, which throttle
each other once they outnumber the CPUs (``engine.cpu_tuning.BuildThread`` says how, and what
it cost); building the engine on the thread that steps it keeps a single pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class EngineThread:
    """A dedicated daemon thread: ``run`` blocking calls on it from asyncio (the engine's load),
    then ``submit`` the engine loop to it. Invariant: every call runs on this one OS thread,
    one at a time, in submission order."""

    def __init__(self, name: str = "engine-loop") -> None:
        self._calls: queue.SimpleQueue[
            tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None
        ] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the thread; awaits its result (its exception propagates)."""
        return await asyncio.wrap_future(self.submit(functools.partial(fn, *args)))

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Start ``fn()`` on the thread once the calls before it end; returns its future."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._calls.put((fn, future))
        return future

    def shutdown(self) -> None:
        """Take no more calls: the thread ends after the ones already submitted."""
        self._calls.put(None)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            fn, future = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to whoever awaits the future
                future.set_exception(exc)
