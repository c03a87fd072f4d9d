"""``tcp``: KV transfer over plain TCP sockets; pure Python, always available, CPU caches only.

It speaks the pull protocol of ``_pull_protocol`` in the framing of ``_tcp_wire``: every frame
is a 4-byte big-endian length then a serialized ``KVFrame``, and a granted read's blocks follow
its response as raw bytes, in request order. With ``PullEndpoint.tls`` every connection is
mutual TLS 1.3 (``kvtransfer.tls``), blocks included.

Raw block bytes go straight from the source cache's memory to the socket and from the socket
into the destination blocks (``sendall`` / ``recv_into`` on memoryviews of cache rows; runs
of adjacent blocks move as one region, segment by segment for a layer-major cache), so a
transfer copies nothing in Python.

The listener is hardened against peers that misbehave: at most ``MAX_SERVER_CONNECTIONS`` are
served at once, a connection must say a valid hello (at most ``MAX_HELLO_BYTES``) within the io
timeout before anything bigger is read from it, and one idle for ``SERVER_IDLE_TIMEOUT_S`` is
closed (clients stop reusing pooled connections well before).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from kvtransfer._common import segment_rows
from kvtransfer._pull_protocol import (
    LOOPBACK_ENDPOINT,
    ProtocolError,
    PullBackend,
    PullEndpoint,
    check_read_response,
    read_frame,
    release_frame,
)
from kvtransfer._tcp_wire import (
    MAX_HELLO_BYTES,
    SERVER_IDLE_TIMEOUT_S,
    PeerConnections,
    contiguous_runs,
    recv_exact_into,
    recv_frame,
    send_frame,
)
from kvtransfer.base import KVRef, KVTransferError, TransferState
from splitserve.v1 import kv_transfer_pb2 as pb

logger = logging.getLogger(__name__)


# Connections a worker serves at once (each holds a thread); more are refused at accept.
MAX_SERVER_CONNECTIONS = 256


class _ReadParts:
    """The parts of one read still running; the read's state once the last one ends."""

    def __init__(self, num_parts: int) -> None:
        self.num_parts = num_parts
        self._lock = threading.Lock()
        self._left = num_parts
        self._ok = True

    def end(self, ok: bool) -> TransferState | None:
        """Record a part's end; the read's terminal state if it was the last, else None."""
        with self._lock:
            self._left -= 1
            self._ok = self._ok and ok
            if self._left:
                return None
            return TransferState.DONE if self._ok else TransferState.FAILED


class TcpBackend(PullBackend):
    """KV transfer over TCP between engines with CPU caches.

    Source side: ``register_kv_cache`` starts a listener thread on ``host:port`` (0: ephemeral)
    and one thread per accepted connection serves reads of published blocks. Destination side:
    reads run on a small thread pool over at most ``max_connections_per_peer`` warm
    connections per peer; a dead or silent peer fails a read within ``io_timeout_s`` (per
    socket operation) or ``connect_timeout_s`` (connect + handshake). A read of more than
    ``part_bytes`` is split into parts that stream in parallel, one per connection.
    New info for a known peer drops its connections. Public methods are called from one
    engine thread.
    """

    name = "tcp"

    def __init__(
        self,
        engine_id: str,
        endpoint: PullEndpoint = LOOPBACK_ENDPOINT,
        max_connections_per_peer: int = 2,
        part_bytes: int = 4 << 20,
    ) -> None:
        if max_connections_per_peer < 1:
            raise ValueError("max_connections_per_peer must be at least 1")
        super().__init__(engine_id, endpoint)
        self._max_connections_per_peer = max_connections_per_peer
        self._part_bytes = part_bytes
        self._flat = memoryview(bytearray())  # the whole cache as bytes, once registered
        self._executor = ThreadPoolExecutor(
            max_workers=max(4, 2 * max_connections_per_peer), thread_name_prefix="kv-tcp-io"
        )
        self._accept_thread: threading.Thread | None = None
        # Guarded by _lock, shared with the accept, connection and I/O threads.
        self._pools: dict[str, PeerConnections] = {}
        self._listener: socket.socket | None = None
        self._server_conns: set[socket.socket] = set()
        self._server_context: ssl.SSLContext | None = None

    # ------------------------------------------------------------------ source side
    def _listen(self, segments: torch.Tensor) -> int:
        self._flat = segments.numpy().reshape(-1).data
        if self._tls is not None:
            self._server_context = self._tls.stream_context(server_side=True)
        listener = socket.create_server((self._host, self._port), backlog=128)
        port = listener.getsockname()[1]
        with self._lock:
            self._listener = listener
        self._accept_thread = threading.Thread(
            target=self._accept_loop, args=(listener,), name=f"kv-tcp-accept-{port}", daemon=True
        )
        self._accept_thread.start()
        logger.info("kv tcp engine %s listening on %s:%d", self.engine_id, self._host, port)
        return port

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, address = listener.accept()
            except OSError as exc:
                if self._closed:
                    return
                logger.warning("kv tcp accept failed: %s", exc)
                time.sleep(0.1)  # e.g. out of file descriptors: do not spin
                continue
            if self._server_context is not None:
                # The handshake itself runs on the connection's thread, under the io timeout.
                try:
                    conn = self._server_context.wrap_socket(
                        conn, server_side=True, do_handshake_on_connect=False
                    )
                except OSError as exc:
                    logger.warning("kv tcp: dropped a connection from %s: %s", address, exc)
                    conn.close()
                    continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                full = len(self._server_conns) >= MAX_SERVER_CONNECTIONS
                if not full:
                    self._server_conns.add(conn)
            if full:
                logger.warning(
                    "kv tcp: refused a connection from %s (%d open)",
                    address,
                    MAX_SERVER_CONNECTIONS,
                )
                conn.close()
                continue
            threading.Thread(
                target=self._serve_connection,
                args=(conn, address),
                name=f"kv-tcp-conn-{address[1]}",
                daemon=True,
            ).start()

    def _serve_connection(self, conn: socket.socket, address: tuple[str, int]) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if isinstance(conn, ssl.SSLSocket) and self._tls is not None:
                conn.settimeout(self._io_timeout_s)
                conn.do_handshake()
                self._tls.check_peer(conn.getpeercert())
            hello = recv_frame(conn, self._io_timeout_s, self._io_timeout_s, MAX_HELLO_BYTES)
            ack, accepted = self._source.answer_hello(hello)
            send_frame(conn, ack)
            while accepted:
                try:
                    frame = recv_frame(conn, self._io_timeout_s, wait_s=SERVER_IDLE_TIMEOUT_S)
                except TimeoutError:
                    logger.debug("kv tcp connection from %s idle: closed", address)
                    return
                read = self._source.dispatch(frame)
                if read is not None:
                    self._serve_read(conn, read)
        except ConnectionError as exc:
            logger.debug("kv tcp connection from %s ended: %s", address, exc)
        except (OSError, ProtocolError, KVTransferError) as exc:
            if not self._closed:
                logger.warning("kv tcp connection from %s closed: %s", address, exc)
        except Exception:
            logger.exception("kv tcp connection from %s crashed", address)
        finally:
            with self._lock:
                self._server_conns.discard(conn)
            conn.close()

    def _serve_read(self, conn: socket.socket, read: pb.KVReadRequest) -> None:
        with self._source.serving(read) as response:
            send_frame(conn, response)
            if response.read_response.ok:
                for begin, end in self._regions(read.block_ids):
                    conn.sendall(self._flat[begin:end])

    def _regions(self, block_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Byte ranges of ``_flat`` holding ``block_ids``, in the order they travel."""
        rows = segment_rows(block_ids, self._num_segments, self._num_blocks)
        size = self._segment_bytes
        return [(first * size, (first + count) * size) for first, count in contiguous_runs(rows)]

    # ------------------------------------------------------------------ destination side
    def _forget_peer(self, engine_id: str) -> None:
        stale = self._pools.pop(engine_id, None)
        if stale is not None:
            stale.close()

    def _start_transfer(self, req_id: str, src: KVRef, dst_block_ids: tuple[int, ...]) -> None:
        """Queue the read's parts on the I/O pool; the last part to end finishes the read."""
        # A big read goes as parts over parallel connections: one loopback stream is bound by
        # one core's copy.
        num_bytes = len(dst_block_ids) * self._block_bytes
        num_parts = min(-(-num_bytes // self._part_bytes), self._max_connections_per_peer)
        parts = _ReadParts(max(num_parts, 1))
        step = max(-(-len(dst_block_ids) // parts.num_parts), 1)
        # An empty read still asks the source, which checks the request is published.
        for begin in range(0, max(len(dst_block_ids), 1), step):
            part = replace(src, block_ids=tuple(src.block_ids[begin : begin + step]))
            dst_part = dst_block_ids[begin : begin + step]
            self._executor.submit(self._do_read, req_id, part, dst_part, next(self._seq), parts)

    def _forward_release(self, req_id: str, engine_id: str, src_req_id: str, grant: bytes) -> None:
        self._executor.submit(self._send_release, req_id, engine_id, src_req_id, grant)

    def _stop_transport(self) -> None:
        """Stop the listener, drop every connection and wait for the I/O threads."""
        with self._lock:
            listener, self._listener = self._listener, None
            server_conns = list(self._server_conns)
            pools = list(self._pools.values())
            self._pools.clear()
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
            listener.close()
        for conn in server_conns:
            with contextlib.suppress(OSError):  # the peer already hung up
                conn.shutdown(socket.SHUT_RDWR)
        for pool in pools:
            pool.close()
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=self._io_timeout_s)

    def _connections(self, engine_id: str) -> PeerConnections:
        with self._lock:
            if self._closed:
                raise KVTransferError("backend closed")
            pool = self._pools.get(engine_id)
            if pool is None:
                pool = PeerConnections(
                    self._peers[engine_id].address,
                    self._hello(),
                    self._connect_timeout_s,
                    self._io_timeout_s,
                    self._max_connections_per_peer,
                    lambda seconds: self._record_setup(engine_id, seconds),
                    self._tls,
                )
                self._pools[engine_id] = pool
            return pool

    def _do_read(
        self,
        req_id: str,
        src: KVRef,
        dst_block_ids: tuple[int, ...],
        seq: int,
        parts: _ReadParts,
    ) -> None:
        ok = False
        try:
            self._read_blocks(src, dst_block_ids, seq)
            ok = True
        except (OSError, ProtocolError, KVTransferError) as exc:
            logger.warning("kv read failed req_id=%s from %s: %s", req_id, src.engine_id, exc)
        except Exception:
            logger.exception("kv read crashed req_id=%s from %s", req_id, src.engine_id)
        finally:
            state = parts.end(ok)
            if state is not None:
                self._reads.finish(req_id, state)

    def _read_blocks(self, src: KVRef, dst_block_ids: tuple[int, ...], seq: int) -> None:
        pool = self._connections(src.engine_id)
        sock = pool.acquire()
        reusable = False
        try:
            send_frame(sock, read_frame(seq, src))
            frame = recv_frame(sock, self._io_timeout_s, self._io_timeout_s)
            refusal = check_read_response(frame, seq, len(dst_block_ids) * self._block_bytes)
            if refusal is not None:
                reusable = True  # a clean refusal leaves the stream in sync
                raise refusal
            for begin, end in self._regions(dst_block_ids):
                recv_exact_into(sock, self._flat[begin:end])
            reusable = True
        finally:
            pool.give_back(sock, reusable)

    def _send_release(self, req_id: str, engine_id: str, src_req_id: str, grant: bytes) -> None:
        try:
            pool = self._connections(engine_id)
            sock = pool.acquire()
            reusable = False
            try:
                send_frame(sock, release_frame(src_req_id, grant))
                reusable = True
            finally:
                pool.give_back(sock, reusable)
        except (OSError, KVTransferError, ProtocolError) as exc:
            logger.warning("kv release failed req_id=%s to %s: %s", req_id, engine_id, exc)
