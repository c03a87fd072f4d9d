"""What only the tcp backend has: a wire protocol whose server survives malformed input.
The backend contract itself is checked for every backend in ``test_backends.py``."""

from __future__ import annotations

import contextlib
import socket
import struct

import torch

import kvtransfer._tcp_wire
import kvtransfer.tcp
from kvtransfer._tcp_wire import (
    MAX_FRAME_BYTES,
    MAX_HELLO_BYTES,
    recv_frame,
    send_frame,
    split_address,
)
from kvtransfer.base import KV_TRANSFER_VERSION, KVRef
from kvtransfer.tcp import TcpBackend
from splitserve.v1 import kv_transfer_pb2 as pb
from tests.kvtransfer.harness import (
    BIG_SPEC,
    DONE,
    FAILED,
    NUM_BLOCKS,
    SMALL_SPEC,
    make_cache,
    make_dst,
    read,
    rows,
)
from tests.waiting import wait_until


def assert_closed_by_peer(sock: socket.socket) -> None:
    # Closed with our bytes still unread, the kernel sends a reset instead of an orderly FIN.
    with contextlib.suppress(ConnectionResetError):
        assert sock.recv(1) == b""


def test_server_rejects_bad_hello_and_malformed_frames_then_keeps_serving():
    spec = SMALL_SPEC
    src_backend = TcpBackend("local-src")
    info = src_backend.register_kv_cache(make_cache(spec, seed=5), spec)
    dst, dst_cache = make_dst("tcp", spec)
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
            struct.pack(">I", MAX_HELLO_BYTES + 1),  # bigger than any hello
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
        grant = src_backend.publish("r", [9])
        assert read(dst, "r", KVRef("local-src", "r", (9,), 8, grant), [3]) is DONE
        assert torch.equal(rows(dst_cache)[3], rows(make_cache(spec, seed=5))[9])
    finally:
        dst.close()
        src_backend.close()
        src_backend.close()


def test_a_read_split_into_parts_is_bit_exact_and_a_refused_part_fails_it():
    spec = BIG_SPEC
    src_backend = TcpBackend("parts-src")
    info = src_backend.register_kv_cache(make_cache(spec, seed=6), spec)
    dst = TcpBackend("parts-dst", part_bytes=spec.block_bytes * 5)
    dst_cache = torch.zeros((NUM_BLOCKS, *spec.block_shape), dtype=torch.bfloat16)
    dst.register_kv_cache(dst_cache, spec)
    try:
        dst.add_peer(info)
        src_ids = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(3)).tolist()
        grant = src_backend.publish("whole", src_ids)
        src = KVRef("parts-src", "whole", tuple(src_ids), NUM_BLOCKS * 16, grant)
        assert read(dst, "whole", src, list(range(NUM_BLOCKS))) is DONE
        assert torch.equal(rows(dst_cache), rows(make_cache(spec, seed=6))[src_ids])
        half_grant = src_backend.publish("first-half", src_ids[:32])
        half = KVRef("parts-src", "first-half", tuple(src_ids), NUM_BLOCKS * 16, half_grant)
        assert read(dst, "second-part-refused", half, list(range(NUM_BLOCKS))) is FAILED
    finally:
        dst.close()
        src_backend.close()


def hello_frame(info) -> pb.KVFrame:
    hello = pb.KVHello(version=KV_TRANSFER_VERSION, compat_hash=info.compat_hash, engine_id="raw")
    return pb.KVFrame(hello=hello)


def test_connections_beyond_the_cap_are_refused_and_the_server_keeps_serving(monkeypatch):
    monkeypatch.setattr(kvtransfer.tcp, "MAX_SERVER_CONNECTIONS", 2)
    spec = SMALL_SPEC
    src_backend = TcpBackend("cap-src")
    info = src_backend.register_kv_cache(make_cache(spec, seed=6), spec)
    dst, _ = make_dst("tcp", spec)
    address = split_address(info.address)
    try:
        silent = [socket.create_connection(address, timeout=5) for _ in range(2)]
        with socket.create_connection(address, timeout=5) as extra:
            assert_closed_by_peer(extra)
        for sock in silent:
            sock.close()
        wait_until(  # their threads see the close
            lambda: not src_backend._server_conns, 10, "the server closing its side", 0.01
        )
        dst.add_peer(info)
        grant = src_backend.publish("r", [2])
        assert read(dst, "r", KVRef("cap-src", "r", (2,), 8, grant), [1]) is DONE
    finally:
        dst.close()
        src_backend.close()


def test_idle_connections_are_closed_and_pooled_ones_are_not_reused_stale(monkeypatch):
    monkeypatch.setattr(kvtransfer.tcp, "SERVER_IDLE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(kvtransfer._tcp_wire, "CLIENT_IDLE_S", 0.25)
    spec = SMALL_SPEC
    src_backend = TcpBackend("idle-src")
    info = src_backend.register_kv_cache(make_cache(spec, seed=7), spec)
    dst, dst_cache = make_dst("tcp", spec)
    try:
        with socket.create_connection(split_address(info.address), timeout=5) as sock:
            send_frame(sock, hello_frame(info))
            assert recv_frame(sock, 2, 2).hello_ack.ok
            sock.settimeout(5)
            assert_closed_by_peer(sock)  # after SERVER_IDLE_TIMEOUT_S without a frame
        dst.add_peer(info)
        grant_a = src_backend.publish("a", [3])
        grant_b = src_backend.publish("b", [4])
        assert read(dst, "a", KVRef("idle-src", "a", (3,), 8, grant_a), [5]) is DONE
        wait_until(  # idle for SERVER_IDLE_TIMEOUT_S, hence for more than CLIENT_IDLE_S
            lambda: not src_backend._server_conns,
            10,
            "the server dropping the idle pooled connection",
            0.01,
        )
        assert read(dst, "b", KVRef("idle-src", "b", (4,), 8, grant_b), [6]) is DONE
        assert torch.equal(rows(dst_cache)[6], rows(make_cache(spec, seed=7))[4])
    finally:
        dst.close()
        src_backend.close()
