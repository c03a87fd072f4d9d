"""``tcp``: KV transfer over plain TCP sockets; pure Python, always available, CPU caches only.

Wire format (``proto/splitserve/v1/kv_transfer.proto``): every frame is a 4-byte big-endian
length then a serialized ``KVFrame``. A connection opens with ``hello`` -> ``hello_ack``; then
the destination sends ``read`` and ``release`` frames, one at a time per connection::

    dst                                    src
    read(seq, req_id, block_ids)   ---->
                                   <----   read_response(seq, ok, num_bytes)
                                   <----   num_bytes raw bytes: the blocks in request order
    release(req_id)                ---->   (no answer)

Raw block bytes go straight from the source cache's memory to the socket and from the socket
into the destination blocks (``sendall`` / ``recv_into`` on memoryviews of cache rows; runs
of adjacent blocks move as one region), so a transfer copies nothing in Python.

The listener is hardened against peers that misbehave: at most ``MAX_SERVER_CONNECTIONS`` are
served at once, a connection must say a valid hello (at most ``MAX_HELLO_BYTES``) within the io
timeout before anything bigger is read from it, and one idle for ``SERVER_IDLE_TIMEOUT_S`` is
closed (clients stop reusing pooled connections well before).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from engine.kv_cache_spec import KVCacheSpec
from kvtransfer._common import (
    PublishedBlocks,
    ReadStates,
    cache_rows,
    check_block_ids,
    check_peer,
    check_read_request,
    contiguous_runs,
)
from kvtransfer._tcp_wire import (
    MAX_HELLO_BYTES,
    SERVER_IDLE_TIMEOUT_S,
    PeerConnections,
    ProtocolError,
    check_hello,
    recv_exact_into,
    recv_frame,
    send_frame,
    split_address,
)
from kvtransfer.base import (
    KV_TRANSFER_VERSION,
    KVRef,
    KVTransferBackend,
    KVTransferError,
    PeerInfo,
    TransferState,
)
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


class TcpBackend(KVTransferBackend):
    """KV transfer over TCP between engines with CPU caches.

    Source side: ``register_kv_cache`` starts a listener thread on ``host:port`` (0: ephemeral)
    and one thread per accepted connection serves reads of published blocks. Destination side:
    reads run on a small thread pool over at most ``max_connections_per_peer`` warm
    connections per peer; a dead or silent peer fails a read within ``io_timeout_s`` (per
    socket operation) or ``connect_timeout_s`` (connect + handshake). A read of more than
    ``part_bytes`` is split into parts that stream in parallel, one per connection.

    ``connection_setup_s[engine_id]`` is how long the first connection to that peer took
    (connect + handshake), in seconds. Public methods are called from one engine thread.
    """

    name = "tcp"

    def __init__(
        self,
        engine_id: str,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        io_timeout_s: float = 10.0,
        connect_timeout_s: float = 5.0,
        max_connections_per_peer: int = 2,
        part_bytes: int = 4 << 20,
    ) -> None:
        if max_connections_per_peer < 1:
            raise ValueError("max_connections_per_peer must be at least 1")
        self.engine_id = engine_id
        self.connection_setup_s: dict[str, float] = {}
        self._host = host
        self._port = port
        self._advertise_host = advertise_host
        self._io_timeout_s = io_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._max_connections_per_peer = max_connections_per_peer
        self._part_bytes = part_bytes
        self._kv_cache: torch.Tensor | None = None
        self._flat = memoryview(bytearray())  # the whole cache as bytes, once registered
        self._num_blocks = 0
        self._block_bytes = 0
        self._compat_hash = ""
        self._published = PublishedBlocks()
        self._reads = ReadStates()
        self._read_sources: dict[str, tuple[str, str]] = {}  # req_id -> (engine_id, src req_id)
        self._seq = itertools.count(1)
        self._executor = ThreadPoolExecutor(
            max_workers=max(4, 2 * max_connections_per_peer), thread_name_prefix="kv-tcp-io"
        )
        # Guards everything below, shared with the accept, connection and I/O threads.
        self._lock = threading.Lock()
        self._peers: dict[str, PeerInfo] = {}
        self._pools: dict[str, PeerConnections] = {}
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._server_conns: set[socket.socket] = set()
        self._closed = False

    def register_kv_cache(self, kv_cache: torch.Tensor, spec: KVCacheSpec) -> PeerInfo:
        """Validate the CPU cache, start listening and return our ``PeerInfo``."""
        if kv_cache.device.type != "cpu":
            raise ValueError(f"the tcp backend needs a CPU KV cache, got one on {kv_cache.device}")
        if self._kv_cache is not None or self._closed:
            raise KVTransferError("register_kv_cache must be called once, before close")
        rows = cache_rows(kv_cache, spec)
        self._kv_cache = kv_cache
        self._flat = memoryview(rows.numpy().reshape(-1))
        self._num_blocks, self._block_bytes = rows.shape
        self._compat_hash = spec.compat_hash()
        listener = socket.create_server((self._host, self._port), backlog=128)
        port = listener.getsockname()[1]
        with self._lock:
            self._listener = listener
        self._accept_thread = threading.Thread(
            target=self._accept_loop, args=(listener,), name=f"kv-tcp-accept-{port}", daemon=True
        )
        self._accept_thread.start()
        logger.info("kv tcp engine %s listening on %s:%d", self.engine_id, self._host, port)
        return PeerInfo(
            engine_id=self.engine_id,
            backend=self.name,
            address=f"{self._advertise_host or self._host}:{port}",
            compat_hash=self._compat_hash,
        )

    def add_peer(self, peer: PeerInfo) -> None:
        """Check compatibility and remember ``peer``; no connection is opened yet. Idempotent;
        new info for a known engine replaces the old one and drops its connections."""
        if self._kv_cache is None:
            raise KVTransferError("register_kv_cache must be called before add_peer")
        check_peer(self.name, self._compat_hash, peer)
        split_address(peer.address)
        with self._lock:
            if self._peers.get(peer.engine_id) == peer:
                return
            self._peers[peer.engine_id] = peer
            stale = self._pools.pop(peer.engine_id, None)
        if stale is not None:
            stale.close()

    # ------------------------------------------------------------------ source side
    def publish(self, req_id: str, block_ids: Sequence[int]) -> None:
        """Expose ``block_ids`` under ``req_id`` (replacing an earlier publication of it)."""
        if self._kv_cache is None:
            raise KVTransferError("register_kv_cache must be called before publish")
        check_block_ids(block_ids, self._num_blocks, "published")
        self._published.publish(req_id, block_ids)

    def unpublish(self, req_id: str) -> None:
        """Stop serving ``req_id``; unknown ids are ignored. Blocks until reads of it that are
        already sending finish (at most the io timeout), so the blocks may be reused after."""
        self._published.unpublish(req_id, wait_s=self._io_timeout_s)

    def take_released(self) -> list[str]:
        """Published ids released by a peer since the last call (each already unpublished)."""
        return self._published.take_released()

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
            hello = recv_frame(conn, self._io_timeout_s, self._io_timeout_s, MAX_HELLO_BYTES)
            if not self._accept_hello(conn, hello):
                return
            while True:
                try:
                    frame = recv_frame(conn, self._io_timeout_s, wait_s=SERVER_IDLE_TIMEOUT_S)
                except TimeoutError:
                    logger.debug("kv tcp connection from %s idle: closed", address)
                    return
                kind = frame.WhichOneof("body")
                if kind == "read":
                    self._serve_read(conn, frame.read)
                elif kind == "release":
                    if not self._published.release(frame.release.req_id):
                        logger.debug("release of unpublished req_id=%s", frame.release.req_id)
                else:
                    raise ProtocolError(f"unexpected {kind} frame")
        except ConnectionError as exc:
            logger.debug("kv tcp connection from %s ended: %s", address, exc)
        except (OSError, ProtocolError) as exc:
            if not self._closed:
                logger.warning("kv tcp connection from %s closed: %s", address, exc)
        except Exception:
            logger.exception("kv tcp connection from %s crashed", address)
        finally:
            with self._lock:
                self._server_conns.discard(conn)
            conn.close()

    def _accept_hello(self, conn: socket.socket, frame: pb.KVFrame) -> bool:
        hello, error = check_hello(frame, self._compat_hash)
        send_frame(conn, pb.KVFrame(hello_ack=pb.KVHelloAck(ok=not error, error=error)))
        if error:
            logger.warning("rejected kv peer %r: %s", hello.engine_id, error)
        return not error

    def _serve_read(self, conn: socket.socket, read: pb.KVReadRequest) -> None:
        block_ids = list(read.block_ids)
        error = self._published.begin_read(read.req_id, block_ids)
        num_bytes = 0 if error else len(block_ids) * self._block_bytes
        response = pb.KVReadResponse(
            seq=read.seq, ok=error is None, error=error or "", num_bytes=num_bytes
        )
        if error:
            send_frame(conn, pb.KVFrame(read_response=response))
            logger.info("refused kv read req_id=%s: %s", read.req_id, error)
            return
        try:
            send_frame(conn, pb.KVFrame(read_response=response))
            for first, count in contiguous_runs(block_ids):
                conn.sendall(
                    self._flat[first * self._block_bytes : (first + count) * self._block_bytes]
                )
        finally:
            self._published.end_read(read.req_id)

    # ------------------------------------------------------------------ destination side
    def start_read(self, req_id: str, src: KVRef, dst_block_ids: Sequence[int]) -> None:
        """Queue the read on the I/O pool and return at once; ``poll`` reports the outcome.

        Raises ``ValueError`` for mismatched lengths, out-of-range destination ids or a
        ``req_id`` still being tracked, ``KVTransferError`` for an unknown peer or after close.
        """
        with self._lock:
            known_peer = src.engine_id in self._peers
        check_read_request(
            req_id,
            src,
            dst_block_ids,
            self._num_blocks,
            usable=self._kv_cache is not None and not self._closed,
            known_peer=known_peer,
        )
        self._reads.start(req_id)
        self._read_sources[req_id] = (src.engine_id, src.req_id)
        # A big read goes as parts over parallel connections: one loopback stream is bound by
        # one core's copy. The read ends when its last part does.
        num_bytes = len(dst_block_ids) * self._block_bytes
        num_parts = min(-(-num_bytes // self._part_bytes), self._max_connections_per_peer)
        parts = _ReadParts(max(num_parts, 1))
        step = max(-(-len(dst_block_ids) // parts.num_parts), 1)
        # An empty read still asks the source, which checks the request is published.
        for begin in range(0, max(len(dst_block_ids), 1), step):
            part = replace(src, block_ids=tuple(src.block_ids[begin : begin + step]))
            dst_part = tuple(dst_block_ids[begin : begin + step])
            self._executor.submit(self._do_read, req_id, part, dst_part, next(self._seq), parts)

    def poll(self) -> dict[str, TransferState]:
        """State of every read not yet reported terminal; DONE / FAILED reported once."""
        return self._reads.poll()

    def release(self, req_id: str) -> None:
        """Send ``release`` for read ``req_id`` to its source in the background; errors are
        only logged. Unknown ids are ignored."""
        source = self._read_sources.pop(req_id, None)
        if source is None or self._closed:
            return
        self._executor.submit(self._send_release, req_id, *source)

    def close(self) -> None:
        """Stop the listener, drop every connection, wait for the I/O threads; reads still in
        flight end FAILED. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
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
        self._reads.fail_pending()
        self._read_sources.clear()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=self._io_timeout_s)

    def _connections(self, engine_id: str) -> PeerConnections:
        with self._lock:
            if self._closed:
                raise KVTransferError("backend closed")
            pool = self._pools.get(engine_id)
            if pool is None:
                hello = pb.KVHello(
                    version=KV_TRANSFER_VERSION,
                    compat_hash=self._compat_hash,
                    engine_id=self.engine_id,
                )
                pool = PeerConnections(
                    self._peers[engine_id].address,
                    pb.KVFrame(hello=hello),
                    self._connect_timeout_s,
                    self._io_timeout_s,
                    self._max_connections_per_peer,
                    lambda seconds: self._record_setup(engine_id, seconds),
                )
                self._pools[engine_id] = pool
            return pool

    def _record_setup(self, engine_id: str, seconds: float) -> None:
        with self._lock:
            self.connection_setup_s.setdefault(engine_id, seconds)

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
            request = pb.KVReadRequest(seq=seq, req_id=src.req_id, block_ids=src.block_ids)
            send_frame(sock, pb.KVFrame(read=request))
            frame = recv_frame(sock, self._io_timeout_s, self._io_timeout_s)
            if frame.WhichOneof("body") != "read_response" or frame.read_response.seq != seq:
                got = f"{frame.WhichOneof('body')} seq {frame.read_response.seq}"
                raise ProtocolError(f"expected read_response seq {seq}, got {got}")
            response = frame.read_response
            if not response.ok:
                reusable = True  # a clean refusal leaves the stream in sync
                raise KVTransferError(f"source refused the read: {response.error}")
            expected_bytes = len(dst_block_ids) * self._block_bytes
            if response.num_bytes != expected_bytes:
                raise ProtocolError(f"{response.num_bytes} bytes announced, {expected_bytes} due")
            for first, count in contiguous_runs(dst_block_ids):
                begin = first * self._block_bytes
                recv_exact_into(sock, self._flat[begin : begin + count * self._block_bytes])
            reusable = True
        finally:
            pool.give_back(sock, reusable)

    def _send_release(self, req_id: str, engine_id: str, src_req_id: str) -> None:
        try:
            pool = self._connections(engine_id)
            sock = pool.acquire()
            reusable = False
            try:
                send_frame(sock, pb.KVFrame(release=pb.KVReleaseRequest(req_id=src_req_id)))
                reusable = True
            finally:
                pool.give_back(sock, reusable)
        except (OSError, KVTransferError, ProtocolError) as exc:
            logger.warning("kv release failed req_id=%s to %s: %s", req_id, engine_id, exc)
