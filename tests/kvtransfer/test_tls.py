"""Mutual TLS on the ``tcp`` and ``ucx`` KV transfer backends, between real processes: a read
under the cluster CA is bit-exact; a reader or a source outside the cluster (no TLS, a
certificate another CA signed, a cluster certificate of the wrong identity) moves no block and,
for a source, never receives the grant."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtransfer.base import KVRef
from kvtransfer.registry import TLS_BACKENDS, is_available, make_backend
from kvtransfer.tls import KVTransferTls
from services.certs import write_cluster_certs
from tests.kvtransfer.harness import (
    DONE,
    FAILED,
    SMALL_SPEC,
    SourceProcess,
    make_cache,
    make_dst,
    read,
    rows,
)

HOSTS = ["localhost", "127.0.0.1"]
SRC_IDS, DST_IDS = [3, 4, 5, 20], [10, 11, 12, 40]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The cluster's certificates, and a second CA's (a rogue one) with the same identities."""
    root = tmp_path_factory.mktemp("kv-certs")
    rogue = tmp_path_factory.mktemp("kv-rogue-certs")
    write_cluster_certs(root, HOSTS)
    write_cluster_certs(rogue, HOSTS)
    return root, rogue


def material(cert_root: Path, identity: str, peer: str, ca_root: Path) -> KVTransferTls:
    """``identity``'s certificate from ``cert_root``, trusting ``ca_root``'s CA, pairing with
    ``peer``."""
    own = KVTransferTls.from_dir(cert_root / identity, {peer})
    return KVTransferTls(own.cert_file, own.key_file, str(ca_root / "ca.crt"), own.peer_names)


@pytest.fixture(scope="module", params=[name for name in TLS_BACKENDS if is_available(name)])
def backend_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def sources(backend_name: str, certs: tuple[Path, Path]) -> Iterator[dict[str, SourceProcess]]:
    """``prefill``: the cluster's source; ``rogue`` and ``router``: impostors presenting a
    prefill certificate of another CA, and the cluster's router certificate."""
    root, rogue = certs
    procs = {
        "prefill": SourceProcess(
            backend_name,
            [("prefill", SMALL_SPEC, 1)],
            tls=material(root, "prefill", "decode", root),
        ),
        "rogue": SourceProcess(
            backend_name, [("rogue", SMALL_SPEC, 2)], tls=material(rogue, "prefill", "decode", root)
        ),
        "router": SourceProcess(
            backend_name, [("router", SMALL_SPEC, 3)], tls=material(root, "router", "decode", root)
        ),
    }
    yield procs
    for proc in procs.values():
        proc.stop()


def test_a_read_under_the_cluster_ca_is_bit_exact_and_released(backend_name, sources, certs):
    root, _ = certs
    source = sources["prefill"]
    dst, dst_cache = make_dst(
        backend_name, SMALL_SPEC, tls=material(root, "decode", "prefill", root)
    )
    try:
        dst.add_peer(source.info("prefill"))
        grant = source.publish("prefill", "sealed", SRC_IDS)
        src = KVRef("prefill", "sealed", tuple(SRC_IDS), 32, grant)
        assert read(dst, "r0", src, DST_IDS) is DONE
        expected = rows(make_cache(SMALL_SPEC, seed=1))[SRC_IDS]
        assert torch.equal(rows(dst_cache)[DST_IDS], expected)
        dst.release("r0")
        assert source.wait_released("prefill") == ["sealed"]
    finally:
        dst.close()


@pytest.mark.parametrize("reader", ["plaintext", "another CA", "the router's certificate"])
def test_a_reader_outside_the_cluster_moves_no_block_even_with_the_grant(
    backend_name, sources, certs, reader
):
    root, rogue = certs
    tls = {
        "plaintext": None,
        "another CA": material(rogue, "decode", "prefill", root),
        "the router's certificate": material(root, "router", "prefill", root),
    }[reader]
    source = sources["prefill"]
    grant = source.publish("prefill", f"kept-{reader}", SRC_IDS)
    src = KVRef("prefill", f"kept-{reader}", tuple(SRC_IDS), 32, grant)
    dst, dst_cache = make_dst(backend_name, SMALL_SPEC, engine_id=f"dst-{reader}", tls=tls)
    try:
        dst.add_peer(source.info("prefill"))
        assert read(dst, "r0", src, DST_IDS) is FAILED
        assert not rows(dst_cache).any()
        dst.release("r0")
    finally:
        dst.close()
    # The publication is intact: the cluster's own reader still gets it (and nothing was freed).
    decode, decode_cache = make_dst(
        backend_name, SMALL_SPEC, tls=material(root, "decode", "prefill", root)
    )
    try:
        decode.add_peer(source.info("prefill"))
        assert read(decode, "r1", src, DST_IDS) is DONE
        assert torch.equal(
            rows(decode_cache)[DST_IDS], rows(make_cache(SMALL_SPEC, seed=1))[SRC_IDS]
        )
    finally:
        decode.close()
    assert source.take_released("prefill") == []
    source.unpublish("prefill", f"kept-{reader}")


@pytest.mark.parametrize("impostor", ["rogue", "router"])
def test_a_source_outside_the_cluster_is_never_sent_a_read(backend_name, sources, certs, impostor):
    """The impostor publishes the blocks and the destination holds the impostor's own grant:
    had the destination sent the read, the impostor would have served it (DONE)."""
    root, _ = certs
    source = sources[impostor]
    info = source.info(impostor)
    grant = source.publish(impostor, "bait", SRC_IDS)
    dst, dst_cache = make_dst(
        backend_name, SMALL_SPEC, tls=material(root, "decode", "prefill", root)
    )
    try:
        dst.add_peer(info)
        assert (
            read(dst, "r0", KVRef(impostor, "bait", tuple(SRC_IDS), 32, grant), DST_IDS) is FAILED
        )
        assert not rows(dst_cache).any()
    finally:
        dst.close()


def test_material_is_checked_when_the_backend_is_built(tmp_path, certs):
    root, _ = certs
    with pytest.raises(ValueError, match="no file"):
        KVTransferTls.from_dir(tmp_path, {"prefill"})
    with pytest.raises(ValueError, match="at least one peer"):
        KVTransferTls.from_dir(root / "decode", ())
    tls = KVTransferTls.from_dir(root / "decode", {"prefill"})
    with pytest.raises(ValueError, match="has no TLS"):
        make_backend("inproc", "e0", tls=tls)
