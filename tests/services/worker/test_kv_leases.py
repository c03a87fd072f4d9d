"""``LeaseHooks`` on a real engine and a real ``tcp`` backend: a released lease's blocks are
freed once no read of them is sending, and readers that hang on some leases delay no other
lease's release."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from kvtransfer._pull_protocol import PullEndpoint, hello_frame, read_frame, split_address
from kvtransfer._tcp_wire import recv_frame, send_frame
from kvtransfer.base import KVRef, PeerInfo
from kvtransfer.tcp import TcpBackend
from services.worker.kv_leases import LeaseHooks
from tests.waiting import wait_until

# Far longer than any wait here: a release that waited for a hung reader's timeout would fail.
IO_TIMEOUT_S = 120.0
WAIT_S = 30.0
# Each hung read asks for this many bytes: far more than the socket buffers on both ends hold,
# so the source's send blocks until the reader reads or goes away.
HUNG_READ_BYTES = 64 << 20


@dataclasses.dataclass
class Source:
    """A prefill engine whose leases are served over ``tcp``."""

    engine: LLMEngine
    backend: TcpBackend
    peer: PeerInfo
    hooks: LeaseHooks

    def prefill(self, req_id: str, prompt: list[int]) -> None:
        """Prefill ``prompt`` and hold its blocks under a lease (as the prefill worker does)."""
        self.engine.add_request(req_id, prompt, SamplingParams(max_tokens=1), hold_kv=True)
        while self.engine.has_unfinished_requests():
            self.hooks.after_step(self.engine, self.engine.step())
        assert self.hooks.get(req_id) is not None

    def step_until_freed(self, req_ids: list[str]) -> None:
        """Run the hooks (as every step or idle poll does) until no ``req_ids`` holds blocks."""

        def freed() -> bool:
            self.hooks.before_step(self.engine)
            return not any(self.engine.holds_kv(r) for r in req_ids)

        wait_until(freed, WAIT_S, f"the blocks of {req_ids} freed", 0.01)


@pytest.fixture
def source(tiny_llama_dir: Path) -> Iterator[Source]:
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    engine = LLMEngine(config)
    backend = TcpBackend("prefill", PullEndpoint(io_timeout_s=IO_TIMEOUT_S))
    peer = backend.register_kv_cache(engine.kv_cache, engine.kv_cache_spec)
    yield Source(engine, backend, peer, LeaseHooks(backend, ttl_s=600.0))
    backend.close()


def hang_a_read(source: Source, req_id: str) -> socket.socket:
    """Connect as a decode worker, ask for ``req_id``'s blocks (over and over, for
    ``HUNG_READ_BYTES``) and read nothing after the source granted the read: the source is
    sending them, stuck, until the returned socket is closed."""
    lease = source.hooks.get(req_id)
    assert lease is not None
    block_bytes = source.engine.kv_cache_spec.block_bytes
    repeats = -(-HUNG_READ_BYTES // (len(lease.block_ids) * block_bytes))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(split_address(source.peer.address))
    send_frame(sock, hello_frame("hung-reader", source.peer.compat_hash))
    assert recv_frame(sock, WAIT_S, WAIT_S).hello_ack.ok
    src = KVRef("prefill", req_id, lease.block_ids * repeats, 0, lease.grant)
    send_frame(sock, read_frame(1, src))
    assert recv_frame(sock, WAIT_S, WAIT_S).read_response.ok
    return sock


def test_hung_readers_delay_no_other_leases_release(source: Source) -> None:
    hung = [f"hung-{i}" for i in range(3)]
    for i, req_id in enumerate([*hung, "other"]):
        source.prefill(req_id, [3 + i, 5, 7, 11] * 10)
    readers = [hang_a_read(source, req_id) for req_id in hung]
    try:
        for req_id in [*hung, "other"]:
            assert source.hooks.release(source.engine, req_id)
        source.step_until_freed(["other"])
        # The hung leases stay pinned under the reads still sending their blocks.
        assert all(source.engine.holds_kv(r) for r in hung)
    finally:
        for sock in readers:
            sock.close()
    source.step_until_freed(hung)
    assert not source.hooks.busy and source.engine.stats().num_held_kv == 0


def test_a_prefill_lease_waits_for_its_reader_as_asked_within_a_cap(source: Source) -> None:
    """A decode worker may queue a request before it pulls: the router asks the prefill's
    lease to wait that long (``PrefillRequest.kv_lease_ttl_s``), at most 10 x the TTL."""
    hooks = LeaseHooks(source.backend, ttl_s=1.0)
    source = dataclasses.replace(source, hooks=hooks)
    asked = {"default": 0.0, "longer": 5.0, "capped": 1e6}
    for i, (req_id, ttl_s) in enumerate(asked.items()):
        source.engine.add_request(
            req_id, [3 + i, 5, 7, 11] * 10, SamplingParams(max_tokens=1), hold_kv=True
        )
        hooks.wait_for_reader(req_id, ttl_s)
        while source.engine.has_unfinished_requests():
            hooks.after_step(source.engine, source.engine.step())
    leases = {req_id: hooks.get(req_id) for req_id in asked}
    assert {r: lease.ttl_s for r, lease in leases.items() if lease} == {
        "default": 1.0,
        "longer": 5.0,
        "capped": 10.0,
    }
    source.step_until_freed(["default"])  # expired
    assert source.engine.holds_kv("longer") and source.engine.holds_kv("capped")
    assert hooks.num_leases_expired == 1
