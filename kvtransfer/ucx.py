"""``ucx``: KV transfer over UCX through the ``ucxx`` asyncio API; CPU caches only.

It speaks the pull protocol of ``_pull_protocol`` in the framing of ``_ucx_wire``: each frame is
UCX tagged messages on one endpoint pair, which arrive in order, and a granted read's blocks
follow as one message per run the reader asked for (ids consecutive on both sides), and per
segment of a layer-major cache. Each message moves straight from a numpy view of the source's
cache rows into one of the destination's: no copy on either side. With ``PullEndpoint.tls``
each endpoint opens with a mutual TLS handshake and every frame is sealed (``kvtransfer.tls``);
the blocks still move raw.

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
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvtransfer._pull_protocol import (
    LOOPBACK_ENDPOINT,
    ProtocolError,
    PullBackend,
    PullEndpoint,
    check_hello_ack,
    check_read_response,
    read_frame,
    release_frame,
    split_address,
)
from kvtransfer._ucx_wire import (
    Endpoint,
    FrameChannel,
    Listener,
    UCXError,
    abort,
    joint_runs,
    requested_runs,
    ucx_loop,
    ucxx,
    within,
)
from kvtransfer.base import KVRef, KVTransferError, TransferState
from kvtransfer.tls import MessageTls
from splitserve.v1 import kv_transfer_pb2 as pb

logger = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 0.8


@dataclass
class _PeerLink:
    """The warm channel to one source (loop thread only); ``lock`` admits one user at a time."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    channel: FrameChannel | None = None
    address: str = ""


class UcxBackend(PullBackend):
    """KV transfer over UCX between engines with CPU caches.

    Source side: ``register_kv_cache`` starts a UCX listener on ``port`` (0: ephemeral; UCX
    listens on every interface, peers are told ``advertise_host or host``) and serves each
    endpoint on the shared loop. Destination side: one warm endpoint per peer, connected on the
    first read and reused; the reads and releases for a peer take turns on it. A silent peer
    fails a read within ``io_timeout_s`` (per UCX message) or ``connect_timeout_s`` (connect +
    handshake); a failed read's endpoint is aborted before the read is reported FAILED. A dead
    peer fails reads on a warm endpoint at once, but connecting to one may take the whole
    ``connect_timeout_s``: ucxx 0.52's handshake sometimes misses the refused connection.
    New info for a known peer replaces its endpoint at the next use. Public methods are called
    from one engine thread.
    """

    name = "ucx"

    def __init__(
        self,
        engine_id: str,
        endpoint: PullEndpoint = LOOPBACK_ENDPOINT,
    ) -> None:
        super().__init__(engine_id, endpoint)
        # [num_segments, num_blocks, segment_bytes]
        self._segments: npt.NDArray[np.uint8] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Loop thread only.
        self._listener: Listener | None = None
        self._links: dict[str, _PeerLink] = {}
        self._server_endpoints: set[Endpoint] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------ source side
    def _listen(self, segments: torch.Tensor) -> int:
        """Start the shared loop if needed and listen on it."""
        self._segments = segments.numpy()
        self._loop = ucx_loop()
        port = asyncio.run_coroutine_threadsafe(self._create_listener(), self._loop).result()
        logger.info("kv ucx engine %s listening on port %d", self.engine_id, port)
        return port

    async def _create_listener(self) -> int:
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
            tls = None if self._tls is None else MessageTls(self._tls, server_side=True)
            channel = FrameChannel(ep, tls)
            await channel.handshake(self._io_timeout_s)
            hello = await channel.recv(self._io_timeout_s, self._io_timeout_s)
            ack, accepted = self._source.answer_hello(hello)
            await channel.send(ack, self._io_timeout_s)
            while accepted:
                read = self._source.dispatch(await channel.recv(None, self._io_timeout_s))
                if read is not None:
                    await self._serve_read(channel, read)
        except UCXError as exc:
            logger.debug("kv ucx connection ended: %r", exc)
        except (ProtocolError, KVTransferError) as exc:
            logger.warning("kv ucx connection closed: %s", exc)
        finally:
            self._server_endpoints.discard(ep)
            abort(ep)
            self._tasks.discard(task)

    async def _serve_read(self, channel: FrameChannel, read: pb.KVReadRequest) -> None:
        assert self._segments is not None
        runs = requested_runs(read)
        with self._source.serving(read) as response:
            await channel.send(response, self._io_timeout_s)
            if response.read_response.ok:
                # All posted at once: UCX keeps their order, and they pipeline on the wire.
                views = [
                    segment[first : first + count]
                    for segment in self._segments
                    for first, count in runs
                ]
                sends = asyncio.gather(*(channel.ep.send(view) for view in views))
                await within(sends, self._io_timeout_s, "sending blocks")

    # ------------------------------------------------------------------ destination side
    def _start_transfer(self, req_id: str, src: KVRef, dst_block_ids: tuple[int, ...]) -> None:
        """Queue the read on the loop; it finishes the read."""
        self._submit(self._read(req_id, src, dst_block_ids, next(self._seq)))

    def _forward_release(self, req_id: str, engine_id: str, src_req_id: str, grant: bytes) -> None:
        self._submit(self._send_release(req_id, engine_id, src_req_id, grant))

    def _stop_transport(self) -> None:
        """Stop listening, cancel this backend's I/O and abort its endpoints, in under a
        second. The shared loop keeps running."""
        if self._loop is None:
            return
        future = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        try:
            future.result(timeout=_CLOSE_TIMEOUT_S)
        except TimeoutError:
            logger.warning("kv ucx engine %s: close did not finish in time", self.engine_id)

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
        links = [link.channel.ep for link in self._links.values() if link.channel is not None]
        for ep in links + list(self._server_endpoints):
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
        async with self._channel(src.engine_id) as channel:
            await channel.send(read_frame(seq, src, run_lengths), self._io_timeout_s)
            frame = await channel.recv(self._io_timeout_s, self._io_timeout_s)
            refusal = check_read_response(frame, seq, len(dst_block_ids) * self._block_bytes)
            if refusal is None:
                await self._recv_blocks(channel.ep, run_lengths, dst_block_ids)
        if refusal is not None:  # raised out here: a clean refusal leaves the endpoint warm
            raise refusal

    async def _recv_blocks(
        self, ep: Endpoint, run_lengths: Sequence[int], dst_block_ids: Sequence[int]
    ) -> None:
        """Receive the source's messages, one per run and segment, each straight into its
        blocks."""
        assert self._segments is not None
        firsts = []
        start = 0
        for count in run_lengths:
            firsts.append(dst_block_ids[start])
            start += count
        views = [
            segment[first : first + count]
            for segment in self._segments
            for first, count in zip(firsts, run_lengths, strict=True)
        ]
        # Posted at once, matched in posting order (same endpoint and tag).
        recvs = asyncio.gather(*(ep.recv(view) for view in views))
        await within(recvs, self._io_timeout_s, "receiving blocks")

    async def _send_release(
        self, req_id: str, engine_id: str, src_req_id: str, grant: bytes
    ) -> None:
        try:
            async with self._channel(engine_id) as channel:
                await channel.send(release_frame(src_req_id, grant), self._io_timeout_s)
        except (UCXError, KVTransferError, ProtocolError) as exc:
            logger.warning("kv release failed req_id=%s to %s: %r", req_id, engine_id, exc)

    @contextlib.asynccontextmanager
    async def _channel(self, engine_id: str) -> AsyncIterator[FrameChannel]:
        """The warm channel to ``engine_id``, held exclusively; connects first when there is
        none (or the peer's address changed). An error inside the block aborts and drops it."""
        link = self._links.get(engine_id) or self._links.setdefault(engine_id, _PeerLink())
        async with link.lock:
            with self._lock:
                address = self._peers[engine_id].address
            channel = link.channel
            if channel is None or channel.ep.closed or link.address != address:
                if channel is not None:
                    abort(channel.ep)
                link.channel = None
                channel = link.channel = await self._connect(engine_id, address)
                link.address = address
            try:
                yield channel
            except BaseException:
                abort(channel.ep)
                link.channel = None
                raise

    async def _connect(self, engine_id: str, address: str) -> FrameChannel:
        """A new channel to ``address`` that completed the TLS (if any) and hello handshakes."""
        host, port = split_address(address)
        start_s = time.monotonic()
        timeout_s = self._connect_timeout_s
        ep = await within(
            ucxx.create_endpoint(host, port, connect_timeout=timeout_s),
            timeout_s,
            f"connecting to {engine_id!r} at {address}",
        )
        tls = None if self._tls is None else MessageTls(self._tls, server_side=False)
        channel = FrameChannel(ep, tls)
        try:
            await channel.handshake(timeout_s)
            await channel.send(self._hello(), timeout_s)
            check_hello_ack(await channel.recv(timeout_s, timeout_s))
        except BaseException:
            abort(ep)
            raise
        self._record_setup(engine_id, time.monotonic() - start_s)
        return channel
