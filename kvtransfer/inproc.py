"""``inproc``: KV transfer between engines living in the same process (tests, single-process demos).

Backends find each other through a process-global registry keyed by ``engine_id``. A read is a
torch ``index_select`` on the source's cache rows and an ``index_copy_`` into ours, done
synchronously inside ``start_read`` while holding the source's lock, so a concurrent ``close``
of the source never races the copy. Reads and releases go through the source's published blocks
like any peer's, presenting the grant: same process is no reason to skip the check.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

import torch

from kvtransfer.base import KVRef, KVTransferError, PeerInfo, TransferState
from kvtransfer.skeleton import BackendSkeleton

logger = logging.getLogger(__name__)

_registry_lock = threading.Lock()
_registry: dict[str, InprocBackend] = {}


class InprocBackend(BackendSkeleton):
    """A backend whose peers are other ``InprocBackend`` objects of this process.

    ``register_kv_cache`` enters the engine into the process-global registry (an ``engine_id``
    can be registered by one live backend at a time); ``close`` removes it, after which reads
    from it fail. Semantics match ``tcp``: reading an unpublished ``req_id``, a block not
    published under it or without its grant ends FAILED; ``release`` with the grant unpublishes
    on the source and shows up in its ``take_released``. ``connection_setup_s`` stays empty:
    there is nothing to connect.
    """

    name = "inproc"

    def __init__(self, engine_id: str) -> None:
        # Reads are over when start_read returns: unpublish has nothing to wait for.
        super().__init__(engine_id, io_timeout_s=0.0)
        # [num_segments, num_blocks, segment_bytes]; guarded by _lock against a concurrent close
        self._segments: torch.Tensor | None = None

    def _check_registrable(self) -> None:
        if self._registered:
            raise KVTransferError(f"engine {self.engine_id!r} already registered a KV cache")

    def _expose(self, kv_cache: torch.Tensor, segments: torch.Tensor) -> tuple[str, bytes]:
        """Enter the process registry; ``KVTransferError`` if our ``engine_id`` is taken."""
        with _registry_lock:
            if self.engine_id in _registry:
                raise KVTransferError(
                    f"engine_id {self.engine_id!r} is already registered in this process"
                )
            _registry[self.engine_id] = self
        with self._lock:
            self._segments = segments
        return f"pid:{os.getpid()}", b""

    def _check_peer_info(self, peer: PeerInfo) -> None:
        if peer.address != f"pid:{os.getpid()}":
            raise KVTransferError(
                f"inproc peer {peer.engine_id!r} lives at {peer.address!r}, "
                f"not in this process (pid:{os.getpid()})"
            )

    def _copy_out(
        self, req_id: str, grant: bytes, block_ids: Sequence[int], device: torch.device
    ) -> torch.Tensor:
        """Segments of ``block_ids`` (published under ``req_id`` with ``grant``) copied to
        ``device``, as ``[num_segments, len(block_ids), segment_bytes]``.

        Raises ``KVTransferError`` when the read is refused or this backend is closed.
        """
        with self._lock:
            if self._segments is None or self._closed:
                raise KVTransferError(f"engine {self.engine_id!r} is closed")
            error = self._published.check_read(req_id, grant, block_ids)
            if error is not None:
                raise KVTransferError(error)
            index = torch.tensor(block_ids, dtype=torch.long, device=self._segments.device)
            return self._segments.index_select(1, index).to(device)

    def _start_transfer(self, req_id: str, src: KVRef, dst_block_ids: tuple[int, ...]) -> None:
        """Copy the blocks now; the outcome is reported by the next ``poll``."""
        assert self._segments is not None
        with _registry_lock:
            source = _registry.get(src.engine_id)
        try:
            if source is None:
                raise KVTransferError(f"engine {src.engine_id!r} is not registered (closed?)")
            device = self._segments.device
            segments = source._copy_out(src.req_id, src.grant, src.block_ids, device)
            index = torch.tensor(list(dst_block_ids), dtype=torch.long, device=device)
            self._segments.index_copy_(1, index, segments)
        except KVTransferError as exc:
            logger.warning("kv read failed req_id=%s from %s: %s", req_id, src.engine_id, exc)
            self._reads.finish(req_id, TransferState.FAILED)
            return
        self._reads.finish(req_id, TransferState.DONE)

    def _forward_release(self, req_id: str, engine_id: str, src_req_id: str, grant: bytes) -> None:
        """Release on the source directly (ignored there unless ``grant`` is the current one);
        a source that closed has nothing to free."""
        with _registry_lock:
            source = _registry.get(engine_id)
        if source is not None:
            source._published.release(src_req_id, grant)

    def _stop_transport(self) -> None:
        """Leave the registry, so later reads from us fail."""
        with _registry_lock:
            if _registry.get(self.engine_id) is self:
                del _registry[self.engine_id]
