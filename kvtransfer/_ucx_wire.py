"""Plumbing of the ``ucx`` backend (private to ``kvtransfer.ucx``): the process's ucxx event
loop, frames of the pull protocol (``_pull_protocol``) as UCX tagged messages, the runs that
block bytes move in, bounded waits.

A frame is two messages on one endpoint (which arrive in order): its length (8 bytes,
little-endian), then the serialized ``KVFrame``, sealed by ``MessageTls`` when the backends
use mutual TLS (``FrameChannel``; the TLS handshake's messages travel the same way first).
A granted read's blocks follow, outside TLS, as one message per run that the reader asked for
in ``run_lengths`` (``joint_runs``): ids consecutive on both sides, so each run moves straight
from the source's cache into the destination's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from kvtransfer._pull_protocol import MAX_FRAME_BYTES, ProtocolError, decode_frame
from kvtransfer.base import KVTransferError
from kvtransfer.tls import MessageTls, TlsFailure
from splitserve.v1 import kv_transfer_pb2 as pb

# Unless it is set, importing ucxx writes UCX_RNDV_FRAG_MEM_TYPE=cuda into os.environ, where
# every later UCX context of this process (nixl's too) reads it; cuda fragments slow host-memory
# rendezvous (64 MiB: ~0.9 vs ~1.3 GiB/s here). "host" is what UCX itself uses for host memory,
# so nixl's host transfers keep their behaviour; setdefault lets an operator's own value win.
os.environ.setdefault("UCX_RNDV_FRAG_MEM_TYPE", "host")

import ucxx
from ucxx._lib_async import Endpoint, Listener
from ucxx.exceptions import UCXError

# kvtransfer.ucx takes ucxx from here, after the environment above is set.
__all__ = [
    "Endpoint",
    "FrameChannel",
    "Listener",
    "UCXError",
    "abort",
    "joint_runs",
    "requested_runs",
    "ucx_loop",
    "ucxx",
    "within",
]

_T = TypeVar("_T")
_LENGTH = np.dtype("<u8")
_ABORT_PERIOD_NS = 100_000_000  # the longest an endpoint abort waits on UCX
_loop_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def ucx_loop() -> asyncio.AbstractEventLoop:
    """The process's ucxx loop; the first call starts it and runs ``ucxx.init`` on it."""
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="kv-ucx-loop", daemon=True).start()
            asyncio.run_coroutine_threadsafe(_init_ucxx(), loop).result()
            _loop = loop
        return _loop


async def _init_ucxx() -> None:
    ucxx.init(progress_mode="thread", enable_python_future=True)


async def within(awaitable: Awaitable[_T], timeout_s: float | None, what: str) -> _T:
    """Await ``awaitable``, or raise ``KVTransferError`` after ``timeout_s`` (None: no limit)."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError:
        raise KVTransferError(f"{what} timed out after {timeout_s} s") from None


async def send_message(ep: Endpoint, body: bytes, timeout_s: float) -> None:
    """Send ``body`` as its two messages (length, then bytes), each within ``timeout_s``."""
    await within(ep.send(np.array([len(body)], dtype=_LENGTH)), timeout_s, "sending a frame")
    await within(ep.send(np.frombuffer(body, dtype=np.uint8)), timeout_s, "sending a frame")


async def recv_message(ep: Endpoint, wait_s: float | None, timeout_s: float) -> bytes:
    """Wait up to ``wait_s`` (None: forever) for a message, then ``timeout_s`` for its body.
    ``ProtocolError`` for an empty one or one over ``MAX_FRAME_BYTES``."""
    header = np.zeros(1, dtype=_LENGTH)
    await within(ep.recv(header), wait_s, "waiting for a frame")
    length = int(header[0])
    if not 0 < length <= MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {length} bytes is not in (0, {MAX_FRAME_BYTES}]")
    body = bytearray(length)
    await within(ep.recv(body), timeout_s, "receiving a frame")
    return bytes(body)


@dataclass(slots=True)
class FrameChannel:
    """The frames of one endpoint, sealed by ``tls`` (mutual TLS) when the backend has it.

    ``handshake`` must complete before the first frame when ``tls`` is set; the block bytes of
    a read move on ``ep`` directly, outside TLS. One task uses a channel at a time.
    """

    ep: Endpoint
    tls: MessageTls | None = None

    async def handshake(self, timeout_s: float) -> None:
        """Run the TLS handshake (nothing without ``tls``); ``TlsFailure`` when it fails or
        the peer's certificate is not admitted, after sending the peer our alert, if any."""
        if self.tls is None:
            return
        try:
            out, done = self.tls.handshake_step(None)
            while True:
                if out:
                    await send_message(self.ep, out, timeout_s)
                if done:
                    return
                received = await recv_message(self.ep, timeout_s, timeout_s)
                out, done = self.tls.handshake_step(received)
        except TlsFailure as exc:
            if exc.alert:
                with contextlib.suppress(UCXError, KVTransferError):
                    await send_message(self.ep, exc.alert, timeout_s)
            raise

    async def send(self, frame: pb.KVFrame, timeout_s: float) -> None:
        """Send ``frame`` (sealed with ``tls``), each message within ``timeout_s``."""
        body = frame.SerializeToString()
        await send_message(self.ep, self.tls.seal(body) if self.tls else body, timeout_s)

    async def recv(self, wait_s: float | None, timeout_s: float) -> pb.KVFrame:
        """Wait up to ``wait_s`` (None: forever) for a frame, then ``timeout_s`` for its body.
        ``ProtocolError`` on a bad frame, ``TlsFailure`` on one the peer did not seal."""
        body = await recv_message(self.ep, wait_s, timeout_s)
        return decode_frame(self.tls.open(body) if self.tls else body)


def abort(ep: Endpoint | None) -> None:
    """Close ``ep`` at once and cancel its pending requests (UCX gets up to 0.1 s), so their
    buffers are free for reuse when this returns. Idempotent."""
    if ep is not None:
        ep.abort(period=_ABORT_PERIOD_NS)


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


def requested_runs(read: pb.KVReadRequest) -> list[tuple[int, int]]:
    """The ``(first_id, count)`` runs, one message each, that ``read.run_lengths`` asks for.
    ``ProtocolError`` unless they split ``read.block_ids`` into runs of consecutive ids."""
    block_ids = list(read.block_ids)
    if sum(read.run_lengths) != len(block_ids) or 0 in read.run_lengths:
        raise ProtocolError(f"run lengths {list(read.run_lengths)[:8]} do not split the read")
    runs: list[tuple[int, int]] = []
    start = 0
    for count in read.run_lengths:
        first = block_ids[start]
        if block_ids[start : start + count] != list(range(first, first + count)):
            raise ProtocolError(f"run of {count} blocks from {first} is not consecutive")
        runs.append((first, count))
        start += count
    return runs
