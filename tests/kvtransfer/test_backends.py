"""Every installed KV transfer backend between real processes: bit-exact blocks, refusals,
grants, release, dead or hung sources, concurrency. The same contract tests run for nixl, ucx
and tcp."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from kvtransfer.base import KV_TRANSFER_VERSION, KVRef, KVTransferBackend, KVTransferError
from kvtransfer.registry import available_backends, make_backend
from tests.kvtransfer.harness import (
    BIG_SPEC,
    DONE,
    FAILED,
    INT8_SPEC,
    LAYER_MAJOR_SPEC,
    NUM_BLOCKS,
    PENDING,
    SMALL_SPEC,
    SourceProcess,
    make_cache,
    make_dst,
    read,
    rows,
    wait_terminal,
)

NETWORK_BACKENDS = [name for name in available_backends() if name != "inproc"]
# nixl posts its one-sided READ together with read_begin, before the source answers: a refused
# read may still have filled the destination blocks (see kvtransfer/nixl.py).
READS_BEFORE_THE_ANSWER = {"nixl"}


@pytest.fixture(scope="module", params=NETWORK_BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def sources(backend_name: str) -> Iterator[dict[str, SourceProcess]]:
    """Three source processes started together (their imports overlap): ``shared`` serves a
    small and a big engine; ``hung`` and ``killed`` are stopped or killed by one test each."""
    procs = {
        "shared": SourceProcess(
            backend_name,
            [
                ("small", SMALL_SPEC, 1),
                ("big", BIG_SPEC, 2),
                ("small_int8", INT8_SPEC, 5),
                ("layers", LAYER_MAJOR_SPEC, 6),
            ],
        ),
        "hung": SourceProcess(backend_name, [("hung", SMALL_SPEC, 3)]),
        "killed": SourceProcess(backend_name, [("killed", SMALL_SPEC, 4)]),
    }
    yield procs
    for proc in procs.values():
        proc.stop()


@pytest.fixture
def dst_small(backend_name: str) -> Iterator[tuple[KVTransferBackend, torch.Tensor]]:
    backend, kv_cache = make_dst(backend_name, SMALL_SPEC)
    yield backend, kv_cache
    backend.close()


def test_read_between_processes_is_bit_exact_with_reordered_blocks(sources, dst_small):
    dst, dst_cache = dst_small
    info = sources["shared"].info("small")
    dst.add_peer(info)
    dst.add_peer(info)  # idempotent
    src_ids = [5, 6, 7, 40, 2, 3, 63]
    dst_ids = [0, 1, 2, 20, 50, 10, 9]
    grant = sources["shared"].publish("small", "exact", src_ids)
    assert read(dst, "exact", KVRef("small", "exact", tuple(src_ids), 56, grant), dst_ids) is DONE
    expected = rows(make_cache(SMALL_SPEC, seed=1))
    assert torch.equal(rows(dst_cache)[dst_ids], expected[src_ids])
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
    assert not rows(dst_cache)[untouched].any()
    assert dst.connection_setup_s["small"] > 0
    assert dst.poll() == {}


def test_reads_end_while_signals_interrupt_the_io_threads(sources, dst_small):
    """A signal landing on a backend's I/O thread (a child's SIGCHLD, a library's timer) must
    not stop its loop. CPython 3.11's ``SimpleQueue.get(timeout=...)``, interrupted by one
    past its deadline, waits forever: nixl's loop, waiting so for its next poll, never saw
    its READ end (one read in about 700 on a loaded host; here, within a few reads)."""
    dst, dst_cache = dst_small
    dst.add_peer(sources["shared"].info("small"))
    stop = threading.Event()

    def interrupt_io_threads() -> None:
        while not stop.is_set():
            for thread in threading.enumerate():
                if thread.name.startswith("kv-") and thread.ident is not None:
                    signal.pthread_kill(thread.ident, signal.SIGUSR1)
            time.sleep(0.0003)

    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    interrupter = threading.Thread(target=interrupt_io_threads, daemon=True)
    interrupter.start()
    try:
        for i in range(30):
            grant = sources["shared"].publish("small", f"sig{i}", [i, i + 1])
            src = KVRef("small", f"sig{i}", (i, i + 1), 16, grant)
            assert read(dst, f"sig{i}", src, [i, i + 1]) is DONE
    finally:
        stop.set()
        interrupter.join()
        signal.signal(signal.SIGUSR1, previous)
    expected = rows(make_cache(SMALL_SPEC, seed=1))
    assert torch.equal(rows(dst_cache)[:31], expected[:31])
    for i in range(30):
        sources["shared"].unpublish("small", f"sig{i}")


def test_four_mib_read_is_bit_exact(backend_name, sources):
    dst, dst_cache = make_dst(backend_name, BIG_SPEC)
    try:
        dst.add_peer(sources["shared"].info("big"))
        src_ids = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0)).tolist()
        grant = sources["shared"].publish("big", "whole", src_ids)
        src = KVRef("big", "whole", tuple(src_ids), NUM_BLOCKS * 16, grant)
        assert read(dst, "whole", src, list(range(NUM_BLOCKS))) is DONE
        assert torch.equal(rows(dst_cache), rows(make_cache(BIG_SPEC, seed=2))[src_ids])
    finally:
        dst.close()


def test_an_8bit_cache_moves_bit_exact_codes_and_scales(backend_name, sources):
    """An int8 cache's blocks are opaque bytes to every backend: codes and scales arrive as
    they were, in about half a bfloat16 block's bytes."""
    dst, dst_cache = make_dst(backend_name, INT8_SPEC)
    try:
        dst.add_peer(sources["shared"].info("small_int8"))
        src_ids, dst_ids = [9, 3, 60, 0], [1, 2, 3, 40]
        grant = sources["shared"].publish("small_int8", "q", src_ids)
        assert read(dst, "q", KVRef("small_int8", "q", tuple(src_ids), 32, grant), dst_ids) is DONE
        assert torch.equal(dst_cache[dst_ids], make_cache(INT8_SPEC, seed=5)[src_ids])
        assert INT8_SPEC.block_bytes == SMALL_SPEC.block_bytes * (32 + 4) // 64
    finally:
        dst.close()


def test_a_layer_major_cache_moves_every_layer_of_each_block(backend_name, sources):
    """vLLM's CPU layout: each block is one region per layer, at an offset that depends on how
    many blocks a cache has. A destination with fewer blocks than the source gets every layer
    of each block in place (runs and single blocks alike), and nothing else is written."""
    dst, dst_cache = make_dst(backend_name, LAYER_MAJOR_SPEC, num_blocks=40)
    try:
        assert not dst_cache.is_contiguous() and dst_cache.transpose(0, 1).is_contiguous()
        dst.add_peer(sources["shared"].info("layers"))
        src_ids, dst_ids = [60, 61, 62, 7, 30, 31], [3, 4, 5, 39, 0, 20]
        grant = sources["shared"].publish("layers", "l", src_ids)
        assert read(dst, "l", KVRef("layers", "l", tuple(src_ids), 48, grant), dst_ids) is DONE
        expected = make_cache(LAYER_MAJOR_SPEC, seed=6)
        assert torch.equal(dst_cache[dst_ids], expected[src_ids])
        untouched = [b for b in range(40) if b not in dst_ids]
        assert not dst_cache[untouched].any()
    finally:
        dst.close()


def test_a_block_major_and_a_layer_major_cache_do_not_pair(sources, dst_small):
    """The same shape in another memory order is another layout: its blocks would arrive
    scrambled, so the pair is refused naming both."""
    dst, _ = dst_small
    with pytest.raises(KVTransferError, match="vllm-cpu layer-major"):
        dst.add_peer(sources["shared"].info("layers"))


def test_a_peer_with_another_kv_cache_dtype_is_refused_naming_both(sources, dst_small):
    dst, _ = dst_small
    refusal = r"int8 KV cache.*bfloat16 KV cache.*--kv-cache-dtype"
    with pytest.raises(KVTransferError, match=refusal):
        dst.add_peer(sources["shared"].info("small_int8"))


def test_unpublished_request_or_block_is_refused_and_the_pair_survives(sources, dst_small):
    dst, _ = dst_small
    dst.add_peer(sources["shared"].info("small"))
    assert read(dst, "a", KVRef("small", "never-published", (1,), 8), [1]) is FAILED
    grant = sources["shared"].publish("small", "partial", [1, 2])
    assert read(dst, "b", KVRef("small", "partial", (1, 3), 16, grant), [1, 3]) is FAILED
    assert read(dst, "c", KVRef("small", "partial", (2, 1), 16, grant), [1, 3]) is DONE
    sources["shared"].unpublish("small", "partial")
    assert read(dst, "d", KVRef("small", "partial", (2, 1), 16, grant), [1, 3]) is FAILED


def test_release_reaches_the_source_and_unpublishes(sources, dst_small):
    dst, _ = dst_small
    dst.add_peer(sources["shared"].info("small"))
    grant = sources["shared"].publish("small", "to-release", [4, 5])
    src = KVRef("small", "to-release", (4, 5), 16, grant)
    assert read(dst, "dst-req", src, [0, 1]) is DONE
    dst.release("dst-req")
    assert sources["shared"].wait_released("small") == ["to-release"]
    assert read(dst, "again", src, [0, 1]) is FAILED


def forged(grant: bytes) -> bytes:
    """``grant`` with its first byte flipped: what a prober who almost guessed it presents."""
    return bytes([grant[0] ^ 0xFF]) + grant[1:]


def test_a_read_without_the_publication_grant_fails_and_writes_nothing(
    backend_name, sources, dst_small
):
    dst, dst_cache = dst_small
    dst.add_peer(sources["shared"].info("small"))
    src_ids, dst_ids = [8, 9, 10], [30, 31, 32]
    grant = sources["shared"].publish("small", "guarded", src_ids)
    src = KVRef("small", "guarded", tuple(src_ids), 24, grant)
    dst_cache.copy_(make_cache(SMALL_SPEC, seed=9))
    before = rows(dst_cache).clone()
    assert read(dst, "forged", replace(src, grant=forged(grant)), dst_ids) is FAILED
    assert read(dst, "no-grant", replace(src, grant=b""), dst_ids) is FAILED
    if backend_name not in READS_BEFORE_THE_ANSWER:
        assert torch.equal(rows(dst_cache), before)
    assert read(dst, "granted", src, dst_ids) is DONE
    assert torch.equal(rows(dst_cache)[dst_ids], rows(make_cache(SMALL_SPEC, seed=1))[src_ids])


def test_a_release_without_the_publication_grant_is_ignored(sources, dst_small):
    dst, dst_cache = dst_small
    source = sources["shared"]
    dst.add_peer(source.info("small"))
    grant = source.publish("small", "kept", [11, 12])
    src = KVRef("small", "kept", (11, 12), 16, grant)
    assert read(dst, "forged", replace(src, grant=forged(grant)), [0, 1]) is FAILED
    dst.release("forged")  # presents the forged grant, as its read did
    assert read(dst, "no-grant", replace(src, grant=b""), [0, 1]) is FAILED
    dst.release("no-grant")
    source.wait_warnings("release of req_id=kept ignored", count=2)  # both arrived
    assert source.take_released("small") == []
    assert read(dst, "granted", src, [0, 1]) is DONE
    assert torch.equal(rows(dst_cache)[[0, 1]], rows(make_cache(SMALL_SPEC, seed=1))[[11, 12]])
    dst.release("granted")
    assert source.wait_released("small") == ["kept"]


def test_republishing_a_request_replaces_its_grant(sources, dst_small):
    dst, dst_cache = dst_small
    dst.add_peer(sources["shared"].info("small"))
    old_grant = sources["shared"].publish("small", "republished", [13])
    new_grant = sources["shared"].publish("small", "republished", [14])
    assert new_grant != old_grant
    src = KVRef("small", "republished", (14,), 8, new_grant)
    assert read(dst, "old-grant", replace(src, grant=old_grant), [2]) is FAILED
    assert read(dst, "new-grant", src, [2]) is DONE
    assert torch.equal(rows(dst_cache)[2], rows(make_cache(SMALL_SPEC, seed=1))[14])


def test_an_empty_read_is_done_and_its_release_reaches_the_source(sources, dst_small):
    """A decode worker that caches the whole prompt reads nothing, but still frees the lease."""
    dst, _ = dst_small
    dst.add_peer(sources["shared"].info("small"))
    grant = sources["shared"].publish("small", "nothing-to-read", [6])
    assert read(dst, "empty", KVRef("small", "nothing-to-read", (), 16, grant), []) is DONE
    dst.release("empty")
    assert sources["shared"].wait_released("small") == ["nothing-to-read"]


def test_32_concurrent_reads_are_all_done_and_correct(backend_name, sources):
    dst, dst_cache = make_dst(backend_name, SMALL_SPEC)
    try:
        dst.add_peer(sources["shared"].info("small"))
        perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
        req_ids = [f"many-{i}" for i in range(32)]
        grants = [
            sources["shared"].publish("small", req_id, perm[2 * i : 2 * i + 2])
            for i, req_id in enumerate(req_ids)
        ]
        for i, req_id in enumerate(req_ids):
            src = KVRef("small", req_id, tuple(perm[2 * i : 2 * i + 2]), 16, grants[i])
            dst.start_read(req_id, src, [2 * i + 1, 2 * i])  # swapped: reordered destination
        assert wait_terminal(dst, req_ids) == dict.fromkeys(req_ids, DONE)
        dst_order = [b for i in range(32) for b in (2 * i + 1, 2 * i)]
        assert torch.equal(rows(dst_cache)[dst_order], rows(make_cache(SMALL_SPEC, seed=1))[perm])
    finally:
        dst.close()


def test_add_peer_rejects_mismatched_compat_hash_version_and_backend(
    backend_name, sources, dst_small
):
    dst, _ = dst_small
    info = sources["shared"].info("small")
    with pytest.raises(KVTransferError, match=f"'bogus'.*{SMALL_SPEC.compat_hash()}"):
        dst.add_peer(replace(info, compat_hash="bogus"))
    with pytest.raises(KVTransferError, match=f"version {KV_TRANSFER_VERSION + 1}"):
        dst.add_peer(replace(info, version=KV_TRANSFER_VERSION + 1))
    with pytest.raises(KVTransferError, match=f"'other'.*'{backend_name}'"):
        dst.add_peer(replace(info, backend="other"))
    with pytest.raises(KVTransferError, match="was not added"):
        dst.start_read("x", KVRef("small", "x", (1,), 8), [1])
    dst.add_peer(info)
    with pytest.raises(ValueError, match="1 source blocks but 2"):
        dst.start_read("x", KVRef("small", "x", (1,), 8), [1, 2])
    with pytest.raises(ValueError, match="out of range"):
        dst.start_read("x", KVRef("small", "x", (1,), 8), [NUM_BLOCKS])


def test_source_killed_mid_read_or_before_read_fails_in_bounded_time(backend_name, sources):
    source = sources["killed"]
    io_timeout_s = 2.0
    dst, _ = make_dst(backend_name, SMALL_SPEC, io_timeout_s=io_timeout_s)
    try:
        dst.add_peer(source.info("killed"))
        grant = source.publish("killed", "r", [1, 2])
        src = KVRef("killed", "r", (1, 2), 16, grant)
        assert read(dst, "warm", src, [1, 2]) is DONE
        source.signal(signal.SIGSTOP)
        dst.start_read("in-flight", src, [3, 4])
        time.sleep(0.2)  # 0.2 s in which nothing may happen: the stopped source cannot answer
        assert dst.poll() == {"in-flight": PENDING}
        start_s = time.monotonic()
        source.stop()
        assert wait_terminal(dst, ["in-flight"]) == {"in-flight": FAILED}
        assert time.monotonic() - start_s < io_timeout_s + 1.0
        assert read(dst, "after-death", src, [3, 4]) is FAILED
    finally:
        dst.close()
    fresh, _ = make_dst(backend_name, SMALL_SPEC, engine_id="fresh", io_timeout_s=io_timeout_s)
    try:
        fresh.add_peer(source.info("killed"))
        assert read(fresh, "never-connected", src, [3, 4]) is FAILED
    finally:
        fresh.close()


def test_hung_source_fails_within_io_timeout_and_close_fails_reads_in_flight(backend_name, sources):
    source = sources["hung"]
    dst, _ = make_dst(backend_name, SMALL_SPEC, io_timeout_s=0.5)
    dst.add_peer(source.info("hung"))
    grant = source.publish("hung", "r", [7])
    src = KVRef("hung", "r", (7,), 8, grant)
    assert read(dst, "warm", src, [0]) is DONE
    source.signal(signal.SIGSTOP)
    start_s = time.monotonic()
    assert read(dst, "timed-out", src, [0]) is FAILED
    assert 0.4 < time.monotonic() - start_s < 2.0
    dst.start_read("cut-by-close", src, [1])
    time.sleep(0.05)  # pacing: the read gets on its way to the hung source before close cuts it
    start_s = time.monotonic()
    dst.close()
    assert time.monotonic() - start_s < 1.0
    assert dst.poll() == {"cut-by-close": FAILED}
    assert dst.poll() == {}
    dst.close()  # idempotent
    with pytest.raises(KVTransferError):
        dst.start_read("after-close", src, [1])
    source.stop()


def test_register_rejects_a_cache_on_an_unsupported_device(backend_name):
    backend = make_backend(backend_name, "meta")
    kv_cache = torch.empty((4, *SMALL_SPEC.block_shape), dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="meta"):
        backend.register_kv_cache(kv_cache, SMALL_SPEC)
    backend.close()
