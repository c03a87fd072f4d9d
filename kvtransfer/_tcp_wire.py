"""Framing and client connections of the ``tcp`` KV transfer backend (private to ``kvtransfer``).

A frame is a 4-byte big-endian length then a serialized ``KVFrame`` of the pull protocol
(``_pull_protocol``); frames over ``MAX_FRAME_BYTES`` or that do not decode raise
``ProtocolError`` and the connection must be closed. Block bytes follow a read's response raw,
one ``contiguous_runs`` region at a time.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence

from kvtransfer._pull_protocol import (
    MAX_FRAME_BYTES,
    ProtocolError,
    check_hello_ack,
    decode_frame,
    split_address,
)
from kvtransfer.base import KVTransferError
from kvtransfer.tls import KVTransferTls
from splitserve.v1 import kv_transfer_pb2 as pb

# A hello is a few hundred bytes: a peer that has not said it yet gets no bigger buffer.
MAX_HELLO_BYTES = 4096
# A pooled connection unused this long is closed rather than reused (the server drops
# connections idle for SERVER_IDLE_TIMEOUT_S; reusing one it dropped would fail a transfer).
CLIENT_IDLE_S = 60.0
SERVER_IDLE_TIMEOUT_S = 2 * CLIENT_IDLE_S
_LENGTH = struct.Struct(">I")


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


def contiguous_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Split ``block_ids`` (in order) into ``(first_id, count)`` runs of consecutive ids.

    ``[4, 5, 6, 9, 2, 3]`` -> ``[(4, 3), (9, 1), (2, 2)]``: each run is one contiguous region.
    """
    runs: list[tuple[int, int]] = []
    for block_id in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block_id, 1))
    return runs


class PeerConnections:
    """Warm connections to one source: created lazily (connect, TLS handshake with ``tls``,
    hello handshake) up to ``max_connections``; ``acquire`` blocks while all of them are busy.

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
        tls: KVTransferTls | None = None,
    ) -> None:
        self._address = split_address(address)
        self._tls = tls
        self._context = None if tls is None else tls.stream_context(server_side=False)
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
            sock = self._connect()
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

    def _connect(self) -> socket.socket:
        """A connected socket, wrapped in TLS (handshake not done yet) with ``tls``."""
        sock = socket.create_connection(self._address, timeout=self._connect_timeout_s)
        if self._context is None:
            return sock
        try:
            return self._context.wrap_socket(sock, do_handshake_on_connect=False)
        except BaseException:
            sock.close()
            raise

    def _drop(self, sock: socket.socket) -> None:
        self._open.discard(sock)
        self._num_reserved -= 1
        sock.close()

    def _handshake(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if isinstance(sock, ssl.SSLSocket) and self._tls is not None:
            sock.do_handshake()
            self._tls.check_peer(sock.getpeercert())  # before the hello, or any grant, is sent
        send_frame(sock, self._hello)
        check_hello_ack(recv_frame(sock, self._connect_timeout_s, self._connect_timeout_s))
        sock.settimeout(self._io_timeout_s)
