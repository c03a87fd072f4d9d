"""``inproc``: KV transfer between engines living in the same process (tests, single-process demos).

Backends find each other through a process-global registry keyed by ``engine_id``. A read is a
torch ``index_select`` on the source's cache rows and an ``index_copy_`` into ours, done
synchronously inside ``start_read`` while holding the source's lock, so a concurrent
``unpublish`` on the source never races the copy.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

import torch

from engine.kv_cache_spec import KVCacheSpec
from kvtransfer._common import (
    PublishedBlocks,
    ReadStates,
    cache_rows,
    check_block_ids,
    check_peer,
    check_read_request,
)
from kvtransfer.base import KVRef, KVTransferBackend, KVTransferError, PeerInfo, TransferState

logger = logging.getLogger(__name__)

_registry_lock = threading.Lock()
_registry: dict[str, InprocBackend] = {}


class InprocBackend(KVTransferBackend):
    """A backend whose peers are other ``InprocBackend`` objects of this process.

    ``register_kv_cache`` enters the engine into the process-global registry (an ``engine_id``
    can be registered by one live backend at a time); ``close`` removes it, after which reads
    from it fail. Semantics match ``tcp``: reading an unpublished ``req_id`` or a block not
    published under it ends FAILED; ``release`` unpublishes on the source and shows up in its
    ``take_released``.
    """

    name = "inproc"

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self._lock = threading.Lock()  # guards _rows against a concurrent close
        self._rows: torch.Tensor | None = None
        self._compat_hash = ""
        self._published = PublishedBlocks()
        self._reads = ReadStates()
        self._peers: dict[str, PeerInfo] = {}
        self._read_sources: dict[str, tuple[str, str]] = {}  # req_id -> (engine_id, src req_id)
        self._closed = False

    def register_kv_cache(self, kv_cache: torch.Tensor, spec: KVCacheSpec) -> PeerInfo:
        """Validate and expose ``kv_cache``; registers this engine in the process registry."""
        if self._rows is not None:
            raise KVTransferError(f"engine {self.engine_id!r} already registered a KV cache")
        rows = cache_rows(kv_cache, spec)
        with _registry_lock:
            if self.engine_id in _registry:
                raise KVTransferError(
                    f"engine_id {self.engine_id!r} is already registered in this process"
                )
            _registry[self.engine_id] = self
        self._rows = rows
        self._compat_hash = spec.compat_hash()
        return PeerInfo(
            engine_id=self.engine_id,
            backend=self.name,
            address=f"pid:{os.getpid()}",
            compat_hash=self._compat_hash,
        )

    def add_peer(self, peer: PeerInfo) -> None:
        """Check ``peer`` pairs with us and lives in this process; idempotent."""
        check_peer(self.name, self._compat_hash, peer)
        if peer.address != f"pid:{os.getpid()}":
            raise KVTransferError(
                f"inproc peer {peer.engine_id!r} lives at {peer.address!r}, "
                f"not in this process (pid:{os.getpid()})"
            )
        self._peers[peer.engine_id] = peer

    # ------------------------------------------------------------------ source side
    def publish(self, req_id: str, block_ids: Sequence[int]) -> None:
        """Expose ``block_ids`` under ``req_id`` (replacing an earlier publication of it)."""
        if self._rows is None:
            raise KVTransferError("register_kv_cache must be called before publish")
        check_block_ids(block_ids, self._rows.shape[0], "published")
        self._published.publish(req_id, block_ids)

    def unpublish(self, req_id: str) -> None:
        """Stop serving ``req_id``; unknown ids are ignored."""
        self._published.unpublish(req_id)

    def take_released(self) -> list[str]:
        """Published ids released by a peer since the last call (each already unpublished)."""
        return self._published.take_released()

    def _copy_out(
        self, req_id: str, block_ids: Sequence[int], device: torch.device
    ) -> torch.Tensor:
        """Rows of ``block_ids`` (published under ``req_id``) copied to ``device``.

        Raises ``KVTransferError`` when the read is refused or this backend is closed.
        """
        with self._lock:
            if self._rows is None or self._closed:
                raise KVTransferError(f"engine {self.engine_id!r} is closed")
            error = self._published.check_read(req_id, block_ids)
            if error is not None:
                raise KVTransferError(error)
            index = torch.tensor(block_ids, dtype=torch.long, device=self._rows.device)
            return self._rows.index_select(0, index).to(device)

    def _on_release(self, req_id: str) -> None:
        if not self._published.release(req_id):
            logger.debug("release of unpublished req_id=%s ignored", req_id)

    # ------------------------------------------------------------------ destination side
    def start_read(self, req_id: str, src: KVRef, dst_block_ids: Sequence[int]) -> None:
        """Copy the blocks now; the outcome (DONE or FAILED) is reported by the next ``poll``.

        Raises ``ValueError`` for mismatched lengths, out-of-range destination ids or a
        ``req_id`` still being tracked, ``KVTransferError`` for a peer never added.
        """
        num_blocks = 0 if self._rows is None else self._rows.shape[0]
        check_read_request(
            req_id,
            src,
            dst_block_ids,
            num_blocks,
            usable=self._rows is not None and not self._closed,
            known_peer=src.engine_id in self._peers,
        )
        self._reads.start(req_id)
        self._read_sources[req_id] = (src.engine_id, src.req_id)
        with _registry_lock:
            source = _registry.get(src.engine_id)
        try:
            if source is None:
                raise KVTransferError(f"engine {src.engine_id!r} is not registered (closed?)")
            rows = source._copy_out(src.req_id, src.block_ids, self._rows.device)
            index = torch.tensor(list(dst_block_ids), dtype=torch.long, device=self._rows.device)
            self._rows.index_copy_(0, index, rows)
        except KVTransferError as exc:
            logger.warning("kv read failed req_id=%s from %s: %s", req_id, src.engine_id, exc)
            self._reads.finish(req_id, TransferState.FAILED)
            return
        self._reads.finish(req_id, TransferState.DONE)

    def poll(self) -> dict[str, TransferState]:
        """State of every read not yet reported terminal; DONE / FAILED reported once."""
        return self._reads.poll()

    def release(self, req_id: str) -> None:
        """Unpublish the source's blocks of read ``req_id``; unknown ids and gone sources are
        ignored."""
        source_ids = self._read_sources.pop(req_id, None)
        if source_ids is None:
            logger.debug("release of unknown read req_id=%s ignored", req_id)
            return
        engine_id, src_req_id = source_ids
        with _registry_lock:
            source = _registry.get(engine_id)
        if source is not None:
            source._on_release(src_req_id)

    def close(self) -> None:
        """Leave the registry and stop serving; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with _registry_lock:
            if _registry.get(self.engine_id) is self:
                del _registry[self.engine_id]
        self._reads.fail_pending()
        self._read_sources.clear()
