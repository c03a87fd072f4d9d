"""The contract every KV transfer backend implements.

Two engines pair through ``PeerInfo``: the source (a prefill worker) registers its paged cache
and *publishes* the blocks of a finished prefill under the request's id; the destination (a decode
worker) *reads* some of those blocks into blocks of its own cache, polls until the read is DONE
or FAILED, then *releases* it so the source may free the blocks. Reads are pulls, never pushes,
so a destination only moves blocks it does not already hold.

Each publication comes with a *grant*, a random secret that ``publish`` returns and that travels
to the destination in ``KVRef.grant`` (through the router, never derived from the request id):
the source refuses every read and ignores every release that does not present it, so reaching a
source's KV port and knowing a request id is not enough to read or free its blocks.

Threading: every method is called from one thread (the engine loop); backends do their I/O on
their own threads. ``publish``, ``unpublish``, ``take_unpublished``, ``take_released``,
``start_read``, ``poll`` and ``release`` never block: one slow or hung peer delays nothing but
its own transfer.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine.kv_cache_spec import KVCacheSpec

# Bumped whenever the meaning of PeerInfo or a backend's wire format changes.
KV_TRANSFER_VERSION = 2


class TransferState(enum.Enum):
    """State of one read, as seen by the destination. DONE / FAILED are reported once."""

    PENDING = enum.auto()
    DONE = enum.auto()
    FAILED = enum.auto()


class KVTransferError(RuntimeError):
    """A peer cannot be used (incompatible layout or version, unreachable, unknown)."""


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """What a destination needs to reach a source's KV cache."""

    engine_id: str
    backend: str
    address: str
    compat_hash: str
    version: int = KV_TRANSFER_VERSION
    metadata: bytes = b""
    kv_layout: str = ""  # KVCacheSpec.describe(): names the layout when hashes differ


@dataclass(frozen=True, slots=True)
class KVRef:
    """The KV of ``req_id``'s first ``num_tokens`` tokens, in ``block_ids`` of ``engine_id``.

    ``grant`` is what the source's ``publish`` of ``req_id`` returned: reads and releases that
    do not present it are refused. It is a secret, so it is left out of the ``repr``.
    """

    engine_id: str
    req_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    grant: bytes = field(default=b"", repr=False)


class KVTransferBackend(abc.ABC):
    """One engine's endpoint: serves its published blocks and reads blocks from peers.

    ``connection_setup_s`` maps a peer's ``engine_id`` to how long, in seconds, first reaching
    that peer took: connect and handshake for ``tcp`` / ``ucx``; loading its metadata,
    preparing descriptors and connecting for ``nixl``. It is written once per peer, by the
    backend's I/O threads when that first setup completes (later reconnections leave it as it
    is), and stays empty for ``inproc``, which never connects.
    """

    name: str
    connection_setup_s: dict[str, float]

    @abc.abstractmethod
    def register_kv_cache(self, kv_cache: torch.Tensor, spec: KVCacheSpec) -> PeerInfo:
        """Expose ``kv_cache`` (``[num_blocks, *spec.block_shape]``, contiguous block-major, or
        layer-major when ``spec.layer_major``) for transfers.

        Called once, before anything else; returns the info peers pass to ``add_peer``.
        """

    @abc.abstractmethod
    def add_peer(self, peer: PeerInfo) -> None:
        """Make ``peer`` readable. Raises ``KVTransferError`` naming the mismatch when its
        backend, version or ``compat_hash`` differ from ours. Idempotent."""

    # ------------------------------------------------------------------ source side
    @abc.abstractmethod
    def publish(self, req_id: str, block_ids: Sequence[int]) -> bytes:
        """Allow peers to read ``block_ids`` under ``req_id`` until ``unpublish``; return the
        grant (fresh random bytes) a reader must present in ``KVRef.grant``.

        Reads and releases of ``req_id`` without that grant are refused (a read ends FAILED, a
        release is ignored). Publishing ``req_id`` again replaces its blocks and its grant: the
        old grant reads and releases nothing any more. The caller keeps the blocks pinned
        (unchanged) while they are published.
        """

    @abc.abstractmethod
    def unpublish(self, req_id: str) -> None:
        """Stop serving ``req_id`` at once: reads that arrive later fail. Never blocks: reads
        of it already being sent may go on (up to the backend's io timeout), so the caller keeps
        the blocks pinned until ``take_unpublished`` reports ``req_id``."""

    @abc.abstractmethod
    def take_unpublished(self) -> list[str]:
        """Ids passed to ``unpublish`` whose blocks may be reused now: no read of them is being
        sent any more, or the io timeout gave up on it. Each ``unpublish`` of an id not yet
        reported is reported once (unknown ids at once)."""

    @abc.abstractmethod
    def take_released(self) -> list[str]:
        """Ids of published requests that a peer released since the last call. They serve no
        more reads; the caller ``unpublish``-es them to learn when the blocks may be reused."""

    # ------------------------------------------------------------------ destination side
    @abc.abstractmethod
    def start_read(self, req_id: str, src: KVRef, dst_block_ids: Sequence[int]) -> None:
        """Start copying ``src.block_ids[i]`` of peer ``src.engine_id`` into our block
        ``dst_block_ids[i]`` (equal lengths), presenting ``src.grant``; a source that does not
        recognize it refuses the read (FAILED). The peer must have been added. Never blocks;
        progress is reported by ``poll``. Our destination blocks must stay allocated until then;
        after FAILED their content is undefined (the caller recomputes it).
        """

    @abc.abstractmethod
    def poll(self) -> dict[str, TransferState]:
        """State of every read started and not yet reported terminal; each DONE or FAILED is
        reported exactly once, after which the read is forgotten."""

    @abc.abstractmethod
    def release(self, req_id: str) -> None:
        """Tell the source of a finished read (any terminal state) that it may free the blocks,
        presenting the grant the read presented (a source ignores a release without the grant of
        the current publication). Best effort: a source that went away simply lets its lease
        expire."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop serving and reading; reads in flight end FAILED. Idempotent."""
