"""The pull protocol of the ``tcp`` and ``ucx`` backends (private to ``kvtransfer``).

Its messages are ``KVFrame``s (``proto/splitserve/v1/kv_transfer.proto``); how one frame and the
block bytes travel is the transport's own (``_tcp_wire``: length-prefixed frames on a byte
stream; ``_ucx_wire``: UCX tagged messages). A connection opens with ``hello`` -> ``hello_ack``;
then the destination sends ``read`` and ``release`` frames, one at a time per connection::

    dst                                        src
    read(seq, req_id, grant, block_ids)   ---->
                                          <----   read_response(seq, ok, num_bytes)
                                          <----   if ok, num_bytes: the blocks in request order
    release(req_id, grant)                ---->   (no answer)

``grant`` is the one the source's ``publish`` of ``req_id`` returned (``KVRef.grant``): a read
presenting another is refused like one of an unpublished request, a release presenting another
is ignored.

Here: building and checking those messages (the destination's side), ``PullSource`` (the
source's side, free of I/O: answering hellos, dispatching frames, granting reads), and
``PullBackend``, the common base of the two backends (CPU caches, ``host:port`` addresses).
"""

from __future__ import annotations

import abc
import contextlib
import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from google.protobuf.message import DecodeError

from kvtransfer._common import PublishedBlocks
from kvtransfer.base import KV_TRANSFER_VERSION, KVRef, KVTransferError, PeerInfo
from kvtransfer.skeleton import BackendSkeleton
from kvtransfer.tls import KVTransferTls
from splitserve.v1 import kv_transfer_pb2 as pb

logger = logging.getLogger(__name__)

MAX_FRAME_BYTES = 16 * 1024 * 1024


class ProtocolError(Exception):
    """The other end broke the protocol; the connection cannot be trusted any more."""


def decode_frame(body: bytes) -> pb.KVFrame:
    """A frame's body as a ``KVFrame``; ``ProtocolError`` if it is not one with a body."""
    try:
        frame = pb.KVFrame.FromString(body)
    except DecodeError as exc:
        raise ProtocolError(f"undecodable frame: {exc}") from exc
    if frame.WhichOneof("body") is None:
        raise ProtocolError("frame without a body")
    return frame


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> ``(host, port)``; ``KVTransferError`` if malformed."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise KVTransferError(f"bad tcp peer address {address!r}, expected host:port")
    return host.strip("[]"), int(port)


# ---------------------------------------------------------------------- destination side
def hello_frame(engine_id: str, compat_hash: str) -> pb.KVFrame:
    """The first frame on a new connection: who we are and our cache layout."""
    hello = pb.KVHello(version=KV_TRANSFER_VERSION, compat_hash=compat_hash, engine_id=engine_id)
    return pb.KVFrame(hello=hello)


def check_hello_ack(frame: pb.KVFrame) -> None:
    """``ProtocolError`` unless ``frame`` is a ``hello_ack``; ``KVTransferError`` naming the
    reason when the source rejected our hello."""
    if frame.WhichOneof("body") != "hello_ack":
        raise ProtocolError(f"expected hello_ack, got {frame.WhichOneof('body')}")
    if not frame.hello_ack.ok:
        raise KVTransferError(f"peer rejected our hello: {frame.hello_ack.error}")


def read_frame(seq: int, src: KVRef, run_lengths: Sequence[int] = ()) -> pb.KVFrame:
    """A request for ``src``'s blocks, presenting ``src.grant``; ``run_lengths`` (ucx only)
    splits them into messages."""
    request = pb.KVReadRequest(
        seq=seq,
        req_id=src.req_id,
        block_ids=src.block_ids,
        run_lengths=run_lengths,
        grant=src.grant,
    )
    return pb.KVFrame(read=request)


def check_read_response(frame: pb.KVFrame, seq: int, expected_bytes: int) -> KVTransferError | None:
    """Check the answer to read ``seq``: None when ``expected_bytes`` of blocks follow, the
    error to raise when the source refused the read (the connection stays in sync).
    ``ProtocolError`` for any other frame, or for an ``ok`` announcing another size."""
    if frame.WhichOneof("body") != "read_response" or frame.read_response.seq != seq:
        got = f"{frame.WhichOneof('body')} seq {frame.read_response.seq}"
        raise ProtocolError(f"expected read_response seq {seq}, got {got}")
    response = frame.read_response
    if not response.ok:
        return KVTransferError(f"source refused the read: {response.error}")
    if response.num_bytes != expected_bytes:
        raise ProtocolError(f"{response.num_bytes} bytes announced, {expected_bytes} due")
    return None


def release_frame(src_req_id: str, grant: bytes) -> pb.KVFrame:
    """Tells the source it may free the blocks of ``src_req_id`` (published under ``grant``);
    it sends no answer."""
    return pb.KVFrame(release=pb.KVReleaseRequest(req_id=src_req_id, grant=grant))


# ---------------------------------------------------------------------- source side
class PullSource:
    """The source side of the protocol for one backend, free of I/O: a transport receives a
    frame, asks this what it means and sends what this returns.

    Thread-safe (its state is ``published``), so it serves every connection at once.
    """

    def __init__(self, published: PublishedBlocks, compat_hash: str, block_bytes: int) -> None:
        self._published = published
        self._compat_hash = compat_hash
        self._block_bytes = block_bytes

    def answer_hello(self, frame: pb.KVFrame) -> tuple[pb.KVFrame, bool]:
        """The ``hello_ack`` to send, and whether the connection may go on after it (the
        peer's version and ``compat_hash`` match ours; a rejection is logged).
        ``ProtocolError`` when ``frame`` is not a hello."""
        if frame.WhichOneof("body") != "hello":
            raise ProtocolError(f"expected hello, got {frame.WhichOneof('body')}")
        hello = frame.hello
        error = ""
        if hello.version != KV_TRANSFER_VERSION:
            error = f"kv transfer version {hello.version} != ours {KV_TRANSFER_VERSION}"
        elif hello.compat_hash != self._compat_hash:
            error = f"compat_hash {hello.compat_hash!r} != ours {self._compat_hash!r}"
        if error:
            logger.warning("rejected kv peer %r: %s", hello.engine_id, error)
        return pb.KVFrame(hello_ack=pb.KVHelloAck(ok=not error, error=error)), not error

    def dispatch(self, frame: pb.KVFrame) -> pb.KVReadRequest | None:
        """Apply a frame received after the hello: a ``release`` presenting its request's grant
        unpublishes the request here (for ``take_released``); a ``read`` is returned, for the
        transport to answer within ``serving``. ``ProtocolError`` for any other frame."""
        kind = frame.WhichOneof("body")
        if kind == "release":
            self._published.release(frame.release.req_id, frame.release.grant)
            return None
        if kind != "read":
            raise ProtocolError(f"unexpected {kind} frame")
        return frame.read

    @contextlib.contextmanager
    def serving(self, read: pb.KVReadRequest) -> Iterator[pb.KVFrame]:
        """Grant or refuse ``read`` (refused unless it presents its request's grant and asks
        only for published blocks); yields the ``read_response`` frame to send. When it is
        ``ok``, the transport sends the blocks inside the ``with``, during which an unpublished
        request is not reported free (``take_unpublished``)."""
        block_ids = list(read.block_ids)
        error = self._published.begin_read(read.req_id, read.grant, block_ids)
        response = pb.KVReadResponse(
            seq=read.seq,
            ok=error is None,
            error=error or "",
            num_bytes=0 if error else len(block_ids) * self._block_bytes,
        )
        try:
            yield pb.KVFrame(read_response=response)
        finally:
            if error is None:
                self._published.end_read(read.req_id)
        if error:
            logger.info("refused kv read req_id=%s: %s", read.req_id, error)


# ---------------------------------------------------------------------- the backends' base
@dataclass(frozen=True, slots=True)
class PullEndpoint:
    """Where a ``tcp`` or ``ucx`` backend listens, what it advertises, how long it waits.

    ``port`` 0 picks an ephemeral port; peers are told ``advertise_host or host``.
    ``io_timeout_s`` bounds each message exchanged with a silent peer; ``connect_timeout_s``
    bounds connecting to a peer plus the TLS and hello handshakes. With ``tls`` every
    connection is mutual TLS (``kvtransfer.tls``); without, plaintext guarded by grants only.
    """

    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    io_timeout_s: float = 10.0
    connect_timeout_s: float = 5.0
    tls: KVTransferTls | None = None


# An ephemeral port on loopback: tests and single-host runs.
LOOPBACK_ENDPOINT = PullEndpoint()


class PullBackend(BackendSkeleton):
    """The common base of ``tcp`` and ``ucx``: CPU caches served at ``endpoint`` by a listener
    started at registration, answering through ``_source``."""

    def __init__(self, engine_id: str, endpoint: PullEndpoint) -> None:
        super().__init__(engine_id, endpoint.io_timeout_s)
        self._host = endpoint.host
        self._port = endpoint.port
        self._advertise_host = endpoint.advertise_host
        self._connect_timeout_s = endpoint.connect_timeout_s
        self._tls = endpoint.tls
        self._seq = itertools.count(1)  # numbers our read requests
        self._source: PullSource  # created in _expose, before the listener starts

    def _check_cache(self, kv_cache: torch.Tensor) -> None:
        if kv_cache.device.type != "cpu":
            raise ValueError(
                f"the {self.name} backend needs a CPU KV cache, got one on {kv_cache.device}"
            )

    def _expose(self, kv_cache: torch.Tensor, segments: torch.Tensor) -> tuple[str, bytes]:
        self._source = PullSource(self._published, self._compat_hash, self._block_bytes)
        port = self._listen(segments)
        return f"{self._advertise_host or self._host}:{port}", b""

    def _check_peer_info(self, peer: PeerInfo) -> None:
        split_address(peer.address)

    def _hello(self) -> pb.KVFrame:
        return hello_frame(self.engine_id, self._compat_hash)

    @abc.abstractmethod
    def _listen(self, segments: torch.Tensor) -> int:
        """Start serving ``segments`` (``uint8 [num_segments, num_blocks, segment_bytes]``, the
        cache's memory) on ``self._port``; return the port listened on."""
