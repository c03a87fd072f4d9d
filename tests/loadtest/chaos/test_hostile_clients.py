"""How ``loadtest.chaos.hostile_clients`` tells one attempt's end, against small asyncio servers on
loopback that behave as a server with and without the limits would."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from loadtest.chaos.hostile_clients import Outcome, Progress, attempt
from loadtest.chaos.hostile_requests import HostileKind, RequestBytes, Target

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
_STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n"


async def _stream_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A server with a stream idle timeout: streams more than the client's buffers hold, then
    gives up on the reader and closes (its close waits behind the unread bytes)."""
    writer.write(_STREAM_HEAD + b"data: x\n\n" * 200_000)
    writer.close()


async def _stream_forever(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A server without one: keeps the stream open as long as the client stays."""
    writer.write(_STREAM_HEAD)
    try:
        while True:
            writer.write(b"data: x\n\n")
            await writer.drain()
    except ConnectionError:
        writer.close()


async def _stream_chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A whole chunked event stream, ended, on a connection kept open afterwards."""
    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    for _ in range(2000):
        writer.write(b"9\r\ndata: x\n\n\r\n")
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    await reader.read()  # until the client closes
    writer.close()


async def _refuse_header(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A server with a header limit: reads 64 KiB of the head, answers 431 and closes."""
    await reader.read(65536)
    writer.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n\r\n")
    await writer.drain()
    writer.close()


async def _time_out_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A server with a header timeout: answers 408 once the head stalls for 2.5 s (the client
    sends a byte every 2 s: the timeout counts from the first byte)."""
    try:
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2.5)
    except TimeoutError:
        writer.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()
    writer.close()


async def _attempt_against(
    handler: Handler, kind: HostileKind, hold_s: float
) -> tuple[Outcome, int | None, list[bool]]:
    """One attempt of ``kind`` against a server running ``handler``: its outcome and status,
    and whether it reported its connect once."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    target = Target("127.0.0.1", port, max_tokens=16, header_bytes=4 * 2**20, hold_s=hold_s)
    connected: list[bool] = []
    progress = Progress(time.monotonic())
    async with server:
        made = await attempt(
            kind, target, RequestBytes(target), progress, lambda: connected.append(True)
        )
    return made.outcome, made.status, connected


@pytest.mark.parametrize(
    ("handler", "kind", "hold_s", "want"),
    [
        # A non-reader learns at its hold limit, reading its buffer out, that the server ended it.
        (_stream_then_close, HostileKind.SLOW_READER, 1.0, (Outcome.CLOSED, 200)),
        (_stream_forever, HostileKind.FANOUT_STREAM, 1.0, (Outcome.HELD, 200)),
        (_refuse_header, HostileKind.HUGE_HEADER, 30.0, (Outcome.REFUSED, 431)),
        # The control reads its whole stream, then keeps the connection to its hold limit.
        (_stream_chunked, HostileKind.READER, 0.5, (Outcome.ANSWERED, 200)),
        (_stream_forever, HostileKind.READER, 0.5, (Outcome.HELD, 200)),
        (_time_out_head, HostileKind.SLOWLORIS_HEADERS, 30.0, (Outcome.REFUSED, 408)),
    ],
)
def test_an_attempt_ends_as_the_server_ends_it(
    handler: Handler, kind: HostileKind, hold_s: float, want: tuple[Outcome, int]
) -> None:
    outcome, status, connected = asyncio.run(_attempt_against(handler, kind, hold_s))
    assert (outcome, status) == want
    assert connected == [True]


def test_no_server_is_a_failed_connect() -> None:
    async def closed_port() -> int:
        server = await asyncio.start_server(_stream_forever, "127.0.0.1", 0)
        port: int = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        return port

    port = asyncio.run(closed_port())
    target = Target("127.0.0.1", port, max_tokens=16, header_bytes=16, hold_s=5.0)
    requests, progress = RequestBytes(target), Progress(time.monotonic())
    made = asyncio.run(attempt(HostileKind.SLOW_READER, target, requests, progress, lambda: None))
    assert made.outcome is Outcome.CONNECT_FAILED
