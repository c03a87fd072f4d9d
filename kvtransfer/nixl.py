"""``nixl``: KV transfer with NVIDIA NIXL over UCX: one-sided READs straight between the caches.

The engine's whole paged cache is registered with a NIXL agent once (host memory on CPU, VRAM
on CUDA). ``PeerInfo.metadata`` carries a ``NixlPeerMetadata``: the agent's metadata (its UCX
connection info and memory keys) and where block 0 lives, so a reader can describe every
remote block itself. Pairing is lazy: the first read from a peer loads its metadata, prepares a
descriptor list with one entry per remote block (per block and layer for a layer-major cache)
and connects; the pair stays warm.

Every read is granted by the source, so a source never frees blocks under a READ. The READ is
posted with ``read_begin`` rather than after the grant, so the transfer overlaps the round
trip; it counts as DONE only once granted (see ``_Read``)::

    reader                                              source
    read_begin(seq, req_id, grant, block_ids)   ---->   PublishedBlocks.begin_read
    READ of the blocks (UCX get; NIXL merges adjacent descriptors into one region)
                                                <----   read_grant(seq, ok | error)
    read_end(seq, req_id)                       ---->   PublishedBlocks.end_read
    ...
    release(req_id, grant)                      ---->   the lease may end

All four are NIXL notifications carrying a serialized ``NixlNotif``. Every NIXL call runs on
one I/O thread per backend, which also drives UCX's progress (NIXL's own progress thread would
spin a core); the copy of a READ runs on it, outside the GIL. A read is FAILED when the
source refuses it, when NIXL reports an error (a dead peer is seen as a disconnect), or when it
is not over within ``io_timeout_s``.

The ``grant`` of ``read_begin`` and ``release`` is the publication's secret (``KVRef.grant``,
not the source's ``read_grant`` answer): without it the source refuses the read and ignores the
release, so it gates the source's record of the read and the lease. It cannot gate the bytes:
the READ is one-sided RDMA, which any agent holding the source's NIXL metadata could issue, so
a refused read may still have filled the reader's blocks (undefined after FAILED anyway).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtransfer._common import segment_rows
from kvtransfer._nixl_source import NixlSource, notif_bytes, remove_agent, send_notif
from kvtransfer.base import KVRef, KVTransferError, PeerInfo, TransferState
from kvtransfer.skeleton import BackendSkeleton
from splitserve.v1 import kv_transfer_pb2 as pb

logger = logging.getLogger(__name__)

# NIXL logs every agent's creation at INFO on stdout, into the output of CLIs such as
# `splitserve up`; keep it to warnings unless the operator asks for more.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

_MEM_TYPES = {"cpu": "DRAM", "cuda": "VRAM"}
# How often the I/O thread polls NIXL while a read waits on it, and while it only serves.
_BUSY_POLL_S = 0.0005
_IDLE_POLL_S = 0.005


@dataclass(slots=True)
class _Remote:
    """A peer paired on the I/O thread: its agent name and prepared block descriptors."""

    agent_name: str
    blocks: Any  # nixl_prepped_dlist_handle, one descriptor per remote block segment
    num_blocks: int


@dataclass(slots=True)
class _Read:
    """A read owned by the I/O thread, from ``read_begin`` until its state is terminal.

    The READ is posted together with ``read_begin``; the read is DONE once the READ finished
    *and* the source granted it. A grant proves the blocks stayed published from before the READ
    started (the reader learnt of them only after they were published, and a publication only
    ends) until ``read_end``; a refusal turns even a finished READ into FAILED.
    """

    req_id: str
    src: KVRef
    dst_block_ids: tuple[int, ...]
    deadline_s: float
    remote: _Remote | None = None
    handle: Any = None  # nixl_xfer_handle while the READ is in flight
    read_done: bool = False
    granted: bool | None = None  # None until the source answers
    refusal: str = ""


class NixlBackend(BackendSkeleton):
    """KV transfer through a NIXL agent (UCX backend), CPU or CUDA caches.

    Public methods are called from one engine thread and never block on the network; an
    unpublished request is reported by ``take_unpublished`` once its granted reads have ended
    (at most ``io_timeout_s``). ``close`` drops the agent: afterwards ``publish`` and
    ``add_peer`` refuse as before registration.
    """

    name = "nixl"

    def __init__(self, engine_id: str, io_timeout_s: float = 10.0) -> None:
        super().__init__(engine_id, io_timeout_s)
        # Unique per incarnation: a restarted worker must not reuse its predecessor's name.
        self._agent_name = f"{engine_id}-{uuid.uuid4().hex[:8]}"
        self._agent: Any = None
        self._kv_cache: torch.Tensor | None = None
        self._connection_metadata = b""
        self._local_blocks: Any = None
        self._seq = itertools.count(1)
        # Not a SimpleQueue: in CPython 3.11 its get(timeout=...), interrupted by a signal past
        # its deadline, waits forever, and the loop's READs with it (test_backends.py).
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._io_thread: threading.Thread | None = None
        # Owned by the I/O thread.
        self._remotes: dict[str, _Remote] = {}
        self._pending: dict[int, _Read] = {}  # seq -> read, granted or awaiting the grant
        self._source: NixlSource  # created with the agent, in _expose

    def _check_cache(self, kv_cache: torch.Tensor) -> None:
        if kv_cache.device.type not in _MEM_TYPES:
            raise ValueError(f"the nixl backend needs a CPU or CUDA cache, got {kv_cache.device}")

    def _expose(self, kv_cache: torch.Tensor, segments: torch.Tensor) -> tuple[str, bytes]:
        """Register the cache's memory (``segments``) with a new NIXL agent and start the I/O
        thread; our address is the agent's name, our metadata a ``NixlPeerMetadata``."""
        self._kv_cache = segments  # registered memory must outlive the agent's use of it
        from nixl._api import nixl_agent, nixl_agent_config, nixlBind

        mem_type = _MEM_TYPES[kv_cache.device.type]
        device_id = max(kv_cache.get_device(), 0)
        # No NIXL progress thread: it spins a whole core per process. The I/O thread drives UCX
        # instead (every NIXL call progresses it), polling fast only while there is work.
        config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self._agent = nixl_agent(self._agent_name, config)
        self._agent.register_memory(segments)
        no_memory = nixlBind.nixlRegDList(self._agent.nixl_mems[mem_type])
        self._connection_metadata = self._agent.get_partial_agent_metadata(
            no_memory, inc_conn_info=True
        )
        base_addr = segments.data_ptr()
        self._local_blocks = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self._segment_descs(base_addr, self._num_blocks, device_id), mem_type
        )
        metadata = pb.NixlPeerMetadata(
            agent_metadata=self._agent.get_agent_metadata(),
            agent_name=self._agent_name,
            base_addr=base_addr,
            num_blocks=self._num_blocks,
            block_bytes=self._block_bytes,
            device_id=device_id,
            mem_type=mem_type,
        )
        self._source = NixlSource(self._agent, self._published, self._io_timeout_s)
        self._io_thread = threading.Thread(
            target=self._io_loop, name=f"kv-nixl-{self.engine_id}", daemon=True
        )
        self._io_thread.start()
        logger.info(
            "kv nixl engine %s registered %d blocks (%s)",
            self.engine_id,
            self._num_blocks,
            mem_type,
        )
        return self._agent_name, metadata.SerializeToString()

    def _check_peer_info(self, peer: PeerInfo) -> None:
        metadata = pb.NixlPeerMetadata.FromString(peer.metadata)
        if not metadata.agent_metadata or metadata.mem_type not in _MEM_TYPES.values():
            raise KVTransferError(f"peer {peer.engine_id!r} sent no usable NIXL metadata")

    def _forget_peer(self, engine_id: str) -> None:
        self._commands.put(lambda: self._forget_remote(engine_id))

    def _start_transfer(self, req_id: str, src: KVRef, dst_block_ids: tuple[int, ...]) -> None:
        """Queue the read for the I/O thread, which finishes it."""
        read = _Read(req_id, src, dst_block_ids, time.monotonic() + self._io_timeout_s)
        self._commands.put(lambda: self._begin_read(next(self._seq), read))

    def _forward_release(self, req_id: str, engine_id: str, src_req_id: str, grant: bytes) -> None:
        release = pb.KVReleaseRequest(req_id=src_req_id, grant=grant)
        self._commands.put(lambda: self._notify_engine(engine_id, notif_bytes(release=release)))

    def _stop_transport(self) -> None:
        """Stop the I/O thread (it fails the reads it owns) and drop the agent."""
        if self._io_thread is not None:
            self._io_thread.join(timeout=self._io_timeout_s)
        self._agent = None
        self._registered = False  # the registration went with the agent

    # ------------------------------------------------------------------ I/O thread
    def _io_loop(self) -> None:
        try:
            while not self._closed:
                busy = bool(self._pending) or self._published.has_blocks()
                try:
                    command = self._commands.get(timeout=_BUSY_POLL_S if busy else _IDLE_POLL_S)
                except queue.Empty:
                    pass
                else:
                    self._run(command)
                    while not self._commands.empty() and not self._closed:
                        self._run(self._commands.get_nowait())
                self._run(self._handle_notifs)
                self._run(self._check_reads)
                self._source.expire_grants()
        finally:
            self._shutdown()

    def _run(self, step: Callable[[], None]) -> None:
        # One bad call (NIXL raises its own exception types) must not stop every later read.
        try:
            step()
        except Exception:
            logger.exception("kv nixl I/O step of %s failed", self.engine_id)

    def _shutdown(self) -> None:
        for read in self._pending.values():
            self._drop_handle(read)
        self._pending.clear()
        self._reads.fail_pending()
        for engine_id in list(self._remotes):
            self._forget_remote(engine_id)

    def _segment_descs(self, base_addr: int, num_blocks: int, device_id: int) -> np.ndarray:
        """Descriptors of a cache of ``num_blocks`` blocks shaped like ours: one per segment of
        each block, row ``s * num_blocks + b`` (see ``cache_segments``)."""
        return _row_descs(
            base_addr, self._num_segments * num_blocks, self._segment_bytes, device_id
        )

    def _descs_of(self, block_ids: Sequence[int], num_blocks: int) -> np.ndarray:
        """Indices into ``_segment_descs(..., num_blocks, ...)`` of ``block_ids``' segments."""
        rows = segment_rows(block_ids, self._num_segments, num_blocks)
        return np.asarray(rows, dtype=np.int32)

    def _remote(self, engine_id: str) -> _Remote:
        remote = self._remotes.get(engine_id)
        if remote is not None:
            return remote
        with self._lock:
            peer = self._peers[engine_id]
        metadata = pb.NixlPeerMetadata.FromString(peer.metadata)
        start_s = time.perf_counter()
        agent_name = self._agent.add_remote_agent(metadata.agent_metadata)
        agent_name = agent_name.decode() if isinstance(agent_name, bytes) else agent_name
        # The peer's compat_hash equals ours, so its blocks have our segments.
        blocks = self._agent.prep_xfer_dlist(
            agent_name,
            self._segment_descs(metadata.base_addr, metadata.num_blocks, metadata.device_id),
            metadata.mem_type,
        )
        self._agent.make_connection(agent_name)
        setup_s = time.perf_counter() - start_s
        self._record_setup(engine_id, setup_s)
        logger.info("kv nixl paired with %s in %.1f ms", engine_id, setup_s * 1e3)
        remote = _Remote(agent_name, blocks, metadata.num_blocks)
        self._remotes[engine_id] = remote
        return remote

    def _forget_remote(self, engine_id: str) -> None:
        remote = self._remotes.pop(engine_id, None)
        if remote is None:
            return
        try:
            self._agent.release_dlist_handle(remote.blocks)
        except Exception as exc:  # nixl raises its own exception types
            logger.debug("dropping kv peer %s: %s", engine_id, exc)
        remove_agent(self._agent, remote.agent_name)

    def _begin_read(self, seq: int, read: _Read) -> None:
        begin = pb.KVReadRequest(
            seq=seq, req_id=read.src.req_id, block_ids=read.src.block_ids, grant=read.src.grant
        )
        try:
            read.remote = self._remote(read.src.engine_id)
            message = notif_bytes(read_begin=begin, reader_metadata=self._connection_metadata)
            self._agent.send_notif(read.remote.agent_name, message)
        except Exception as exc:
            self._fail(read, f"cannot reach the source: {exc}")
            self._forget_remote(read.src.engine_id)
            return
        self._pending[seq] = read
        if not read.dst_block_ids:  # NIXL refuses an empty READ; the grant alone ends this one
            read.read_done = True
            return
        # Posted without waiting for the grant: the transfer overlaps the round trip.
        try:
            read.handle = self._agent.make_prepped_xfer(
                "READ",
                self._local_blocks,
                self._descs_of(read.dst_block_ids, self._num_blocks),
                read.remote.blocks,
                self._descs_of(read.src.block_ids, read.remote.num_blocks),
            )
            self._agent.transfer(read.handle)
        except Exception as exc:
            self._end(seq, read, TransferState.FAILED, f"READ could not start: {exc}")

    def _on_grant(self, agent_name: str, grant: pb.KVReadResponse) -> None:
        read = self._pending.get(grant.seq)
        if read is None or read.remote is None or read.remote.agent_name != agent_name:
            if grant.ok:  # granted after we gave up: end it so the source does not wait
                end = pb.KVReadEnd(seq=grant.seq)
                send_notif(self._agent, agent_name, notif_bytes(read_end=end))
            return
        read.granted = grant.ok
        read.refusal = grant.error
        self._settle(grant.seq, read)

    def _check_reads(self) -> None:
        now_s = time.monotonic()
        for seq, read in list(self._pending.items()):
            if read.handle is not None:
                try:
                    state = self._agent.check_xfer_state(read.handle)
                except Exception as exc:  # e.g. nixlRemoteDisconnectError: the peer died
                    state, error = "ERR", str(exc)
                else:
                    error = "NIXL reported an error"
                if state == "ERR":
                    self._end(seq, read, TransferState.FAILED, error)
                    self._forget_remote(read.src.engine_id)
                    continue
                if state == "DONE":
                    self._drop_handle(read)
                    read.read_done = True
                    self._settle(seq, read)
                    continue
            if now_s > read.deadline_s:
                phase = "grant" if read.granted is None else "READ"
                self._end(seq, read, TransferState.FAILED, f"{phase} timed out")
                self._forget_remote(read.src.engine_id)

    def _settle(self, seq: int, read: _Read) -> None:
        """End the read once both the READ and the source's answer are in."""
        if read.granted is None or read.handle is not None:
            return
        if not read.granted:
            self._end(seq, read, TransferState.FAILED, f"source refused: {read.refusal}")
        elif read.read_done:
            self._end(seq, read, TransferState.DONE)

    def _end(self, seq: int, read: _Read, state: TransferState, error: str = "") -> None:
        """Forget the read (cancelling a READ still in flight), tell a source that granted it
        that it is over, and report ``state``."""
        self._pending.pop(seq, None)
        self._drop_handle(read)
        if read.granted and read.remote is not None:
            end = pb.KVReadEnd(seq=seq, req_id=read.src.req_id)
            send_notif(self._agent, read.remote.agent_name, notif_bytes(read_end=end))
        if state is TransferState.DONE:
            self._reads.finish(read.req_id, state)
        else:
            self._fail(read, error)

    def _fail(self, read: _Read, error: str) -> None:
        logger.warning(
            "kv read failed req_id=%s from %s: %s", read.req_id, read.src.engine_id, error
        )
        self._reads.finish(read.req_id, TransferState.FAILED)

    def _drop_handle(self, read: _Read) -> None:
        if read.handle is None:
            return
        try:
            self._agent.release_xfer_handle(read.handle)
        except Exception as exc:  # an active READ NIXL could not cancel
            logger.error("req_id=%s: could not release a NIXL transfer: %s", read.req_id, exc)
        read.handle = None

    # ------------------------------------------------------------------ notifications
    def _handle_notifs(self) -> None:
        for agent_name, messages in self._agent.get_new_notifs().items():
            agent_name = agent_name.decode() if isinstance(agent_name, bytes) else agent_name
            for message in messages:
                try:
                    notif = pb.NixlNotif.FromString(message)
                except Exception:
                    logger.warning("undecodable nixl notification from %s", agent_name)
                    continue
                self._on_notif(agent_name, notif)

    def _on_notif(self, agent_name: str, notif: pb.NixlNotif) -> None:
        if notif.WhichOneof("body") == "read_grant":
            self._on_grant(agent_name, notif.read_grant)
        else:
            self._source.on_notif(agent_name, notif)

    def _notify_engine(self, engine_id: str, message: bytes) -> None:
        remote = self._remotes.get(engine_id)
        if remote is not None:
            send_notif(self._agent, remote.agent_name, message)


def _row_descs(base_addr: int, num_rows: int, row_bytes: int, device_id: int) -> np.ndarray:
    """One ``(address, length, device)`` descriptor per row of ``row_bytes`` bytes of a
    memory region starting at ``base_addr``."""
    descs = np.empty((num_rows, 3), dtype=np.int64)
    descs[:, 0] = base_addr + np.arange(num_rows, dtype=np.int64) * row_bytes
    descs[:, 1] = row_bytes
    descs[:, 2] = device_id
    return descs
