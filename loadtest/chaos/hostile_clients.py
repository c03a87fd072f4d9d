"""Hostile HTTP clients of the router's OpenAI API, as ``loadtest.chaos --hostile`` runs them.

``python -m loadtest.chaos.hostile_clients --url http://HOST:PORT [--connections 64] [--kinds ...]``
keeps ``--connections`` raw TCP connections open against the server, spread evenly over the
kinds (``HostileKind``); each one opens again a second after it ends, so the pressure stays
constant (the pause keeps a quickly refused kind from turning into a flood of connections: a
different attack, for a rate limiter in front of the server). It prints ``ready`` once every
connection has made its first attempt, runs until SIGTERM or SIGINT, then prints one JSON
object: per kind, how its attempts ended.

How an attempt ends (``Outcome``): the server answered an error status (``refused``) or a
success (``answered``; a client that never reads sees a success as ``held`` or ``closed``),
closed or reset the connection (``closed``), or did neither before the client's hold limit or
the end of the run (``held``); ``connect-failed`` when no connection could be made. Clients
that never read (slow readers, fan-outs) see a status by peeking at their receive buffer, and a
close only when that buffer is empty or, at their hold limit, by reading it out.

It and ``loadtest.chaos.hostile_requests`` use the standard library only: it starts in a
fraction of a second beside the cluster under test.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import enum
import json
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from loadtest.chaos.hostile_requests import (
    FANOUT_MAX_TOKENS,
    HostileKind,
    RequestBytes,
    Target,
    parse_kinds,
)

_SMALL_RCVBUF = 4096
_TRICKLE_S = 2.0  # slowloris: one header byte this often
_POLL_S = 1.0  # non-readers: how often they peek at their receive buffer
_REOPEN_S = 1.0
_DRAIN_S = 5.0  # non-readers at their hold limit: how long they read to see the end
_LAST_CHUNK = b"0\r\n\r\n"  # a chunked response's end


class Outcome(enum.Enum):
    """How one hostile attempt ended."""

    REFUSED = "refused"
    ANSWERED = "answered"
    CLOSED = "closed"
    HELD = "held"
    CONNECT_FAILED = "connect-failed"


@dataclass(frozen=True, slots=True)
class Attempt:
    """One connection of one kind, from connect to its end."""

    outcome: Outcome
    status: int | None  # the HTTP status the server answered, if any
    open_s: float


@dataclass(frozen=True, slots=True)
class KindSummary:
    """Every attempt of one kind: counts by outcome and by HTTP status, mean time open."""

    connections: int
    attempts: int
    outcomes: dict[str, int]
    statuses: dict[str, int]
    mean_open_s: float


@dataclass(slots=True)
class Progress:
    """What an open attempt has seen so far: still known when it is cancelled."""

    start_s: float
    status: int | None = None


def _status(head: bytes) -> int | None:
    """The status of a response starting with ``head`` (None: not a status line yet)."""
    parts = head.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return None
    return int(parts[1])


def _answered(status: int | None) -> Outcome:
    if status is None:
        return Outcome.CLOSED
    return Outcome.REFUSED if status >= 400 else Outcome.ANSWERED


async def _connect(target: Target, small_rcvbuf: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in target.host else socket.AF_INET)
    sock.setblocking(False)
    if small_rcvbuf:
        # Before connecting: the window the client advertises is fixed at the handshake.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SMALL_RCVBUF)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (target.host, target.port))
    except BaseException:
        sock.close()
        raise
    return sock


async def _hold_unread(sock: socket.socket, deadline_s: float, progress: Progress) -> Outcome:
    """Never read; peek at the receive buffer (its status goes to ``progress``) until the
    server refuses, resets or closes (seen only with nothing buffered), or ``deadline_s``; then
    ``_drain``."""
    while time.monotonic() < deadline_s:
        try:
            head = sock.recv(64, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            head = None
        except OSError:
            return Outcome.CLOSED
        if head == b"":
            return Outcome.CLOSED
        if head:
            progress.status = _status(head)
            if progress.status is not None and progress.status >= 400:
                return Outcome.REFUSED
        await asyncio.sleep(_POLL_S)
    return await _drain(sock, progress)


async def _drain(sock: socket.socket, progress: Progress) -> Outcome:
    """Read what the server sent: ``closed`` if the connection ends within ``_DRAIN_S`` (the
    server had given up on this reader: its close waited behind the unread bytes), else
    ``held`` (it still streams, or holds the connection open). The status, if not peeked yet,
    goes to ``progress``."""
    loop = asyncio.get_running_loop()
    end_s = time.monotonic() + _DRAIN_S
    while (left_s := end_s - time.monotonic()) > 0:
        try:
            chunk = await asyncio.wait_for(loop.sock_recv(sock, 2**16), left_s)
        except TimeoutError:
            break
        except OSError:
            return Outcome.CLOSED
        if not chunk:
            return Outcome.CLOSED
        if progress.status is None:
            progress.status = _status(chunk)
    return Outcome.HELD


async def _read_answer(
    sock: socket.socket, deadline_s: float, trickle: bool = False
) -> tuple[Outcome, int | None]:
    """Wait for the server's status line until ``deadline_s``; with ``trickle``, send one
    header byte every ``_TRICKLE_S`` meanwhile."""
    loop = asyncio.get_running_loop()
    received = b""
    while (left_s := deadline_s - time.monotonic()) > 0:
        wait_s = min(left_s, _TRICKLE_S) if trickle else left_s
        try:
            chunk = await asyncio.wait_for(loop.sock_recv(sock, 4096), wait_s)
        except TimeoutError:
            if trickle:
                try:
                    await loop.sock_sendall(sock, b"a")
                except OSError:
                    return Outcome.CLOSED, None
            continue
        except OSError:
            return _answered(_status(received)), _status(received)
        if not chunk:
            return _answered(_status(received)), _status(received)
        received += chunk
        if b"\r\n" in received:
            status = _status(received)
            return _answered(status), status
    return Outcome.HELD, _status(received)


async def _read_all_then_hold(sock: socket.socket, deadline_s: float) -> tuple[Outcome, int | None]:
    """Read a chunked response to its end as it comes, then keep the connection until
    ``deadline_s`` (``held`` if the response had not ended by then)."""
    loop = asyncio.get_running_loop()
    head = tail = b""  # the status line is in the head, the end marker in the tail
    while tail != _LAST_CHUNK:
        left_s = max(deadline_s - time.monotonic(), 0.0)
        try:
            chunk = await asyncio.wait_for(loop.sock_recv(sock, 2**16), left_s)
        except TimeoutError:
            return Outcome.HELD, _status(head)
        except OSError:
            chunk = b""
        if not chunk:
            return Outcome.CLOSED, _status(head)
        head = (head + chunk)[:64] if len(head) < 64 else head
        tail = (tail + chunk)[-len(_LAST_CHUNK) :]
    await asyncio.sleep(max(deadline_s - time.monotonic(), 0.0))
    status = _status(head)
    return _answered(status), status


async def attempt(
    kind: HostileKind,
    target: Target,
    requests: RequestBytes,
    progress: Progress,
    connected: Callable[[], None],
) -> Attempt:
    """One connection of ``kind``: connect (then call ``connected``, also when that failed),
    send, hold until the server ends it or the hold limit passes. Cancelled (the run ends), it
    closes its socket; ``progress`` then tells what it had seen."""
    start_s = progress.start_s
    deadline_s = start_s + target.hold_s
    non_reader = kind in (
        HostileKind.SLOW_READER,
        HostileKind.FANOUT_STREAM,
        HostileKind.FANOUT_CHAT,
    )
    try:
        sock = await _connect(target, small_rcvbuf=non_reader)
    except OSError:
        return Attempt(Outcome.CONNECT_FAILED, None, time.monotonic() - start_s)
    finally:
        connected()
    with sock:
        try:
            await asyncio.get_running_loop().sock_sendall(sock, requests.by_kind[kind])
        except OSError:
            # Cut off while sending (e.g. a header over the limit): what did it answer?
            outcome, status = await _read_answer(sock, time.monotonic() + _POLL_S)
            return Attempt(outcome, status, time.monotonic() - start_s)
        if non_reader:
            outcome, status = await _hold_unread(sock, deadline_s, progress), progress.status
        elif kind is HostileKind.READER:
            outcome, status = await _read_all_then_hold(sock, deadline_s)
        else:
            trickle = kind is HostileKind.SLOWLORIS_HEADERS
            outcome, status = await _read_answer(sock, deadline_s, trickle)
    return Attempt(outcome, status, time.monotonic() - start_s)


class HostilePool:
    """``connections`` slots over ``kinds`` (slot i runs ``kinds[i % len(kinds)]``), each
    reopening its connection ``_REOPEN_S`` after it ends, until ``stop``."""

    def __init__(self, target: Target, connections: int, kinds: list[HostileKind]) -> None:
        self._target = target
        self._requests = RequestBytes(target)
        self._slot_kinds = [kinds[i % len(kinds)] for i in range(connections)]
        self._attempts: dict[HostileKind, list[Attempt]] = {k: [] for k in kinds}
        self._started = 0
        self.ready = asyncio.Event()  # every slot has made its first attempt
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._slot(k)) for k in self._slot_kinds]

    async def stop(self) -> dict[str, KindSummary]:
        """Cancel every slot (an attempt still open counts as ``held``); the summary by kind."""
        pending = set(self._tasks)
        while pending:
            # Again each second: Python 3.11's wait_for can swallow a cancellation that
            # arrives as its inner wait ends, and the slot would then open another attempt.
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=1.0)
        return {kind.value: self._summary(kind) for kind in self._attempts}

    async def _slot(self, kind: HostileKind) -> None:
        first = True

        def connected() -> None:
            nonlocal first
            if first:
                first = False
                self._started += 1
                if self._started == len(self._slot_kinds):
                    self.ready.set()

        while True:
            progress = Progress(time.monotonic())
            try:
                made = await attempt(kind, self._target, self._requests, progress, connected)
            except asyncio.CancelledError:
                open_s = time.monotonic() - progress.start_s
                self._attempts[kind].append(Attempt(Outcome.HELD, progress.status, open_s))
                raise
            self._attempts[kind].append(made)
            await asyncio.sleep(_REOPEN_S)

    def _summary(self, kind: HostileKind) -> KindSummary:
        attempts = self._attempts[kind]
        return KindSummary(
            connections=self._slot_kinds.count(kind),
            attempts=len(attempts),
            outcomes=dict(Counter(a.outcome.value for a in attempts)),
            statuses=dict(Counter(str(a.status) for a in attempts if a.status is not None)),
            mean_open_s=sum(a.open_s for a in attempts) / len(attempts) if attempts else 0.0,
        )


async def _run(target: Target, connections: int, kinds: list[HostileKind]) -> None:
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    pool = HostilePool(target, connections, kinds)
    pool.start()
    ready = asyncio.create_task(pool.ready.wait())
    stopped = asyncio.create_task(stopping.wait())
    await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
    ready.cancel()
    if pool.ready.is_set():
        print("ready", flush=True)
    await stopped
    summary = await pool.stop()
    print(json.dumps({k: dataclasses.asdict(v) for k, v in summary.items()}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.chaos.hostile_clients", description=__doc__
    )
    parser.add_argument("--url", required=True, help="the router's HTTP API, http://HOST:PORT")
    parser.add_argument("--connections", type=int, default=64, help="(default: 64)")
    parser.add_argument(
        "--kinds",
        help=f"comma-separated (default: all of {[k.value for k in parse_kinds(None)]}; "
        "'reader' is the control for slow readers)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=FANOUT_MAX_TOKENS,
        help="of slow readers and fan-outs (default: %(default)s)",
    )
    parser.add_argument(
        "--header-mb",
        type=float,
        default=64.0,
        help="the huge header's size (default: %(default)s)",
    )
    parser.add_argument(
        "--hold-s",
        type=float,
        default=120.0,
        help="longest a connection stays open (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    url = urlsplit(args.url)
    if url.scheme != "http" or url.hostname is None or url.port is None:
        parser.error("--url: http://HOST:PORT")
    try:
        kinds = parse_kinds(args.kinds)
    except ValueError as exc:
        parser.error(f"--kinds: {exc}")
    target = Target(
        url.hostname, url.port, args.max_tokens, int(args.header_mb * 10**6), args.hold_s
    )
    asyncio.run(_run(target, args.connections, kinds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
