"""Framing and client connections of the ``tcp`` KV transfer backend (private to ``kvtransfer``).

A frame is a 4-byte big-endian length then a serialized ``KVFrame``
(``proto/splitserve/v1/kv_transfer.proto``); frames over ``MAX_FRAME_BYTES`` or that do not
decode raise ``ProtocolError`` and the connection must be closed. ``decode_frame`` and
``check_hello`` also serve the ``ucx`` backend, which sends the same frames over UCX.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable

from google.protobuf.message import DecodeError

from kvtransfer.base import KV_TRANSFER_VERSION, KVTransferError
from splitserve.v1 import kv_transfer_pb2 as pb

MAX_FRAME_BYTES = 16 * 1024 * 1024
# A hello is a few hundred bytes: a peer that has not said it yet gets no bigger buffer.
MAX_HELLO_BYTES = 4096
# A pooled connection unused this long is closed rather than reused (the server drops
# connections idle for SERVER_IDLE_TIMEOUT_S; reusing one it dropped would fail a transfer).
CLIENT_IDLE_S = 60.0
SERVER_IDLE_TIMEOUT_S = 2 * CLIENT_IDLE_S
_LENGTH = struct.Struct(">I")


class ProtocolError(Exception):
    """The other end broke the wire format; the connection cannot be trusted any more."""


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ``ConnectionError`` if the peer closes first."""
    while len(view) > 0:
        num_bytes = sock.recv_into(view)
        if num_bytes == 0:
            raise ConnectionError("connection closed by peer")
        view = view[num_bytes:]


def send_frame(sock: socket.socket, frame: pb.KVFrame) -> None:
    """Write ``frame`` with its length prefix in one ``sendall``."""
    body = frame.SerializeToString()
    sock.sendall(_LENGTH.pack(len(body)) + body)


def recv_frame(
    sock: socket.socket,
    io_timeout_s: float,
    wait_s: float | None,
    max_bytes: int = MAX_FRAME_BYTES,
) -> pb.KVFrame:
    """Read one frame: wait up to ``wait_s`` (None: forever) for it to start, then
    ``io_timeout_s`` per socket operation. Raises ``ProtocolError`` on a bad frame, or one
    announcing more than ``max_bytes`` (before allocating anything for it)."""
    header = bytearray(_LENGTH.size)
    sock.settimeout(wait_s)
    recv_exact_into(sock, memoryview(header))
    sock.settimeout(io_timeout_s)
    (length,) = _LENGTH.unpack(header)
    if length > max_bytes:
        raise ProtocolError(f"frame of {length} bytes exceeds {max_bytes}")
    body = bytearray(length)
    recv_exact_into(sock, memoryview(body))
    return decode_frame(bytes(body))


def decode_frame(body: bytes) -> pb.KVFrame:
    """A frame's body as a ``KVFrame``; ``ProtocolError`` if it is not one with a body."""
    try:
        frame = pb.KVFrame.FromString(body)
    except DecodeError as exc:
        raise ProtocolError(f"undecodable frame: {exc}") from exc
    if frame.WhichOneof("body") is None:
        raise ProtocolError("frame without a body")
    return frame


def check_hello(frame: pb.KVFrame, compat_hash: str) -> tuple[pb.KVHello, str]:
    """The peer's hello and why we refuse it ("" when we accept it). ``ProtocolError`` when
    the frame is not a hello."""
    if frame.WhichOneof("body") != "hello":
        raise ProtocolError(f"expected hello, got {frame.WhichOneof('body')}")
    hello = frame.hello
    if hello.version != KV_TRANSFER_VERSION:
        return hello, f"kv transfer version {hello.version} != ours {KV_TRANSFER_VERSION}"
    if hello.compat_hash != compat_hash:
        return hello, f"compat_hash {hello.compat_hash!r} != ours {compat_hash!r}"
    return hello, ""


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> ``(host, port)``; ``KVTransferError`` if malformed."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise KVTransferError(f"bad tcp peer address {address!r}, expected host:port")
    return host.strip("[]"), int(port)


class PeerConnections:
    """Warm connections to one source: created lazily (connect + hello handshake) up to
    ``max_connections``; ``acquire`` blocks while all of them are busy.

    Thread-safe. A connection is used by one thread between ``acquire`` and ``give_back``.
    """

    def __init__(
        self,
        address: str,
        hello: pb.KVFrame,
        connect_timeout_s: float,
        io_timeout_s: float,
        max_connections: int,
        on_first_connection: Callable[[float], None],
    ) -> None:
        self._address = split_address(address)
        self._hello = hello
        self._connect_timeout_s = connect_timeout_s
        self._io_timeout_s = io_timeout_s
        self._max_connections = max_connections
        self._on_first_connection = on_first_connection
        self._cond = threading.Condition()
        self._idle: list[tuple[socket.socket, float]] = []  # (connection, idle since)
        self._open: set[socket.socket] = set()
        self._num_reserved = 0  # open + being connected
        self._ever_connected = False
        self._closed = False

    def acquire(self) -> socket.socket:
        """A connection that completed the handshake; raises ``OSError``/``KVTransferError``."""
        with self._cond:
            while True:
                if self._closed:
                    raise KVTransferError("connections to peer are closed")
                while self._idle:
                    sock, idle_since_s = self._idle.pop()
                    if time.monotonic() - idle_since_s < CLIENT_IDLE_S:
                        return sock
                    self._drop(sock)
                if self._num_reserved < self._max_connections:
                    self._num_reserved += 1
                    break
                self._cond.wait()
        start_s = time.monotonic()
        try:
            sock = socket.create_connection(self._address, timeout=self._connect_timeout_s)
        except BaseException:
            with self._cond:
                self._num_reserved -= 1
                self._cond.notify()
            raise
        with self._cond:
            self._open.add(sock)  # from here on close() can interrupt the handshake
            closed = self._closed
        try:
            if closed:
                raise KVTransferError("connections to peer are closed")
            self._handshake(sock)
        except BaseException:
            self.give_back(sock, reusable=False)
            raise
        with self._cond:
            first = not self._ever_connected
            self._ever_connected = True
        if first:
            self._on_first_connection(time.monotonic() - start_s)
        return sock

    def give_back(self, sock: socket.socket, reusable: bool) -> None:
        """Return ``sock`` to the idle list, or close it when it is not ``reusable``."""
        with self._cond:
            if reusable and not self._closed:
                self._idle.append((sock, time.monotonic()))
            else:
                self._drop(sock)
            self._cond.notify()

    def close(self) -> None:
        """Close idle connections and interrupt busy ones (their users then fail)."""
        with self._cond:
            self._closed = True
            idle = [sock for sock, _ in self._idle]
            busy = self._open.difference(idle)
            for sock in idle:
                self._drop(sock)
            self._idle.clear()
            self._cond.notify_all()
        for sock in busy:
            with contextlib.suppress(OSError):  # already disconnected
                sock.shutdown(socket.SHUT_RDWR)

    def _drop(self, sock: socket.socket) -> None:
        self._open.discard(sock)
        self._num_reserved -= 1
        sock.close()

    def _handshake(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send_frame(sock, self._hello)
        frame = recv_frame(sock, self._connect_timeout_s, self._connect_timeout_s)
        if frame.WhichOneof("body") != "hello_ack":
            raise ProtocolError(f"expected hello_ack, got {frame.WhichOneof('body')}")
        if not frame.hello_ack.ok:
            raise KVTransferError(f"peer rejected our hello: {frame.hello_ack.error}")
        sock.settimeout(self._io_timeout_s)
