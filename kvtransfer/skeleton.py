"""``BackendSkeleton``: everything a KV transfer backend does besides moving bytes.

The skeleton implements the ``KVTransferBackend`` contract once: validating and describing the
registered cache, pairing checks, the source-side table of published blocks (``publish``,
``unpublish``, ``take_unpublished``, ``take_released``), the destination-side table of read
states (``poll``), which source each read came from (``release``), the checks every
``start_read`` makes, and the order of ``close``. A backend subclasses it and supplies its
transport through hooks:

- ``_expose``: start serving the registered cache; return the address (and metadata) for peers;
- ``_check_peer_info``: refuse the info of a peer this transport cannot reach;
- ``_start_transfer``: move the blocks of a checked read and finish it in ``_reads``;
- ``_forward_release``: tell a source that a read of its blocks is over (with the read's grant);
- ``_stop_transport``: stop serving and reading, once, on ``close``;

and optionally ``_check_cache`` (which devices it serves), ``_check_registrable`` (when a cache
may be registered) and ``_forget_peer`` (drop what it held for a peer whose info was replaced).
"""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Sequence

import torch

from engine.kv_cache_spec import KVCacheSpec
from kvtransfer._common import PublishedBlocks, ReadStates, cache_segments, check_block_ids
from kvtransfer.base import (
    KV_TRANSFER_VERSION,
    KVRef,
    KVTransferBackend,
    KVTransferError,
    PeerInfo,
    TransferState,
)

logger = logging.getLogger(__name__)


class BackendSkeleton(KVTransferBackend):
    """The state and bookkeeping shared by every backend; subclasses move the bytes.

    ``io_timeout_s`` bounds how long a read may wait on a silent peer, and how long an
    unpublished request's blocks stay pinned for reads of them still being sent.

    Invariants: once ``_registered``, ``_num_blocks``, ``_block_bytes``, ``_num_segments``,
    ``_segment_bytes`` and ``_compat_hash`` describe the registered cache; ``_read_sources``
    holds exactly the reads started and not yet released (or closed), each with the grant it
    presented; ``_closed`` only ever turns True. ``_lock`` guards ``_peers``,
    ``_closed`` and ``connection_setup_s`` (a subclass may guard more of its own state with
    it); I/O threads take it too, so it is held only briefly, never across network I/O.
    """

    def __init__(self, engine_id: str, io_timeout_s: float) -> None:
        self.engine_id = engine_id
        self.connection_setup_s: dict[str, float] = {}
        self._io_timeout_s = io_timeout_s
        self._registered = False
        self._num_blocks = 0
        self._block_bytes = 0
        self._num_segments = 1
        self._segment_bytes = 0
        self._compat_hash = ""
        self._kv_layout = ""
        self._published = PublishedBlocks()
        self._reads = ReadStates()
        # req_id -> (engine_id, src req_id, grant): where each read came from, for release.
        self._read_sources: dict[str, tuple[str, str, bytes]] = {}
        self._lock = threading.Lock()
        self._peers: dict[str, PeerInfo] = {}
        self._closed = False

    def register_kv_cache(self, kv_cache: torch.Tensor, spec: KVCacheSpec) -> PeerInfo:
        """Validate ``kv_cache`` against ``spec``, record its geometry, start serving it and
        return our ``PeerInfo``. ``ValueError`` for a cache that does not match ``spec`` or
        lives where this backend cannot serve it; ``KVTransferError`` when it may not be
        registered now (see ``_check_registrable``)."""
        self._check_cache(kv_cache)
        self._check_registrable()
        segments = cache_segments(kv_cache, spec)
        self._num_segments, self._num_blocks, self._segment_bytes = segments.shape
        self._block_bytes = spec.block_bytes
        self._compat_hash = spec.compat_hash()
        self._kv_layout = spec.describe()
        address, metadata = self._expose(kv_cache, segments)
        self._registered = True
        return PeerInfo(
            engine_id=self.engine_id,
            backend=self.name,
            address=address,
            compat_hash=self._compat_hash,
            metadata=metadata,
            kv_layout=self._kv_layout,
        )

    def add_peer(self, peer: PeerInfo) -> None:
        """Check that ``peer`` pairs with us and remember it; no connection is opened yet.

        ``KVTransferError`` before registration, or naming both values when the peer's
        backend, version or ``compat_hash`` differ from ours (or ``_check_peer_info`` refuses
        it). Idempotent; new info for a known engine replaces the old one (``_forget_peer``).
        """
        self._require_registered("add_peer")
        if peer.backend != self.name:
            raise KVTransferError(
                f"peer {peer.engine_id!r} uses backend {peer.backend!r}, we use {self.name!r}"
            )
        if peer.version != KV_TRANSFER_VERSION:
            raise KVTransferError(
                f"peer {peer.engine_id!r} speaks kv transfer version {peer.version}, "
                f"we speak {KV_TRANSFER_VERSION}"
            )
        if peer.compat_hash != self._compat_hash:
            raise KVTransferError(
                f"peer {peer.engine_id!r} has KV cache compat_hash {peer.compat_hash!r} "
                f"({peer.kv_layout or 'layout not sent'}), ours is {self._compat_hash!r} "
                f"({self._kv_layout}): the KV cache layouts differ (--kv-cache-dtype, --dtype, "
                "--block-size or the model)"
            )
        self._check_peer_info(peer)
        with self._lock:
            if self._peers.get(peer.engine_id) == peer:
                return
            replaced = peer.engine_id in self._peers
            self._peers[peer.engine_id] = peer
            if replaced:
                self._forget_peer(peer.engine_id)

    # ------------------------------------------------------------------ source side
    def publish(self, req_id: str, block_ids: Sequence[int]) -> bytes:
        """Expose ``block_ids`` under ``req_id`` (replacing an earlier publication of it and its
        grant); return the new grant that reads and releases must present.
        ``KVTransferError`` before registration, ``ValueError`` for ids out of range."""
        self._require_registered("publish")
        check_block_ids(block_ids, self._num_blocks, "published")
        return self._published.publish(req_id, block_ids)

    def unpublish(self, req_id: str) -> None:
        """Stop serving ``req_id`` at once; never blocks. ``take_unpublished`` reports it once
        the reads of it already being sent have ended (at most ``io_timeout_s``)."""
        self._published.unpublish(req_id, wait_s=self._io_timeout_s)

    def take_unpublished(self) -> list[str]:
        """Unpublished ids whose blocks may be reused now (see ``unpublish``)."""
        return self._published.take_unpublished()

    def take_released(self) -> list[str]:
        """Published ids released by a peer since the last call (each serves no more reads;
        ``unpublish`` it to learn when its blocks may be reused)."""
        return self._published.take_released()

    # ------------------------------------------------------------------ destination side
    def start_read(self, req_id: str, src: KVRef, dst_block_ids: Sequence[int]) -> None:
        """Check the read, track it as PENDING and hand it to ``_start_transfer``.

        Raises ``KVTransferError`` when not registered, after close or for a peer never added;
        ``ValueError`` for mismatched lengths, destination ids out of range or a ``req_id``
        still being tracked. Nothing is tracked when it raises.
        """
        with self._lock:
            known_peer = src.engine_id in self._peers
        if not self._registered or self._closed:
            raise KVTransferError("start_read needs a registered, open backend")
        if len(src.block_ids) != len(dst_block_ids):
            raise ValueError(
                f"req_id={req_id}: {len(src.block_ids)} source blocks "
                f"but {len(dst_block_ids)} destination blocks"
            )
        check_block_ids(dst_block_ids, self._num_blocks, "destination")
        if not known_peer:
            raise KVTransferError(f"peer {src.engine_id!r} was not added")
        self._reads.start(req_id)
        self._read_sources[req_id] = (src.engine_id, src.req_id, src.grant)
        self._start_transfer(req_id, src, tuple(dst_block_ids))

    def poll(self) -> dict[str, TransferState]:
        """State of every read not yet reported terminal; DONE / FAILED reported once."""
        return self._reads.poll()

    def release(self, req_id: str) -> None:
        """Forget read ``req_id`` and tell its source (``_forward_release``, best effort, with
        the grant the read presented) that it may free the blocks. Unknown ids, and every id
        after close, are ignored."""
        source = self._read_sources.pop(req_id, None)
        if source is None:
            logger.debug("release of unknown read req_id=%s ignored", req_id)
            return
        if not self._closed:
            self._forward_release(req_id, *source)

    def close(self) -> None:
        """Stop the transport (``_stop_transport``); reads still in flight end FAILED and
        every read is forgotten. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop_transport()
        self._reads.fail_pending()
        self._read_sources.clear()

    def _require_registered(self, what: str) -> None:
        if not self._registered:
            raise KVTransferError(f"register_kv_cache must be called before {what}")

    def _record_setup(self, engine_id: str, seconds: float) -> None:
        """Keep ``seconds`` as ``connection_setup_s[engine_id]`` unless one is already there."""
        with self._lock:
            self.connection_setup_s.setdefault(engine_id, seconds)

    # ------------------------------------------------------------------ transport hooks
    def _check_cache(self, kv_cache: torch.Tensor) -> None:
        """Raise ``ValueError`` when ``kv_cache`` lives where this backend cannot serve it."""

    def _check_registrable(self) -> None:
        """Raise ``KVTransferError`` unless a cache may be registered now: once, before close."""
        if self._registered or self._closed:
            raise KVTransferError("register_kv_cache must be called once, before close")

    @abc.abstractmethod
    def _expose(self, kv_cache: torch.Tensor, segments: torch.Tensor) -> tuple[str, bytes]:
        """Start serving the validated cache (``segments``: its memory as contiguous ``uint8
        [num_segments, num_blocks, segment_bytes]``, see ``cache_segments``); return our address
        and metadata for ``PeerInfo``. Reads from peers may arrive before this returns."""

    @abc.abstractmethod
    def _check_peer_info(self, peer: PeerInfo) -> None:
        """Raise ``KVTransferError`` when this transport cannot reach ``peer`` as described."""

    def _forget_peer(self, engine_id: str) -> None:
        """Drop what the transport holds for ``engine_id``, whose info was just replaced.
        Called with ``_lock`` held."""

    @abc.abstractmethod
    def _start_transfer(self, req_id: str, src: KVRef, dst_block_ids: tuple[int, ...]) -> None:
        """Copy ``src.block_ids`` into ``dst_block_ids`` of a checked read that ``_reads``
        tracks as PENDING, and finish it there (DONE or FAILED). Must not block on a peer."""

    @abc.abstractmethod
    def _forward_release(self, req_id: str, engine_id: str, src_req_id: str, grant: bytes) -> None:
        """Tell source ``engine_id`` that read ``req_id`` of its ``src_req_id`` is over, so it
        may free the blocks; ``grant`` is the one the read presented, without which the source
        ignores the release. Best effort: errors are only logged; must not block on a peer."""

    @abc.abstractmethod
    def _stop_transport(self) -> None:
        """Stop serving and reading; called once by ``close``, after ``_closed`` is set.
        Reads still PENDING when it returns are then FAILED."""
