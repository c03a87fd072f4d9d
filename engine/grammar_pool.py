"""Compile output constraints on threads of their own, within a budget, and keep what compiled.

Compiling a constraint (llguidance's grammar build) takes from a millisecond to many seconds
(``ConstraintLimits``); on an engine's thread it would stop every request's steps, on an event
loop every call. A ``GrammarPool`` runs it on a few threads shared by the process, bounded by
its ``ConstraintLimits``:

- size: ``submit`` refuses a constraint over the size budget (``ValueError``) before any
  compiling;
- time: ``result`` and ``wait`` give up on a compile after ``compile_timeout_s``: one still
  queued then is cancelled (the threads are overloaded: a backlog nobody waits for must not
  grow), one running runs on to its end (a thread cannot be stopped) and its result is kept.
  llguidance builds with the GIL released (a Python thread spinning beside a 15 s build kept
  80% of its speed on a busy 2-core host), so a long compile costs a core, never the engine's
  steps or an event loop;
- cache: the compiles (running, done or failed) of the latest constraints, keyed by the
  constraint (equal constraints have equal grammar text), so a repeated constraint compiles
  once and a repeated bad one fails at once.

The threads (``NUM_COMPILE_THREADS``) have deep stacks: llguidance recurses once per rule of a
chain (``a: b``, ``b: c``, ...), and a chain of 3,000 rules (48 KiB of grammar) overflowed a
default 8 MiB stack, a segfault that takes the whole process down; 64 MiB held 11,000 rules,
more than the default size budget lets through.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from engine.constraint import Constraint, ConstraintLimits

T = TypeVar("T")

NUM_COMPILE_THREADS = 2
_STACK_BYTES = 64 * 2**20
# What a pool keeps: a compiled matcher took up to 130x its constraint's bytes (8 MiB).
_CACHE_ENTRIES = 256
_CACHE_BYTES = 4 * 2**20


class _CompileThreads:
    """Daemon threads with deep stacks running submitted calls in order of submission."""

    def __init__(self, num_threads: int) -> None:
        self._work: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]]]
        self._work = queue.SimpleQueue()
        # The stack size is process-wide: set only while these threads start.
        previous = threading.stack_size(_STACK_BYTES)
        try:
            for i in range(num_threads):
                threading.Thread(target=self._run, name=f"grammar-compile-{i}", daemon=True).start()
        finally:
            threading.stack_size(previous)

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._work.put((future, fn))
        return future

    def _run(self) -> None:
        while True:
            future, fn = self._work.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to whoever waits on the compile
                future.set_exception(exc)


_threads: _CompileThreads | None = None
_threads_lock = threading.Lock()


def _compile_threads() -> _CompileThreads:
    """The process's compile threads, started on the first compile."""
    global _threads
    with _threads_lock:
        if _threads is None:
            _threads = _CompileThreads(NUM_COMPILE_THREADS)
        return _threads


class GrammarPool(Generic[T]):
    """Compiles constraints with ``compile`` (run on the compile threads; ``ValueError``
    prefixed by the constraint's kind when it does not compile) within ``limits``, and keeps
    the latest compiles. Thread-safe.

    ``num_hits`` / ``num_misses`` count ``submit``s answered from the cache or not.
    """

    def __init__(self, compile: Callable[[Constraint], T], limits: ConstraintLimits) -> None:
        self.limits = limits
        self._compile = compile
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[Constraint, concurrent.futures.Future[T]]
        self._cache = collections.OrderedDict()
        self._cache_bytes = 0
        self.num_hits = 0
        self.num_misses = 0

    def submit(self, constraint: Constraint) -> concurrent.futures.Future[T]:
        """The compile of ``constraint``: the cached one (running, done or failed), else a new
        one queued. ``ValueError`` at once when it is over the size budget. Never blocks on a
        compile. Read a done future with ``outcome``; give up on it with ``give_up``."""
        self.limits.check(constraint)
        with self._lock:
            future = self._cache.get(constraint)
            if future is not None:
                self._cache.move_to_end(constraint)
                self.num_hits += 1
                return future
            self.num_misses += 1
            future = _compile_threads().submit(functools.partial(self._compile, constraint))
            self._cache[constraint] = future
            self._cache_bytes += constraint.num_bytes
            while len(self._cache) > _CACHE_ENTRIES or self._cache_bytes > _CACHE_BYTES:
                evicted, _ = self._cache.popitem(last=False)
                self._cache_bytes -= evicted.num_bytes
        return future

    def result(self, constraint: Constraint) -> T:
        """Block until ``constraint`` is compiled, for at most ``compile_timeout_s``;
        ``ValueError`` when it is over budget (size or time) or does not compile."""
        future = self.submit(constraint)
        concurrent.futures.wait([future], timeout=self.limits.compile_timeout_s)
        if not future.done():
            raise self.give_up(constraint, future)
        return self.outcome(constraint, future)

    async def wait(self, constraint: Constraint) -> T:
        """``result`` for an event loop: the loop runs on while the compile does."""
        future = self.submit(constraint)
        if not future.done():
            loop = asyncio.get_running_loop()
            compiled = asyncio.Event()
            future.add_done_callback(
                lambda _: loop.is_closed() or loop.call_soon_threadsafe(compiled.set)
            )
            try:
                async with asyncio.timeout(self.limits.compile_timeout_s):
                    await compiled.wait()
            except TimeoutError:
                raise self.give_up(constraint, future) from None
        return self.outcome(constraint, future)

    def outcome(self, constraint: Constraint, future: concurrent.futures.Future[T]) -> T:
        """The compiled ``constraint`` from its done ``future``; ``ValueError`` when it did not
        compile, or was given up (see ``give_up``)."""
        if future.cancelled():
            raise self.timeout_error(constraint)
        return future.result()

    def give_up(self, constraint: Constraint, future: concurrent.futures.Future[T]) -> ValueError:
        """The error of a wait for ``future`` that ran out of ``compile_timeout_s``. A compile
        still queued is cancelled and forgotten (its other waiters fail too, and the next
        ``submit`` queues it anew); a running one is left to finish."""
        if future.cancel():
            with self._lock:
                if self._cache.get(constraint) is future:
                    del self._cache[constraint]
                    self._cache_bytes -= constraint.num_bytes
        return self.timeout_error(constraint)

    def timeout_error(self, constraint: Constraint) -> ValueError:
        return ValueError(
            f"{constraint.kind.value}: not compiled within {self.limits.compile_timeout_s:g} s "
            "(a smaller constraint compiles faster)"
        )
