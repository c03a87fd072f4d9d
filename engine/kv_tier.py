"""The second KV tier: a bounded store of evicted KV blocks, on local disk or in host memory.

Blocks the engine's cache evicts are kept here by block hash and come back on a prefix hit
instead of being recomputed (``engine.kv_offload`` moves them between the cache and a tier).
A block's hash already names its tokens, its whole prefix, its cache salt (so its tenant) and
its adapter; what it does not name, the model and the KV layout, is the tier's ``TierIdentity``:
a disk tier keeps each identity's blocks in a directory of their own and every file repeats the
identity, so no block of another model, dtype or layout is ever served.

A disk block is one file, written whole to a temporary name and renamed::

    magic (8) | identity digest (32) | block hash (32) | payload size (8, LE) | sha256 (32)
    | payload

and on every read checked against all five (a truncated, corrupted or misplaced file is deleted
and reported as a miss, so the caller recomputes). Files are written by a thread of the tier's
own, so the engine's step only copies a block into memory; until written, a block is served from
that copy. The directory survives a restart: its index is rebuilt from the files' names and
sizes (least recently written first out). Several workers may share one ``--kv-offload-dir``
(a node's disk): each takes the first slot ``<identity>/<n>`` that no live process holds (a
lock file), so a restarted worker finds a slot full of its model's blocks.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from engine.block_hash import BlockHash

logger = logging.getLogger(__name__)

MAGIC = b"SSKVBLK1"
_HEADER = struct.Struct("<8s32s32sQ32s")
HEADER_BYTES = _HEADER.size
_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
# Samples of each weight file that go into a model's fingerprint: enough that two checkpoints
# of one architecture (or two random initialisations) differ, cheap for a 100 GB model.
_NUM_WEIGHT_SAMPLES = 16
_WEIGHT_SAMPLE_BYTES = 64 * 1024
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
# Most bytes waiting for the writer thread; beyond it an evicted block is dropped, not queued,
# so that a slow disk never stalls the engine's step.
_MAX_PENDING_BYTES = 256 * 2**20
# Workers of one model sharing a tier directory (each takes a slot of its own).
MAX_SLOTS = 64


@dataclass(frozen=True, slots=True)
class TierIdentity:
    """What a block hash does not say about a block's bytes: the model's weights and dtype
    and the KV cache layout. Blocks are served only to an engine whose identity is equal."""

    model_fingerprint: str
    dtype: str
    kv_layout: str

    @property
    def digest(self) -> bytes:
        blob = f"{self.model_fingerprint}\0{self.dtype}\0{self.kv_layout}".encode()
        return hashlib.sha256(blob).digest()

    @property
    def name(self) -> str:
        """The identity's directory name in a disk tier."""
        return self.digest.hex()[:16]


def model_fingerprint(model_path: Path) -> str:
    """A digest of the model at ``model_path`` (a directory or one weights file): its
    ``config.json`` and, of each weights file, its name, size and evenly spaced samples of
    its bytes. Reads at most ~1 MiB per file."""
    files = [model_path] if model_path.is_file() else sorted(model_path.iterdir())
    digest = hashlib.sha256()
    for path in files:
        if path.name == "config.json":
            digest.update(b"config\0" + path.read_bytes())
        elif path.suffix in _WEIGHT_SUFFIXES and path.is_file():
            size = path.stat().st_size
            digest.update(f"{path.name}\0{size}\0".encode())
            with path.open("rb") as f:
                for i in range(_NUM_WEIGHT_SAMPLES):
                    f.seek(max(size - _WEIGHT_SAMPLE_BYTES, 0) * i // (_NUM_WEIGHT_SAMPLES - 1))
                    digest.update(f.read(_WEIGHT_SAMPLE_BYTES))
    return digest.hexdigest()


class KVTier(Protocol):
    """A bounded map from block hash to a block's bytes (all blocks one size), evicting its
    least recently used blocks. Thread-safe."""

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def counters(self) -> TierCounters: ...

    def __contains__(self, block_hash: BlockHash) -> bool: ...

    def put(self, block_hash: BlockHash, payload: bytes) -> bool:
        """Keep ``payload`` (a copy the tier may hold on to) under ``block_hash``; False if it
        was not kept (already there, or no room for it now)."""
        ...

    def get(self, block_hash: BlockHash) -> bytes | None:
        """The block's bytes, checked; None if absent or refused (then it is dropped)."""
        ...

    def hashes(self) -> list[BlockHash]:
        """Every block the tier holds now."""
        ...

    def take_removed(self) -> list[BlockHash]:
        """Blocks the tier dropped (evicted, refused, failed to write) since the last call."""
        ...

    def flush(self) -> None:
        """Return once every block put so far is stored (written, for a disk tier)."""
        ...

    def close(self) -> None:
        """Finish pending writes and release the tier's resources."""
        ...


@dataclass(slots=True)
class TierCounters:
    """What a tier did since it opened (for metrics and tests)."""

    num_stored: int = 0
    num_dropped: int = 0
    num_evicted: int = 0
    num_hits: int = 0
    num_refused: int = 0
    # Dropped blocks not taken yet (``KVTier.take_removed``).
    removed: list[BlockHash] = field(default_factory=list)


@dataclass(slots=True)
class _LruIndex:
    """Block hash -> bytes charged, in recency order (first out first)."""

    capacity_bytes: int
    entries: OrderedDict[BlockHash, int] = field(default_factory=OrderedDict)
    used_bytes: int = 0

    def add(self, block_hash: BlockHash, size: int) -> list[BlockHash]:
        """Record a block; return the blocks evicted to make room (never the new one)."""
        evicted: list[BlockHash] = []
        while self.entries and self.used_bytes + size > self.capacity_bytes:
            old, old_size = self.entries.popitem(last=False)
            self.used_bytes -= old_size
            evicted.append(old)
        self.entries[block_hash] = size
        self.used_bytes += size
        return evicted

    def discard(self, block_hash: BlockHash) -> None:
        size = self.entries.pop(block_hash, None)
        if size is not None:
            self.used_bytes -= size


class _LruTier:
    """What both tiers keep: the LRU index of their blocks (the blocks a tier holds are
    exactly its index's keys), its counters and the lock guarding both."""

    def __init__(self, capacity_bytes: int, block_bytes: int, charged_bytes: int) -> None:
        if capacity_bytes < charged_bytes:
            raise ValueError(f"a {capacity_bytes}-byte KV tier holds no {charged_bytes}-byte block")
        self.block_bytes = block_bytes
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._index = _LruIndex(capacity_bytes)

    @property
    def capacity_bytes(self) -> int:
        return self._index.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    @property
    def num_blocks(self) -> int:
        return len(self._index.entries)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index.entries

    def hashes(self) -> list[BlockHash]:
        with self._lock:
            return list(self._index.entries)

    def take_removed(self) -> list[BlockHash]:
        with self._lock:
            removed, self.counters.removed = self.counters.removed, []
        return removed


class HostKVTier(_LruTier):
    """A tier in host memory: for an engine whose cache is in device memory."""

    def __init__(self, capacity_bytes: int, block_bytes: int) -> None:
        super().__init__(capacity_bytes, block_bytes, block_bytes)
        self._blocks: dict[BlockHash, bytes] = {}

    def put(self, block_hash: BlockHash, payload: bytes) -> bool:
        with self._lock:
            if block_hash in self._blocks:
                return False
            for old in self._index.add(block_hash, len(payload)):
                del self._blocks[old]
                self.counters.num_evicted += 1
                self.counters.removed.append(old)
            self._blocks[block_hash] = payload
            self.counters.num_stored += 1
            return True

    def get(self, block_hash: BlockHash) -> bytes | None:
        with self._lock:
            payload = self._blocks.get(block_hash)
            if payload is not None:
                self._index.entries.move_to_end(block_hash)
                self.counters.num_hits += 1
            return payload

    def flush(self) -> None:
        return None

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._index = _LruIndex(self._index.capacity_bytes)


class TierLockedError(RuntimeError):
    """Every slot of a tier directory is held by another live process."""


class DiskKVTier(_LruTier):
    """A tier of block files under ``root/<identity name>/<slot>/`` (see the module)."""

    def __init__(
        self, root: Path, capacity_bytes: int, block_bytes: int, identity: TierIdentity
    ) -> None:
        super().__init__(capacity_bytes, block_bytes, HEADER_BYTES + block_bytes)
        self.identity = identity
        self.directory, self._lock_file = _take_slot(root / identity.name)
        self._pending: dict[BlockHash, bytes] = {}
        self._pending_bytes = 0
        # Block hashes to write; an Event to set once the ones before it are; None to stop.
        self._writes: queue.SimpleQueue[BlockHash | threading.Event | None] = queue.SimpleQueue()
        self._rebuild_index()
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()

    def put(self, block_hash: BlockHash, payload: bytes) -> bool:
        if len(payload) != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes, got {len(payload)}")
        with self._lock:
            if block_hash in self._index.entries:
                return False
            if self._pending_bytes + len(payload) > _MAX_PENDING_BYTES:
                self.counters.num_dropped += 1
                return False
            for old in self._index.add(block_hash, HEADER_BYTES + len(payload)):
                self._drop_pending(old)
                _remove(self._path(old))
                self.counters.num_evicted += 1
                self.counters.removed.append(old)
            self._pending[block_hash] = payload
            self._pending_bytes += len(payload)
            self.counters.num_stored += 1
        self._writes.put(block_hash)
        return True

    def get(self, block_hash: BlockHash) -> bytes | None:
        with self._lock:
            if block_hash not in self._index.entries:
                return None
            self._index.entries.move_to_end(block_hash)
            payload = self._pending.get(block_hash)
        if payload is None:
            payload = self._read(block_hash)
        with self._lock:
            if payload is None:
                self._index.discard(block_hash)
                self.counters.num_refused += 1
                self.counters.removed.append(block_hash)
            else:
                self.counters.num_hits += 1
        return payload

    def flush(self) -> None:
        if not self._writer.is_alive():  # closed: everything queued was written
            return
        done = threading.Event()
        self._writes.put(done)
        done.wait()

    def close(self) -> None:
        self._writes.put(None)
        self._writer.join()
        self._lock_file.close()

    # ----------------------------------------------------------------------------- files
    def _path(self, block_hash: BlockHash) -> Path:
        name = block_hash.hex()
        return self.directory / name[:2] / (name + _SUFFIX)

    def _read(self, block_hash: BlockHash) -> bytes | None:
        """The checked payload of a block's file; a file that fails a check is deleted."""
        path = self._path(block_hash)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        problem = self._check(data, block_hash)
        if problem is None:
            return data[HEADER_BYTES:]
        logger.warning("KV tier: refusing %s (%s); it will be recomputed", path, problem)
        _remove(path)
        return None

    def _check(self, data: bytes, block_hash: BlockHash) -> str | None:
        if len(data) != HEADER_BYTES + self.block_bytes:
            return f"{len(data)} bytes, expected {HEADER_BYTES + self.block_bytes}"
        magic, identity, stored_hash, size, checksum = _HEADER.unpack_from(data)
        payload = memoryview(data)[HEADER_BYTES:]
        if magic != MAGIC:
            return "not a block file"
        if identity != self.identity.digest:
            return "another model's or layout's block"
        if stored_hash != block_hash or size != self.block_bytes:
            return "another block's file"
        if hashlib.sha256(payload).digest() != checksum:
            return "checksum mismatch"
        return None

    def _write_loop(self) -> None:
        while (block_hash := self._writes.get()) is not None:
            if isinstance(block_hash, threading.Event):
                block_hash.set()
                continue
            with self._lock:
                payload = self._pending.get(block_hash)
            if payload is not None:
                self._write(block_hash, payload)
            with self._lock:
                self._drop_pending(block_hash)

    def _drop_pending(self, block_hash: BlockHash) -> None:
        """Forget a block's in-memory copy (written, or evicted). Hold ``_lock``."""
        payload = self._pending.pop(block_hash, None)
        if payload is not None:
            self._pending_bytes -= len(payload)

    def _write(self, block_hash: BlockHash, payload: bytes) -> None:
        path = self._path(block_hash)
        header = _HEADER.pack(
            MAGIC,
            self.identity.digest,
            block_hash,
            len(payload),
            hashlib.sha256(payload).digest(),
        )
        tmp = path.with_suffix(_TMP_SUFFIX)
        try:
            path.parent.mkdir(exist_ok=True)
            with tmp.open("wb") as f:
                f.write(header)
                f.write(payload)
            with self._lock:
                # Evicted while being written: the file must not outlive its index entry.
                if block_hash in self._index.entries:
                    os.replace(tmp, path)
                    return
            _remove(tmp)
        except OSError as exc:
            logger.warning("KV tier: writing %s failed (%s); the block is dropped", path, exc)
            _remove(tmp)
            with self._lock:
                self._index.discard(block_hash)
                self.counters.removed.append(block_hash)

    def _rebuild_index(self) -> None:
        """Index the files a previous run left, oldest first; delete partial writes and files
        of the wrong size (their contents are checked when read)."""
        found: list[tuple[float, BlockHash]] = []
        for path in self.directory.glob("*/*.*"):
            if path.suffix == _TMP_SUFFIX:
                _remove(path)
                continue
            try:
                block_hash = bytes.fromhex(path.stem)
                stat = path.stat()
            except (ValueError, OSError):
                continue
            if path.suffix != _SUFFIX or len(block_hash) != 32:
                continue
            if stat.st_size != HEADER_BYTES + self.block_bytes:
                _remove(path)
                continue
            found.append((stat.st_mtime, block_hash))
        for _, block_hash in sorted(found):
            for old in self._index.add(block_hash, HEADER_BYTES + self.block_bytes):
                _remove(self._path(old))
        if found:
            logger.info(
                "KV tier %s: %d blocks from an earlier run (%.1f MiB)",
                self.directory,
                len(self._index.entries),
                self._index.used_bytes / 2**20,
            )


def _remove(path: Path) -> None:
    """Delete ``path`` if it exists; a failure (a read-only disk) is logged, never raised: the
    engine's step and the writer thread must go on, and a stale file is refused when read."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        logger.warning("KV tier: cannot delete %s (%s)", path, exc)


def _take_slot(model_dir: Path) -> tuple[Path, IO[bytes]]:
    """The first slot directory under ``model_dir`` no live process holds, and its held lock
    (released when the file closes, or the process ends)."""
    for slot in range(MAX_SLOTS):
        directory = model_dir / str(slot)
        directory.mkdir(parents=True, exist_ok=True)
        lock_file = (directory / ".lock").open("wb")
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.close()
            continue
        return directory, lock_file
    raise TierLockedError(
        f"all {MAX_SLOTS} KV tier slots under {model_dir} are held by live processes: give "
        "these workers another --kv-offload-dir"
    )
