"""The tcp backend between real processes over loopback sockets: bit-exact blocks, refusals,
release, dead or hung sources, concurrency, and a server that survives malformed input."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import pytest
import torch

from engine.kv_cache_spec import KVCacheSpec
from kvtransfer._tcp_wire import MAX_FRAME_BYTES, recv_frame, send_frame, split_address
from kvtransfer.base import (
    KV_TRANSFER_VERSION,
    KVRef,
    KVTransferError,
    PeerInfo,
    TransferState,
)
from kvtransfer.tcp import TcpBackend
from splitserve.v1 import kv_transfer_pb2 as pb

SMALL_SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=32, block_size=8, dtype="bfloat16")
BIG_SPEC = KVCacheSpec(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16")
NUM_BLOCKS = 64  # small: 64 x 4 KiB; big: 64 x 64 KiB = 4 MiB
DONE, FAILED, PENDING = TransferState.DONE, TransferState.FAILED, TransferState.PENDING


def make_cache(spec: KVCacheSpec, seed: int) -> torch.Tensor:
    """The random bf16 cache a source process fills; the same seed gives the same bytes."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((NUM_BLOCKS, *spec.block_shape), generator=generator).to(torch.bfloat16)


def rows(kv_cache: torch.Tensor) -> torch.Tensor:
    return kv_cache.view(torch.uint8).view(kv_cache.shape[0], -1)


def source_main(conn: Connection, engines: list[tuple[str, KVCacheSpec, int]]) -> None:
    """Child process: one TcpBackend per ``(engine_id, spec, seed)``, driven through ``conn``."""
    backends = {engine_id: TcpBackend(engine_id) for engine_id, _, _ in engines}
    conn.send([backends[e].register_kv_cache(make_cache(s, seed), s) for e, s, seed in engines])
    while True:
        command, *args = conn.recv()
        if command == "publish":
            engine_id, req_id, block_ids = args
            backends[engine_id].publish(req_id, block_ids)
            conn.send(None)
        elif command == "take_released":
            conn.send(backends[args[0]].take_released())
        else:
            break
    for backend in backends.values():
        backend.close()


class SourceProcess:
    """A spawned source process and the pipe that drives it."""

    def __init__(self, engines: list[tuple[str, KVCacheSpec, int]]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.process: BaseProcess = ctx.Process(
            target=source_main, args=(child_conn, engines), daemon=True
        )
        self.process.start()
        self._infos: dict[str, PeerInfo] | None = None

    def info(self, engine_id: str) -> PeerInfo:
        if self._infos is None:
            assert self.conn.poll(60), "source process did not start"
            self._infos = {info.engine_id: info for info in self.conn.recv()}
        return self._infos[engine_id]

    def publish(self, engine_id: str, req_id: str, block_ids: Sequence[int]) -> None:
        self.conn.send(("publish", engine_id, req_id, list(block_ids)))
        self.conn.recv()

    def take_released(self, engine_id: str) -> list[str]:
        self.conn.send(("take_released", engine_id))
        return self.conn.recv()

    def signal(self, signum: int) -> None:
        assert self.process.pid is not None
        os.kill(self.process.pid, signum)

    def stop(self) -> None:
        if self.process.is_alive():
            self.signal(signal.SIGKILL)
        self.process.join(timeout=10)


@pytest.fixture(scope="module")
def sources() -> Iterator[dict[str, SourceProcess]]:
    """Three source processes started together (their imports overlap): ``shared`` serves a
    small and a big engine; ``hung`` and ``killed`` are stopped or killed by one test each."""
    procs = {
        "shared": SourceProcess([("small", SMALL_SPEC, 1), ("big", BIG_SPEC, 2)]),
        "hung": SourceProcess([("hung", SMALL_SPEC, 3)]),
        "killed": SourceProcess([("killed", SMALL_SPEC, 4)]),
    }
    yield procs
    for proc in procs.values():
        proc.stop()


def make_dst(
    spec: KVCacheSpec, io_timeout_s: float = 5.0, connect_timeout_s: float = 5.0
) -> tuple[TcpBackend, torch.Tensor]:
    backend = TcpBackend("dst", io_timeout_s=io_timeout_s, connect_timeout_s=connect_timeout_s)
    kv_cache = torch.zeros((NUM_BLOCKS, *spec.block_shape), dtype=torch.bfloat16)
    backend.register_kv_cache(kv_cache, spec)
    return backend, kv_cache


@pytest.fixture
def dst_small() -> Iterator[tuple[TcpBackend, torch.Tensor]]:
    backend, kv_cache = make_dst(SMALL_SPEC)
    yield backend, kv_cache
    backend.close()


def wait_terminal(
    backend: TcpBackend, req_ids: Sequence[str], timeout_s: float = 10.0
) -> dict[str, TransferState]:
    """Poll until every read in ``req_ids`` is terminal, checking each is reported once."""
    terminal: dict[str, TransferState] = {}
    deadline_s = time.monotonic() + timeout_s
    while len(terminal) < len(req_ids):
        for req_id, state in backend.poll().items():
            if state is not PENDING:
                assert req_id not in terminal, f"{req_id} reported terminal twice"
                terminal[req_id] = state
        assert time.monotonic() < deadline_s, f"reads still pending: {backend.poll()}"
        time.sleep(0.002)
    return terminal


def assert_closed_by_peer(sock: socket.socket) -> None:
    # Closed with our bytes still unread, the kernel sends a reset instead of an orderly FIN.
    with contextlib.suppress(ConnectionResetError):
        assert sock.recv(1) == b""


def read(
    backend: TcpBackend, req_id: str, src: KVRef, dst_block_ids: Sequence[int]
) -> TransferState:
    backend.start_read(req_id, src, dst_block_ids)
    return wait_terminal(backend, [req_id])[req_id]


def test_read_between_processes_is_bit_exact_with_reordered_blocks(sources, dst_small):
    dst, dst_cache = dst_small
    info = sources["shared"].info("small")
    dst.add_peer(info)
    dst.add_peer(info)  # idempotent
    src_ids = [5, 6, 7, 40, 2, 3, 63]
    dst_ids = [0, 1, 2, 20, 50, 10, 9]
    sources["shared"].publish("small", "exact", src_ids)
    assert read(dst, "exact", KVRef("small", "exact", tuple(src_ids), 56), dst_ids) is DONE
    expected = rows(make_cache(SMALL_SPEC, seed=1))
    assert torch.equal(rows(dst_cache)[dst_ids], expected[src_ids])
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
    assert not rows(dst_cache)[untouched].any()
    assert dst.connection_setup_s["small"] > 0
    assert dst.poll() == {}


def test_four_mib_read_is_bit_exact(sources):
    dst, dst_cache = make_dst(BIG_SPEC)
    try:
        dst.add_peer(sources["shared"].info("big"))
        src_ids = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0)).tolist()
        sources["shared"].publish("big", "whole", src_ids)
        src = KVRef("big", "whole", tuple(src_ids), NUM_BLOCKS * 16)
        assert read(dst, "whole", src, list(range(NUM_BLOCKS))) is DONE
        assert torch.equal(rows(dst_cache), rows(make_cache(BIG_SPEC, seed=2))[src_ids])
    finally:
        dst.close()


def test_unpublished_request_or_block_fails_and_the_connection_survives(sources, dst_small):
    dst, _ = dst_small
    dst.add_peer(sources["shared"].info("small"))
    assert read(dst, "a", KVRef("small", "never-published", (1,), 8), [1]) is FAILED
    sources["shared"].publish("small", "partial", [1, 2])
    assert read(dst, "b", KVRef("small", "partial", (1, 3), 16), [1, 3]) is FAILED
    assert read(dst, "c", KVRef("small", "partial", (2, 1), 16), [1, 3]) is DONE


def test_release_reaches_the_source_and_unpublishes(sources, dst_small):
    dst, _ = dst_small
    dst.add_peer(sources["shared"].info("small"))
    sources["shared"].publish("small", "to-release", [4, 5])
    src = KVRef("small", "to-release", (4, 5), 16)
    assert read(dst, "dst-req", src, [0, 1]) is DONE
    dst.release("dst-req")
    released: list[str] = []
    deadline_s = time.monotonic() + 5
    while not released and time.monotonic() < deadline_s:
        released = sources["shared"].take_released("small")
        time.sleep(0.01)
    assert released == ["to-release"]
    assert read(dst, "again", src, [0, 1]) is FAILED


def test_32_concurrent_reads_are_all_done_and_correct(sources):
    dst, dst_cache = make_dst(SMALL_SPEC)
    try:
        dst.add_peer(sources["shared"].info("small"))
        perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
        req_ids = [f"many-{i}" for i in range(32)]
        for i, req_id in enumerate(req_ids):
            sources["shared"].publish("small", req_id, perm[2 * i : 2 * i + 2])
        for i, req_id in enumerate(req_ids):
            src = KVRef("small", req_id, tuple(perm[2 * i : 2 * i + 2]), 16)
            dst.start_read(req_id, src, [2 * i + 1, 2 * i])  # swapped: reordered destination
        assert wait_terminal(dst, req_ids) == dict.fromkeys(req_ids, DONE)
        dst_order = [b for i in range(32) for b in (2 * i + 1, 2 * i)]
        assert torch.equal(rows(dst_cache)[dst_order], rows(make_cache(SMALL_SPEC, seed=1))[perm])
    finally:
        dst.close()


def test_add_peer_rejects_mismatched_compat_hash_version_and_backend(sources, dst_small):
    dst, _ = dst_small
    info = sources["shared"].info("small")
    with pytest.raises(KVTransferError, match=f"'bogus'.*{SMALL_SPEC.compat_hash()}"):
        dst.add_peer(replace(info, compat_hash="bogus"))
    with pytest.raises(KVTransferError, match=f"version {KV_TRANSFER_VERSION + 1}"):
        dst.add_peer(replace(info, version=KV_TRANSFER_VERSION + 1))
    with pytest.raises(KVTransferError, match=r"'nixl'.*'tcp'"):
        dst.add_peer(replace(info, backend="nixl"))
    with pytest.raises(KVTransferError, match="was not added"):
        dst.start_read("x", KVRef("small", "x", (1,), 8), [1])
    dst.add_peer(info)
    with pytest.raises(ValueError, match="1 source blocks but 2"):
        dst.start_read("x", KVRef("small", "x", (1,), 8), [1, 2])
    with pytest.raises(ValueError, match="out of range"):
        dst.start_read("x", KVRef("small", "x", (1,), 8), [NUM_BLOCKS])


def test_source_killed_mid_read_or_before_read_fails_fast(sources, dst_small):
    source = sources["killed"]
    dst, _ = dst_small
    dst.add_peer(source.info("killed"))
    source.publish("killed", "r", [1, 2])
    src = KVRef("killed", "r", (1, 2), 16)
    assert read(dst, "warm", src, [1, 2]) is DONE
    source.signal(signal.SIGSTOP)
    dst.start_read("in-flight", src, [3, 4])
    time.sleep(0.2)
    assert dst.poll() == {"in-flight": PENDING}  # the request sits unread on the source
    start_s = time.monotonic()
    source.stop()
    assert wait_terminal(dst, ["in-flight"]) == {"in-flight": FAILED}
    assert time.monotonic() - start_s < 2.5  # the reset, not the 5 s io timeout
    assert read(dst, "after-death", src, [3, 4]) is FAILED
    fresh, _ = make_dst(SMALL_SPEC)
    try:
        fresh.add_peer(source.info("killed"))
        assert read(fresh, "never-connected", src, [3, 4]) is FAILED
    finally:
        fresh.close()


def test_hung_source_fails_within_io_timeout_and_close_fails_reads_in_flight(sources):
    source = sources["hung"]
    dst, _ = make_dst(SMALL_SPEC, io_timeout_s=0.5, connect_timeout_s=0.5)
    dst.add_peer(source.info("hung"))
    source.publish("hung", "r", [7])
    src = KVRef("hung", "r", (7,), 8)
    assert read(dst, "warm", src, [0]) is DONE
    source.signal(signal.SIGSTOP)
    start_s = time.monotonic()
    assert read(dst, "timed-out", src, [0]) is FAILED
    assert 0.4 < time.monotonic() - start_s < 2.0
    dst.start_read("cut-by-close", src, [1])
    time.sleep(0.05)
    start_s = time.monotonic()
    dst.close()
    assert time.monotonic() - start_s < 0.4
    assert dst.poll() == {"cut-by-close": FAILED}
    assert dst.poll() == {}
    dst.close()  # idempotent
    with pytest.raises(KVTransferError):
        dst.start_read("after-close", src, [1])
    source.stop()


def test_server_rejects_bad_hello_and_malformed_frames_then_keeps_serving():
    spec = SMALL_SPEC
    src_backend = TcpBackend("local-src")
    info = src_backend.register_kv_cache(make_cache(spec, seed=5), spec)
    dst, dst_cache = make_dst(spec)
    address = split_address(info.address)
    try:
        with socket.create_connection(address, timeout=2) as sock:
            hello = pb.KVHello(version=KV_TRANSFER_VERSION, compat_hash="bogus", engine_id="x")
            send_frame(sock, pb.KVFrame(hello=hello))
            ack = recv_frame(sock, 2, 2).hello_ack
            assert not ack.ok and "'bogus'" in ack.error
            assert_closed_by_peer(sock)  # closed after the rejection
        for garbage in (
            struct.pack(">I", MAX_FRAME_BYTES + 1),  # oversized length
            struct.pack(">I", 3) + b"\xff\xff\xff",  # undecodable body
            struct.pack(">I", 0),  # frame without a body
            struct.pack(">I", 0) + b"more",
        ):
            with socket.create_connection(address, timeout=2) as sock:
                sock.sendall(garbage)
                assert_closed_by_peer(sock)
        with socket.create_connection(address, timeout=2) as sock:  # read before hello
            send_frame(sock, pb.KVFrame(read=pb.KVReadRequest(seq=1, req_id="r")))
            assert_closed_by_peer(sock)
        dst.add_peer(info)
        src_backend.publish("r", [9])
        assert read(dst, "r", KVRef("local-src", "r", (9,), 8), [3]) is DONE
        assert torch.equal(rows(dst_cache)[3], rows(make_cache(spec, seed=5))[9])
    finally:
        dst.close()
        src_backend.close()
        src_backend.close()


def test_register_rejects_a_non_cpu_cache():
    backend = TcpBackend("meta")
    kv_cache = torch.empty((4, *SMALL_SPEC.block_shape), dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="CPU"):
        backend.register_kv_cache(kv_cache, SMALL_SPEC)
    backend.close()
