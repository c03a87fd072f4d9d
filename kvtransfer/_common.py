"""Bookkeeping shared by the ``inproc`` and ``tcp`` backends (private to ``kvtransfer``).

Both backends keep the same source-side table of published blocks, the same destination-side
table of read states, and the same rules for pairing with a peer and viewing the cache as
``[num_blocks, block_bytes]`` rows of bytes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence

import torch

from engine.kv_cache_spec import KVCacheSpec
from kvtransfer.base import KV_TRANSFER_VERSION, KVRef, KVTransferError, PeerInfo, TransferState

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

logger = logging.getLogger(__name__)


def cache_rows(kv_cache: torch.Tensor, spec: KVCacheSpec) -> torch.Tensor:
    """Validate ``kv_cache`` against ``spec`` and return it as ``uint8 [num_blocks, block_bytes]``.

    The result shares memory with ``kv_cache``: writing a row writes that block.
    """
    if kv_cache.dim() != 1 + len(spec.block_shape) or kv_cache.shape[1:] != spec.block_shape:
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} is not [num_blocks, *{spec.block_shape}]"
        )
    if kv_cache.dtype != _TORCH_DTYPES[spec.dtype]:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} does not match spec dtype {spec.dtype}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous: one block is one contiguous region")
    num_blocks = kv_cache.shape[0]
    return kv_cache.view(torch.uint8).view(num_blocks, spec.block_bytes)


def check_peer(backend: str, compat_hash: str, peer: PeerInfo) -> None:
    """Raise ``KVTransferError`` naming both values when ``peer`` cannot pair with us."""
    if peer.backend != backend:
        raise KVTransferError(
            f"peer {peer.engine_id!r} uses backend {peer.backend!r}, we use {backend!r}"
        )
    if peer.version != KV_TRANSFER_VERSION:
        raise KVTransferError(
            f"peer {peer.engine_id!r} speaks kv transfer version {peer.version}, "
            f"we speak {KV_TRANSFER_VERSION}"
        )
    if peer.compat_hash != compat_hash:
        raise KVTransferError(
            f"peer {peer.engine_id!r} has KV cache compat_hash {peer.compat_hash!r}, "
            f"ours is {compat_hash!r}: the KV cache layouts differ"
        )


def check_block_ids(block_ids: Iterable[int], num_blocks: int, what: str) -> None:
    """Raise ``ValueError`` unless every id is in ``[0, num_blocks)``."""
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"{what} block ids {bad[:8]} out of range [0, {num_blocks})")


def check_read_request(
    req_id: str,
    src: KVRef,
    dst_block_ids: Sequence[int],
    num_blocks: int,
    *,
    usable: bool,
    known_peer: bool,
) -> None:
    """What every ``start_read`` refuses: ``KVTransferError`` when the backend is not
    ``usable`` (unregistered or closed) or the peer is not ``known_peer``; ``ValueError`` for
    mismatched lengths or destination ids out of ``[0, num_blocks)``."""
    if not usable:
        raise KVTransferError("start_read needs a registered, open backend")
    if len(src.block_ids) != len(dst_block_ids):
        raise ValueError(
            f"req_id={req_id}: {len(src.block_ids)} source blocks "
            f"but {len(dst_block_ids)} destination blocks"
        )
    check_block_ids(dst_block_ids, num_blocks, "destination")
    if not known_peer:
        raise KVTransferError(f"peer {src.engine_id!r} was not added")


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


def joint_runs(src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> list[int]:
    """Lengths of the runs over which both id lists advance by one at each step.

    ``[4, 5, 6, 9]`` into ``[0, 1, 7, 8]`` -> ``[2, 1, 1]``: each run is one contiguous region
    on both sides, so it can move as one message straight between the two caches.
    """
    lengths: list[int] = []
    for i in range(len(src_block_ids)):
        if (
            i
            and src_block_ids[i] == src_block_ids[i - 1] + 1
            and dst_block_ids[i] == dst_block_ids[i - 1] + 1
        ):
            lengths[-1] += 1
        else:
            lengths.append(1)
    return lengths


class PublishedBlocks:
    """Source side: which blocks each ``req_id`` exposes, and which ids peers released.

    Thread-safe: the engine thread publishes and unpublishes while I/O threads check reads and
    record releases. A released id is reported by ``take_released`` once and unpublished.
    Reads in progress (``begin_read`` … ``end_read``) hold ``unpublish`` back, so the caller
    never frees (and reuses) blocks whose bytes are still being sent.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._blocks: dict[str, frozenset[int]] = {}
        self._num_readers: dict[str, int] = {}
        self._released: list[str] = []

    def publish(self, req_id: str, block_ids: Sequence[int]) -> None:
        with self._cond:
            self._blocks[req_id] = frozenset(block_ids)

    def unpublish(self, req_id: str, wait_s: float = 0.0) -> None:
        """Stop serving ``req_id``; wait up to ``wait_s`` for its reads in progress to end."""
        with self._cond:
            self._blocks.pop(req_id, None)
            if not self._cond.wait_for(lambda: req_id not in self._num_readers, wait_s):
                logger.warning("req_id=%s unpublished while a read was still sending", req_id)

    def has_blocks(self) -> bool:
        """True while anything is published (a peer may ask to read it)."""
        with self._cond:
            return bool(self._blocks)

    def check_read(self, req_id: str, block_ids: Sequence[int]) -> str | None:
        """Return why reading ``block_ids`` under ``req_id`` is refused, or None if allowed."""
        with self._cond:
            published = self._blocks.get(req_id)
        if published is None:
            return f"req_id={req_id} is not published"
        missing = [b for b in block_ids if b not in published]
        if missing:
            return f"blocks {missing[:8]} were not published under req_id={req_id}"
        return None

    def begin_read(self, req_id: str, block_ids: Sequence[int]) -> str | None:
        """``check_read``, and if allowed count a read in progress until ``end_read``."""
        with self._cond:
            error = self.check_read(req_id, block_ids)
            if error is None:
                self._num_readers[req_id] = self._num_readers.get(req_id, 0) + 1
            return error

    def end_read(self, req_id: str) -> None:
        with self._cond:
            remaining = self._num_readers.pop(req_id) - 1
            if remaining:
                self._num_readers[req_id] = remaining
            else:
                self._cond.notify_all()

    def release(self, req_id: str) -> bool:
        """Unpublish ``req_id`` and queue it for ``take_released``; False if not published."""
        with self._cond:
            if self._blocks.pop(req_id, None) is None:
                return False
            self._released.append(req_id)
            return True

    def take_released(self) -> list[str]:
        with self._cond:
            released, self._released = self._released, []
        return released


class ReadStates:
    """Destination side: the state of every read not yet reported terminal.

    Thread-safe: the engine thread starts and polls reads, I/O threads finish them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[str, TransferState] = {}

    def start(self, req_id: str) -> None:
        """Track a new read as PENDING; ``ValueError`` if ``req_id`` is still being tracked."""
        with self._lock:
            if req_id in self._states:
                raise ValueError(f"a read for req_id={req_id} is already in progress")
            self._states[req_id] = TransferState.PENDING

    def finish(self, req_id: str, state: TransferState) -> None:
        """Set a PENDING read to ``state``; a read already terminal keeps its first state."""
        with self._lock:
            if self._states.get(req_id) is TransferState.PENDING:
                self._states[req_id] = state

    def fail_pending(self) -> None:
        with self._lock:
            for req_id, state in self._states.items():
                if state is TransferState.PENDING:
                    self._states[req_id] = TransferState.FAILED

    def poll(self) -> dict[str, TransferState]:
        """Snapshot of all tracked reads; terminal ones are dropped after being returned."""
        with self._lock:
            snapshot = dict(self._states)
            for req_id, state in snapshot.items():
                if state is not TransferState.PENDING:
                    del self._states[req_id]
        return snapshot
