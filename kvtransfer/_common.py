"""The bookkeeping tables of ``BackendSkeleton`` (private to ``kvtransfer``).

``PublishedBlocks`` is the source side (what each request exposes under which grant, reads in
progress, releases) and ``ReadStates`` the destination side (the state of each read); both are
shared with the backends' I/O threads. ``cache_segments`` and ``check_block_ids`` validate a
cache and block ids; ``segment_rows`` orders a read's segments.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from engine.kv_cache_spec import KVCacheSpec
from kvtransfer.base import TransferState

# A publication's grant: 128 random bits, beyond guessing.
GRANT_BYTES = 16
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

logger = logging.getLogger(__name__)


def cache_segments(kv_cache: torch.Tensor, spec: KVCacheSpec) -> torch.Tensor:
    """Validate ``kv_cache`` against ``spec``; return its bytes as contiguous ``uint8
    [num_segments, num_blocks, segment_bytes]``: row ``[s, b]`` is segment ``s`` of block ``b``.

    A block-major cache is one segment per block; a layer-major one (``spec.layer_major``) has
    one per layer. The result shares memory with ``kv_cache``: writing a row writes that block.
    A block's bytes travel segment by segment (``spec.num_segments`` regions, each
    ``block_bytes // num_segments`` long), so both sides of a transfer agree on the order.
    """
    if kv_cache.dim() != 1 + len(spec.block_shape) or kv_cache.shape[1:] != spec.block_shape:
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} is not [num_blocks, *{spec.block_shape}]"
        )
    if kv_cache.dtype != (torch.uint8 if spec.quantized else _TORCH_DTYPES[spec.dtype]):
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} does not match spec dtype {spec.dtype}")
    num_blocks = kv_cache.shape[0]
    memory_order = kv_cache.transpose(0, 1) if spec.layer_major else kv_cache
    if not memory_order.is_contiguous():
        order = "layer-major (its transpose(0, 1))" if spec.layer_major else "block-major"
        raise ValueError(f"kv_cache must be contiguous {order}: each segment is one region")
    num_segments = spec.num_segments
    return memory_order.view(torch.uint8).view(
        num_segments, num_blocks, spec.block_bytes // num_segments
    )


def segment_rows(block_ids: Sequence[int], num_segments: int, num_blocks: int) -> list[int]:
    """Row ids, in ``cache_segments(...).view(-1, segment_bytes)``, of ``block_ids``' segments
    in the order they travel: every block's segment 0, then every block's segment 1, ...."""
    return [s * num_blocks + b for s in range(num_segments) for b in block_ids]


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
    ``unpublish`` refuses new reads at once and never waits: an id is reported by
    ``take_unpublished`` once its reads in progress (``begin_read`` … ``end_read``) have ended,
    or their time is up, so the caller never frees (and reuses) blocks whose bytes are still
    being sent, and one hung reader delays the freeing of its own blocks only.

    Invariant: an id is in ``_draining`` only while it has readers in ``_num_readers``, until
    its deadline; it then moves to ``_unpublished`` (reported once).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._publications: dict[str, _Publication] = {}
        self._num_readers: dict[str, int] = {}
        self._released: list[str] = []
        # Unpublished ids whose reads are still sending -> when to stop waiting for them
        # (time.monotonic()); then those whose blocks may be reused, in order.
        self._draining: dict[str, float] = {}
        self._unpublished: list[str] = []

    def publish(self, req_id: str, block_ids: Sequence[int]) -> bytes:
        """Allow reads of ``block_ids`` under ``req_id`` by whoever presents the returned grant,
        replacing what it exposed before (whose grant no longer reads or releases anything)."""
        grant = secrets.token_bytes(GRANT_BYTES)
        with self._lock:
            self._publications[req_id] = _Publication(frozenset(block_ids), grant)
        return grant

    def unpublish(self, req_id: str, wait_s: float = 0.0) -> None:
        """Stop serving ``req_id`` now (later reads are refused); never blocks. Its reads in
        progress may go on for up to ``wait_s``; ``take_unpublished`` reports ``req_id`` once
        they have ended (at once when there are none; unknown ids too)."""
        with self._lock:
            self._publications.pop(req_id, None)
            if req_id in self._draining:
                return
            if req_id in self._num_readers:
                self._draining[req_id] = time.monotonic() + wait_s
            else:
                self._unpublished.append(req_id)

    def take_unpublished(self) -> list[str]:
        """The unpublished ids whose blocks may be reused now, each reported once: their reads
        have ended, or the ``wait_s`` of their ``unpublish`` has passed (logged: the blocks are
        freed under a read that is still sending). Never blocks."""
        now_s = time.monotonic()
        with self._lock:
            overdue = [r for r, deadline_s in self._draining.items() if deadline_s <= now_s]
            for req_id in overdue:
                del self._draining[req_id]
            unpublished, self._unpublished = self._unpublished + overdue, []
        for req_id in overdue:
            logger.warning("req_id=%s unpublished while a read was still sending", req_id)
        return unpublished

    def has_blocks(self) -> bool:
        """True while anything is published (a peer may ask to read it) or still being sent."""
        with self._lock:
            return bool(self._publications or self._num_readers)

    def check_read(self, req_id: str, grant: bytes, block_ids: Sequence[int]) -> str | None:
        """Return why reading ``block_ids`` under ``req_id`` with ``grant`` is refused, or None
        if allowed. A wrong grant gets the same answer as an unpublished ``req_id``."""
        with self._lock:
            return self._check_read(req_id, grant, block_ids)

    def _check_read(self, req_id: str, grant: bytes, block_ids: Sequence[int]) -> str | None:
        """``check_read`` with ``_lock`` held."""
        publication = self._publications.get(req_id)
        if publication is None or not hmac.compare_digest(publication.grant, grant):
            return f"req_id={req_id} is not published under this grant"
        missing = [b for b in block_ids if b not in publication.block_ids]
        if missing:
            return f"blocks {missing[:8]} were not published under req_id={req_id}"
        return None

    def begin_read(self, req_id: str, grant: bytes, block_ids: Sequence[int]) -> str | None:
        """``check_read``, and if allowed count a read in progress until ``end_read``."""
        with self._lock:
            error = self._check_read(req_id, grant, block_ids)
            if error is None:
                self._num_readers[req_id] = self._num_readers.get(req_id, 0) + 1
            return error

    def end_read(self, req_id: str) -> None:
        """End a read counted by ``begin_read``; after the last one an unpublished ``req_id``
        is reported by ``take_unpublished``."""
        with self._lock:
            remaining = self._num_readers.pop(req_id) - 1
            if remaining:
                self._num_readers[req_id] = remaining
            elif self._draining.pop(req_id, None) is not None:
                self._unpublished.append(req_id)

    def release(self, req_id: str, grant: bytes) -> None:
        """Unpublish ``req_id`` and queue it for ``take_released`` when ``grant`` is its grant.

        Ignored otherwise: logged at debug when ``req_id`` is not published (e.g. a second
        release, or one after ``unpublish``), at warning when the grant does not match (a
        stale grant of an earlier publication, or a forged one).
        """
        with self._lock:
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
        with self._lock:
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
