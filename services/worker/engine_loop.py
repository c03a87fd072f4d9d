"""Run one engine (an ``EngineBackend``) on its own thread and stream its outputs to asyncio
callers.

The engine is single-threaded and its steps are long (milliseconds to seconds), so it gets a
dedicated thread (an ``EngineThread``, the one that built it); gRPC handlers live on the asyncio
loop. The two sides talk through:

- a command queue (asyncio → engine thread): add, abort, any call that touches engine state;
- one ``call_soon_threadsafe`` per step (engine thread → asyncio) carrying that step's outputs,
  fanned out to per-request ``asyncio.Queue``s.

Role-specific work that must happen between steps (pulling KV on a decode worker, expiring
leases on a prefill worker) plugs in as ``EngineHooks``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol, TypeVar

from prometheus_client import Histogram

from engine.backend import EngineBackend
from engine.block_pool import KVCacheEvent
from engine.outputs import RequestOutput
from engine.scheduler import DuplicateRequestError
from engine.stats import EngineStats
from services.worker.engine_thread import EngineThread
from services.worker.output_stream import OutputStream

logger = logging.getLogger(__name__)

T = TypeVar("T")

# One engine step's wall time: a step that stalls every running request (a long prefill chunk,
# work that does not belong on the engine thread) shows in the upper buckets.
ENGINE_STEP_SECONDS = Histogram(
    "splitserve_engine_step_seconds",
    "wall time of one engine step (schedule, forward, sample, update) on a worker",
    ["model_name"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
)

# How long the engine thread sleeps when idle but hooks have transfers or leases to watch.
_BUSY_POLL_S = 0.002
_IDLE_POLL_S = 0.5


class EngineHooks(Protocol):
    """Role-specific work run on the engine thread around each step."""

    def before_step(self, engine: EngineBackend) -> None:
        """Called before every step (and every idle poll)."""

    def after_step(self, engine: EngineBackend, outputs: list[RequestOutput]) -> None:
        """Called after every step with its outputs, before they reach the callers."""

    def abort(self, engine: EngineBackend, req_id: str) -> list[RequestOutput]:
        """Abort ``req_id`` (possibly later, e.g. once its KV transfer ends)."""

    @property
    def busy(self) -> bool:
        """Whether ``before_step`` has work pending (e.g. transfers in flight) while idle."""


class NoHooks:
    """Plain engine: abort at once, nothing between steps."""

    def before_step(self, engine: EngineBackend) -> None:
        return None

    def after_step(self, engine: EngineBackend, outputs: list[RequestOutput]) -> None:
        return None

    def abort(self, engine: EngineBackend, req_id: str) -> list[RequestOutput]:
        return engine.abort_requests([req_id])

    @property
    def busy(self) -> bool:
        return False


class EngineDeadError(RuntimeError):
    """The engine thread stopped (crashed or shut down); no request can make progress."""


class StreamEndedError(RuntimeError):
    """The worker ended the stream before its request finished (it is shutting down); the
    request is aborted here and may continue on another worker."""


class EngineLoop:
    """Owns the engine thread. Create on the asyncio loop, then ``start()``.

    Invariant: only the engine thread touches ``engine`` after ``start()``; everything else
    goes through ``call`` / ``add_request`` / ``abort``.
    """

    def __init__(
        self,
        engine: EngineBackend,
        hooks: EngineHooks | None = None,
        on_kv_events: Callable[[list[KVCacheEvent]], None] | None = None,
    ) -> None:
        self.engine = engine
        self.hooks: EngineHooks = hooks or NoHooks()
        # Called on the asyncio loop with each step's prefix-cache events, in order.
        self.on_kv_events = on_kv_events
        # Called once on the asyncio loop after the engine thread crashed, once every open
        # stream has been handed its EngineDeadError.
        self.on_dead: Callable[[BaseException], None] | None = None
        self._commands: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        # A request held while its grammar compiles is admitted by the next step: wake for it.
        engine.on_constraint_compiled = self._wakeup.set
        self._streams: dict[str, OutputStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: EngineThread | None = None
        self._running: concurrent.futures.Future[None] | None = None
        self._stopping = False
        self._error: BaseException | None = None
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._stats = engine.stats()

    def start(self, thread: EngineThread | None = None) -> None:
        """Start stepping on ``thread``: the one the engine was built on (``EngineThread``
        explains why), else a new one."""
        self._loop = asyncio.get_running_loop()
        self._thread = thread or EngineThread()
        self._running = self._thread.submit(self._run)

    def shutdown(self) -> None:
        """Stop the engine thread after its current step. Idempotent."""
        self._stopping = True
        self._wakeup.set()
        if self._running is not None:
            concurrent.futures.wait([self._running], timeout=30)
        if self._thread is not None:
            self._thread.shutdown()

    @property
    def stats(self) -> EngineStats:
        """Snapshot taken after the latest step (never blocks on the engine)."""
        return self._stats

    @property
    def is_alive(self) -> bool:
        return self._running is not None and not self._running.done() and self._error is None

    # ----------------------------------------------------------------------------- asyncio side
    async def call(self, fn: Callable[[EngineBackend], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        self._check_alive()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def command() -> None:
            self._pending.discard(future)
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(self.engine))
            except BaseException as exc:  # handed to the awaiting caller
                future.set_exception(exc)

        self._pending.add(future)
        self._commands.put(command)
        self._wakeup.set()
        return await asyncio.wrap_future(future)

    async def generate(
        self, req_id: str, add: Callable[[EngineBackend], Any]
    ) -> AsyncGenerator[RequestOutput, None]:
        """Add a request with ``add(engine)`` (which may raise ``ValueError``) and yield its
        outputs until the finished one. Closing or cancelling the iterator early aborts it.
        ``DuplicateRequestError`` if ``req_id`` is streaming or held by the engine already."""
        if req_id in self._streams:
            raise DuplicateRequestError(f"request_id {req_id!r} is already in flight")
        stream = OutputStream(
            lambda paused: self._command(lambda: self.engine.set_paused(req_id, paused))
        )
        self._streams[req_id] = stream
        finished = False
        refused = False
        try:
            try:
                await self.call(add)
            except ValueError:
                refused = True  # never added: the id may be another request's, left alone
                raise
            while True:
                output = await stream.get()
                if isinstance(output, Exception):
                    raise output
                yield output
                if output.finished:
                    finished = True
                    return
        finally:
            if self._streams.get(req_id) is stream:
                del self._streams[req_id]
            if not finished and not refused and self.is_alive:
                self.abort(req_id)

    @property
    def num_streams(self) -> int:
        """Requests whose outputs are being streamed to a caller now."""
        return len(self._streams)

    def end_streams(self, reason: str) -> None:
        """End every open stream with ``StreamEndedError(reason)`` (its caller aborts it)."""
        for stream in self._streams.values():
            stream.put(StreamEndedError(reason))

    def abort(self, req_id: str) -> None:
        """Abort ``req_id`` on the engine thread (fire and forget; unknown ids are ignored)."""
        self._command(lambda: self._dispatch_abort(req_id))

    def _command(self, command: Callable[[], object]) -> None:
        self._commands.put(command)
        self._wakeup.set()

    async def abort_and_wait(self, req_id: str) -> bool:
        """Abort ``req_id`` and wait for it; True if a request was aborted there and then."""
        return await self.call(lambda _: self._dispatch_abort(req_id))

    def _check_alive(self) -> None:
        if not self.is_alive:
            raise EngineDeadError(f"engine is not running: {self._error!r}")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.req_id)
            if stream is not None:
                stream.put(output)

    def _fail_all(self, error: EngineDeadError) -> None:
        for stream in self._streams.values():
            stream.put(error)

    # ----------------------------------------------------------------------------- engine thread
    def _dispatch_abort(self, req_id: str) -> bool:
        outputs = self.hooks.abort(self.engine, req_id)
        if outputs:
            self._post(outputs)
        return bool(outputs)

    def _post(self, outputs: list[RequestOutput]) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _run(self) -> None:
        engine = self.engine
        step_seconds = ENGINE_STEP_SECONDS.labels(engine.info.served_model_name)
        try:
            while not self._stopping:
                self._drain_commands()
                self.hooks.before_step(engine)
                did_work = False
                if engine.has_unfinished_requests():
                    start_s = time.perf_counter()
                    outputs = engine.step()
                    did_work = engine.last_num_scheduled_tokens > 0
                    if did_work:
                        step_seconds.observe(time.perf_counter() - start_s)
                    self.hooks.after_step(engine, outputs)
                    if outputs:
                        self._post(outputs)
                self._stats = engine.stats()
                # Always drained, so a worker without a prefix index keeps no event backlog.
                events = engine.take_kv_cache_events()
                if events and self.on_kv_events is not None:
                    assert self._loop is not None
                    self._loop.call_soon_threadsafe(self.on_kv_events, events)
                if not did_work:
                    self._wakeup.wait(_BUSY_POLL_S if self.hooks.busy else _IDLE_POLL_S)
                    self._wakeup.clear()
        except BaseException as exc:
            logger.exception("engine loop crashed")
            self._error = exc
            error = EngineDeadError(f"engine loop crashed: {exc!r}")
            for future in list(self._pending):
                if not future.done():
                    future.set_exception(error)
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._die, error, exc)

    def _die(self, error: EngineDeadError, cause: BaseException) -> None:
        self._fail_all(error)
        if self.on_dead is not None:
            self.on_dead(cause)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()
