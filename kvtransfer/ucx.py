"""``ucx``: KV transfer over UCX through the ``ucxx`` asyncio API; CPU caches only.

Wire protocol: the ``KVFrame`` control frames of ``tcp`` (``proto/splitserve/v1/kv_transfer.proto``)
as UCX tagged messages on one endpoint pair, which arrive in order. A frame is two messages: its
length (8 bytes, little-endian), then the serialized ``KVFrame``. An endpoint opens with
``hello`` -> ``hello_ack``; then the destination sends ``read`` and ``release`` frames, one at
a time per endpoint::

    dst                                    src
    read(seq, req_id, block_ids)   ---->
                                   <----   read_response(seq, ok, num_bytes)
                                   <----   one message per run (run_lengths: the reader's
                                           runs of ids consecutive on both sides)
    release(req_id)                ---->   (no answer)

Each run moves as one message straight from a numpy view of the source's cache rows into one of
the destination's: no copy on either side.

Threading: ``ucxx`` has one context per process, and completes requests through futures of the
event loop that ran ``ucxx.init``. So all ``UcxBackend`` objects of a process share one asyncio
loop on a daemon thread (``kv-ucx-loop``), started by the first ``register_kv_cache``; every
``ucxx`` call and each backend's endpoint state live on it. UCX progress runs on ``ucxx``'s
progress thread and futures are completed by its notifier thread (``enable_python_future``;
without it each pending receive, e.g. a source waiting for its next frame, spins the loop).
Public methods run on the engine thread and hand work over with ``run_coroutine_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from engine.kv_cache_spec import KVCacheSpec
from kvtransfer._common import (
    PublishedBlocks,
    ReadStates,
    cache_rows,
    check_block_ids,
    check_peer,
    check_read_request,
    joint_runs,
)
from kvtransfer._tcp_wire import ProtocolError, check_hello, split_address
from kvtransfer._ucx_wire import (
    Endpoint,
    Listener,
    UCXError,
    abort,
    recv_frame,
    send_frame,
    ucx_loop,
    ucxx,
    within,
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

_CLOSE_TIMEOUT_S = 0.8


@dataclass
class _PeerLink:
    """The warm endpoint to one source (loop thread only); ``lock`` admits one user at a time."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    endpoint: Endpoint | None = None
    address: str = ""


class UcxBackend(KVTransferBackend):
    """KV transfer over UCX between engines with CPU caches.

    Source side: ``register_kv_cache`` starts a UCX listener on ``port`` (0: ephemeral; UCX
    listens on every interface, peers are told ``advertise_host or host``) and serves each
    endpoint on the shared loop. Destination side: one warm endpoint per peer, connected on the
    first read and reused; the reads and releases for a peer take turns on it. A silent peer
    fails a read within ``io_timeout_s`` (per UCX message) or ``connect_timeout_s`` (connect +
    handshake); a failed read's endpoint is aborted before the read is reported FAILED. A dead
    peer fails reads on a warm endpoint at once, but connecting to one may take the whole
    ``connect_timeout_s``: ucxx 0.52's handshake sometimes misses the refused connection.

    ``connection_setup_s[engine_id]`` is how long the first connection to that peer took
    (connect + handshake), in seconds. Public methods are called from one engine thread.
    """

    name = "ucx"

    def __init__(
        self,
        engine_id: str,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        io_timeout_s: float = 10.0,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.engine_id = engine_id
        self.connection_setup_s: dict[str, float] = {}
        self._host = host
        self._port = port
        self._advertise_host = advertise_host
        self._io_timeout_s = io_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._rows: npt.NDArray[np.uint8] | None = None  # [num_blocks, block_bytes]
        self._num_blocks = 0
        self._block_bytes = 0
        self._compat_hash = ""
        self._published = PublishedBlocks()
        self._reads = ReadStates()
        self._read_sources: dict[str, tuple[str, str]] = {}  # req_id -> (engine_id, src req_id)
        self._seq = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        # Guards _peers, _closed and connection_setup_s, shared with the loop thread.
        self._lock = threading.Lock()
        self._peers: dict[str, PeerInfo] = {}
        self._closed = False
        # Loop thread only.
        self._listener: Listener | None = None
        self._links: dict[str, _PeerLink] = {}
        self._server_endpoints: set[Endpoint] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    def register_kv_cache(self, kv_cache: torch.Tensor, spec: KVCacheSpec) -> PeerInfo:
        """Validate the CPU cache, start the shared loop if needed, listen, return our info."""
        if kv_cache.device.type != "cpu":
            raise ValueError(f"the ucx backend needs a CPU KV cache, got one on {kv_cache.device}")
        if self._rows is not None or self._closed:
            raise KVTransferError("register_kv_cache must be called once, before close")
        rows = cache_rows(kv_cache, spec)
        self._num_blocks, self._block_bytes = rows.shape
        self._compat_hash = spec.compat_hash()
        self._rows = rows.numpy()
        self._loop = ucx_loop()
        port = asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result()
        logger.info("kv ucx engine %s listening on port %d", self.engine_id, port)
        return PeerInfo(
            engine_id=self.engine_id,
            backend=self.name,
            address=f"{self._advertise_host or self._host}:{port}",
            compat_hash=self._compat_hash,
        )

    def add_peer(self, peer: PeerInfo) -> None:
        """Check compatibility and remember ``peer``; no connection is opened yet. Idempotent;
        new info for a known engine replaces the old one (and its endpoint, at the next use)."""
        if self._rows is None:
            raise KVTransferError("register_kv_cache must be called before add_peer")
        check_peer(self.name, self._compat_hash, peer)
        split_address(peer.address)
        with self._lock:
            self._peers[peer.engine_id] = peer

    # ------------------------------------------------------------------ source side
    def publish(self, req_id: str, block_ids: Sequence[int]) -> None:
        """Expose ``block_ids`` under ``req_id`` (replacing an earlier publication of it)."""
        if self._rows is None:
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

    async def _listen(self) -> int:
        self._listener = ucxx.create_listener(
            self._serve, port=self._port, connect_timeout=self._connect_timeout_s
        )
        return int(self._listener.port)

    async def _serve(self, ep: Endpoint) -> None:
        """Listener callback: serve one destination's endpoint until it ends."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._server_endpoints.add(ep)
        try:
            if self._closed:  # the endpoint was being set up while we closed
                return
            hello = await recv_frame(ep, self._io_timeout_s, self._io_timeout_s)
            if not await self._accept_hello(ep, hello):
                return
            while True:
                frame = await recv_frame(ep, None, self._io_timeout_s)
                kind = frame.WhichOneof("body")
                if kind == "read":
                    await self._serve_read(ep, frame.read)
                elif kind == "release":
                    if not self._published.release(frame.release.req_id):
                        logger.debug("release of unpublished req_id=%s", frame.release.req_id)
                else:
                    raise ProtocolError(f"unexpected {kind} frame")
        except UCXError as exc:
            logger.debug("kv ucx connection ended: %r", exc)
        except (ProtocolError, KVTransferError) as exc:
            logger.warning("kv ucx connection closed: %s", exc)
        finally:
            self._server_endpoints.discard(ep)
            abort(ep)
            self._tasks.discard(task)

    async def _accept_hello(self, ep: Endpoint, frame: pb.KVFrame) -> bool:
        hello, error = check_hello(frame, self._compat_hash)
        ack = pb.KVHelloAck(ok=not error, error=error)
        await send_frame(ep, pb.KVFrame(hello_ack=ack), self._io_timeout_s)
        if error:
            logger.warning("rejected kv peer %r: %s", hello.engine_id, error)
        return not error

    async def _serve_read(self, ep: Endpoint, read: pb.KVReadRequest) -> None:
        assert self._rows is not None
        block_ids = list(read.block_ids)
        if sum(read.run_lengths) != len(block_ids) or 0 in read.run_lengths:
            raise ProtocolError(f"run lengths {list(read.run_lengths)[:8]} do not split the read")
        error = self._published.begin_read(read.req_id, block_ids)
        response = pb.KVReadResponse(
            seq=read.seq,
            ok=error is None,
            error=error or "",
            num_bytes=0 if error else len(block_ids) * self._block_bytes,
        )
        try:
            await send_frame(ep, pb.KVFrame(read_response=response), self._io_timeout_s)
            if error:
                logger.info("refused kv read req_id=%s: %s", read.req_id, error)
                return
            views = []
            start = 0
            for count in read.run_lengths:
                first = block_ids[start]
                if block_ids[start : start + count] != list(range(first, first + count)):
                    raise ProtocolError(f"run of {count} blocks from {first} is not consecutive")
                start += count
                views.append(self._rows[first : first + count])
            # All posted at once: UCX keeps their order, and they pipeline on the wire.
            sends = asyncio.gather(*(ep.send(view) for view in views))
            await within(sends, self._io_timeout_s, "sending blocks")
        finally:
            if error is None:
                self._published.end_read(read.req_id)

    # ------------------------------------------------------------------ destination side
    def start_read(self, req_id: str, src: KVRef, dst_block_ids: Sequence[int]) -> None:
        """Queue the read on the loop and return at once; ``poll`` reports the outcome.

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
            usable=self._rows is not None and not self._closed,
            known_peer=known_peer,
        )
        self._reads.start(req_id)
        self._read_sources[req_id] = (src.engine_id, src.req_id)
        self._submit(self._read(req_id, src, tuple(dst_block_ids), next(self._seq)))

    def poll(self) -> dict[str, TransferState]:
        """State of every read not yet reported terminal; DONE / FAILED reported once."""
        return self._reads.poll()

    def release(self, req_id: str) -> None:
        """Send ``release`` for read ``req_id`` to its source in the background; errors are
        only logged. Unknown ids are ignored."""
        source = self._read_sources.pop(req_id, None)
        if source is None or self._closed:
            return
        self._submit(self._send_release(req_id, *source))

    def close(self) -> None:
        """Stop listening, cancel this backend's I/O and abort its endpoints (in under a
        second); reads still in flight end FAILED. Idempotent. The shared loop keeps running."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._loop is not None:
            future = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
            try:
                future.result(timeout=_CLOSE_TIMEOUT_S)
            except TimeoutError:
                logger.warning("kv ucx engine %s: close did not finish in time", self.engine_id)
        self._reads.fail_pending()
        self._read_sources.clear()

    def _submit(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` on the loop as one of this backend's tasks, which ``close`` cancels."""

        async def tracked() -> None:
            task = asyncio.current_task()
            assert task is not None
            self._tasks.add(task)
            try:
                await coro
            finally:
                self._tasks.discard(task)

        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(tracked(), self._loop)

    async def _shutdown(self) -> None:
        if self._listener is not None:
            self._listener.close()
        tasks = set(self._tasks)
        for task in tasks:
            task.cancel()  # each aborts the endpoint it was using
        if tasks:
            await asyncio.wait(tasks, timeout=_CLOSE_TIMEOUT_S / 2)
        for ep in [link.endpoint for link in self._links.values()] + list(self._server_endpoints):
            abort(ep)

    async def _read(
        self, req_id: str, src: KVRef, dst_block_ids: tuple[int, ...], seq: int
    ) -> None:
        state = TransferState.FAILED
        try:
            await self._read_blocks(src, dst_block_ids, seq)
            state = TransferState.DONE
        except asyncio.CancelledError:
            logger.info("kv read cancelled by close req_id=%s", req_id)
            raise
        except (UCXError, ProtocolError, KVTransferError) as exc:
            logger.warning("kv read failed req_id=%s from %s: %r", req_id, src.engine_id, exc)
        except Exception:
            logger.exception("kv read crashed req_id=%s from %s", req_id, src.engine_id)
        finally:
            self._reads.finish(req_id, state)

    async def _read_blocks(self, src: KVRef, dst_block_ids: tuple[int, ...], seq: int) -> None:
        run_lengths = joint_runs(src.block_ids, dst_block_ids)
        request = pb.KVReadRequest(
            seq=seq, req_id=src.req_id, block_ids=src.block_ids, run_lengths=run_lengths
        )
        async with self._endpoint(src.engine_id) as ep:
            await send_frame(ep, pb.KVFrame(read=request), self._io_timeout_s)
            frame = await recv_frame(ep, self._io_timeout_s, self._io_timeout_s)
            if frame.WhichOneof("body") != "read_response" or frame.read_response.seq != seq:
                got = f"{frame.WhichOneof('body')} seq {frame.read_response.seq}"
                raise ProtocolError(f"expected read_response seq {seq}, got {got}")
            response = frame.read_response
            expected_bytes = len(dst_block_ids) * self._block_bytes
            if response.ok and response.num_bytes != expected_bytes:
                raise ProtocolError(f"{response.num_bytes} bytes announced, {expected_bytes} due")
            if response.ok:
                await self._recv_blocks(ep, run_lengths, dst_block_ids)
        if not response.ok:  # raised out here: a clean refusal leaves the endpoint warm
            raise KVTransferError(f"source refused the read: {response.error}")

    async def _recv_blocks(
        self, ep: Endpoint, run_lengths: Sequence[int], dst_block_ids: Sequence[int]
    ) -> None:
        """Receive the source's messages, one per run, each straight into its blocks."""
        assert self._rows is not None
        views = []
        start = 0
        for count in run_lengths:
            first = dst_block_ids[start]
            start += count
            views.append(self._rows[first : first + count])
        # Posted at once, matched in posting order (same endpoint and tag).
        recvs = asyncio.gather(*(ep.recv(view) for view in views))
        await within(recvs, self._io_timeout_s, "receiving blocks")

    async def _send_release(self, req_id: str, engine_id: str, src_req_id: str) -> None:
        frame = pb.KVFrame(release=pb.KVReleaseRequest(req_id=src_req_id))
        try:
            async with self._endpoint(engine_id) as ep:
                await send_frame(ep, frame, self._io_timeout_s)
        except (UCXError, KVTransferError, ProtocolError) as exc:
            logger.warning("kv release failed req_id=%s to %s: %r", req_id, engine_id, exc)

    @contextlib.asynccontextmanager
    async def _endpoint(self, engine_id: str) -> AsyncIterator[Endpoint]:
        """The warm endpoint to ``engine_id``, held exclusively; connects first when there is
        none (or the peer's address changed). An error inside the block aborts and drops it."""
        link = self._links.get(engine_id) or self._links.setdefault(engine_id, _PeerLink())
        async with link.lock:
            with self._lock:
                address = self._peers[engine_id].address
            if link.endpoint is None or link.endpoint.closed or link.address != address:
                abort(link.endpoint)
                link.endpoint = None
                link.endpoint = await self._connect(engine_id, address)
                link.address = address
            try:
                yield link.endpoint
            except BaseException:
                abort(link.endpoint)
                link.endpoint = None
                raise

    async def _connect(self, engine_id: str, address: str) -> Endpoint:
        """A new endpoint to ``address`` that completed the hello handshake."""
        host, port = split_address(address)
        start_s = time.monotonic()
        timeout_s = self._connect_timeout_s
        ep = await within(
            ucxx.create_endpoint(host, port, connect_timeout=timeout_s),
            timeout_s,
            f"connecting to {engine_id!r} at {address}",
        )
        hello = pb.KVHello(
            version=KV_TRANSFER_VERSION, compat_hash=self._compat_hash, engine_id=self.engine_id
        )
        try:
            await send_frame(ep, pb.KVFrame(hello=hello), timeout_s)
            frame = await recv_frame(ep, timeout_s, timeout_s)
            if frame.WhichOneof("body") != "hello_ack":
                raise ProtocolError(f"expected hello_ack, got {frame.WhichOneof('body')}")
            if not frame.hello_ack.ok:
                raise KVTransferError(f"peer rejected our hello: {frame.hello_ack.error}")
        except BaseException:
            abort(ep)
            raise
        with self._lock:
            self.connection_setup_s.setdefault(engine_id, time.monotonic() - start_s)
        return ep
