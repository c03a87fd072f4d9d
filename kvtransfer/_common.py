"""The bookkeeping tables of ``BackendSkeleton`` (private to ``kvtransfer``).

``PublishedBlocks`` is the source side (what each request exposes under which grant, reads in
progress, releases) and ``ReadStates`` the destination side (the state of each read); both are
shared with the backends' I/O threads. ``cache_rows`` and ``check_block_ids`` validate a cache
and block ids.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from engine.kv_cache_spec import KVCacheSpec
from kvtransfer.base import TransferState

# A publication's grant: 128 random bits, beyond guessing.
GRANT_BYTES = 16
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
    if kv_cache.dtype != (torch.uint8 if spec.quantized else _TORCH_DTYPES[spec.dtype]):
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} does not match spec dtype {spec.dtype}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous: one block is one contiguous region")
    num_blocks = kv_cache.shape[0]
    return kv_cache.view(torch.uint8).view(num_blocks, spec.block_bytes)


def check_block_ids(block_ids: Iterable[int], num_blocks: int, what: str) -> None:
    """Raise ``ValueError`` unless every id is in ``[0, num_blocks)``."""
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"{what} block ids {bad[:8]} out of range [0, {num_blocks})")


@dataclass(frozen=True, slots=True)
class _Publication:
    """What one ``req_id`` exposes, and the grant a reader must present to read or release it."""

    block_ids: frozenset[int]
    grant: bytes


class PublishedBlocks:
    """Source side: which blocks each ``req_id`` exposes, and which ids peers released.

    Every publication gets a fresh random grant, returned by ``publish``: a read or a release
    that does not present it is refused exactly as one of an unpublished ``req_id`` (the same
    error), so a peer that can reach us and guesses request ids learns nothing and frees nothing.

    Thread-safe: the engine thread publishes and unpublishes while I/O threads check reads and
    record releases. A released id is reported by ``take_released`` once and unpublished.
    Reads in progress (``begin_read`` … ``end_read``) hold ``unpublish`` back, so the caller
    never frees (and reuses) blocks whose bytes are still being sent.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._publications: dict[str, _Publication] = {}
        self._num_readers: dict[str, int] = {}
        self._released: list[str] = []

    def publish(self, req_id: str, block_ids: Sequence[int]) -> bytes:
        """Allow reads of ``block_ids`` under ``req_id`` by whoever presents the returned grant,
        replacing what it exposed before (whose grant no longer reads or releases anything)."""
        grant = secrets.token_bytes(GRANT_BYTES)
        with self._cond:
            self._publications[req_id] = _Publication(frozenset(block_ids), grant)
        return grant

    def unpublish(self, req_id: str, wait_s: float = 0.0) -> None:
        """Stop serving ``req_id``; wait up to ``wait_s`` for its reads in progress to end."""
        with self._cond:
            self._publications.pop(req_id, None)
            if not self._cond.wait_for(lambda: req_id not in self._num_readers, wait_s):
                logger.warning("req_id=%s unpublished while a read was still sending", req_id)

    def has_blocks(self) -> bool:
        """True while anything is published (a peer may ask to read it)."""
        with self._cond:
            return bool(self._publications)

    def check_read(self, req_id: str, grant: bytes, block_ids: Sequence[int]) -> str | None:
        """Return why reading ``block_ids`` under ``req_id`` with ``grant`` is refused, or None
        if allowed. A wrong grant gets the same answer as an unpublished ``req_id``."""
        with self._cond:
            publication = self._publications.get(req_id)
        if publication is None or not hmac.compare_digest(publication.grant, grant):
            return f"req_id={req_id} is not published under this grant"
        missing = [b for b in block_ids if b not in publication.block_ids]
        if missing:
            return f"blocks {missing[:8]} were not published under req_id={req_id}"
        return None

    def begin_read(self, req_id: str, grant: bytes, block_ids: Sequence[int]) -> str | None:
        """``check_read``, and if allowed count a read in progress until ``end_read``."""
        with self._cond:
            error = self.check_read(req_id, grant, block_ids)
            if error is None:
                self._num_readers[req_id] = self._num_readers.get(req_id, 0) + 1
            return error

    def end_read(self, req_id: str) -> None:
        """End a read counted by ``begin_read``; the last one lets ``unpublish`` return."""
        with self._cond:
            remaining = self._num_readers.pop(req_id) - 1
            if remaining:
                self._num_readers[req_id] = remaining
            else:
                self._cond.notify_all()

    def release(self, req_id: str, grant: bytes) -> None:
        """Unpublish ``req_id`` and queue it for ``take_released`` when ``grant`` is its grant.

        Ignored otherwise: logged at debug when ``req_id`` is not published (e.g. a second
        release, or one after ``unpublish``), at warning when the grant does not match (a
        stale grant of an earlier publication, or a forged one).
        """
        with self._cond:
            publication = self._publications.get(req_id)
            matches = publication is not None and hmac.compare_digest(publication.grant, grant)
            if matches:
                del self._publications[req_id]
                self._released.append(req_id)
        if publication is None:
            logger.debug("release of unpublished req_id=%s ignored", req_id)
        elif not matches:
            logger.warning("release of req_id=%s ignored: it does not present its grant", req_id)

    def take_released(self) -> list[str]:
        """The ids released since the last call, in release order; each is reported once."""
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
        """Set every PENDING read to FAILED (the next ``poll`` reports them)."""
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
