"""The inproc backend between two engines of this process."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from engine.kv_cache_spec import KVCacheSpec, KVLayout
from kvtransfer.base import KVRef, KVTransferError, TransferState
from kvtransfer.inproc import InprocBackend

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="bfloat16")
NUM_BLOCKS = 64
_engine_ids = itertools.count()


def rows(kv_cache: torch.Tensor) -> torch.Tensor:
    return kv_cache.view(torch.uint8).view(kv_cache.shape[0], -1)


class Pair:
    """A source and a destination engine, each with its own cache, already paired."""

    def __init__(self) -> None:
        n = next(_engine_ids)
        self.src = InprocBackend(f"src-{n}")
        self.dst = InprocBackend(f"dst-{n}")
        generator = torch.Generator().manual_seed(n)
        shape = (NUM_BLOCKS, *SPEC.block_shape)
        self.src_cache = torch.randn(shape, generator=generator).to(torch.bfloat16)
        self.dst_cache = torch.zeros(shape, dtype=torch.bfloat16)
        self.src_info = self.src.register_kv_cache(self.src_cache, SPEC)
        self.dst.register_kv_cache(self.dst_cache, SPEC)
        self.dst.add_peer(self.src_info)

    def ref(self, req_id: str, block_ids: tuple[int, ...], grant: bytes) -> KVRef:
        num_tokens = len(block_ids) * SPEC.block_size
        return KVRef(self.src.engine_id, req_id, block_ids, num_tokens, grant)


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.dst.close()
    p.src.close()


def test_read_copies_reordered_blocks_bit_exactly_and_reports_once(pair: Pair):
    src_ids, dst_ids = (9, 3, 4, 60), [0, 31, 32, 1]
    grant = pair.src.publish("r", src_ids)
    pair.dst.start_read("dst-r", pair.ref("r", src_ids, grant), dst_ids)
    assert pair.dst.poll() == {"dst-r": TransferState.DONE}
    assert pair.dst.poll() == {}
    assert torch.equal(rows(pair.dst_cache)[dst_ids], rows(pair.src_cache)[list(src_ids)])
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
    assert not rows(pair.dst_cache)[untouched].any()


def test_unpublished_request_or_block_fails(pair: Pair):
    pair.dst.start_read("a", pair.ref("nothing", (1,), b""), [1])
    grant = pair.src.publish("r", [1, 2])
    pair.dst.start_read("b", pair.ref("r", (1, 3), grant), [1, 3])
    pair.src.unpublish("r")
    pair.src.unpublish("unknown")  # ignored
    pair.dst.start_read("c", pair.ref("r", (1,), grant), [1])
    assert pair.dst.poll() == dict.fromkeys("abc", TransferState.FAILED)
    assert not rows(pair.dst_cache).any()


def test_release_reaches_take_released_and_unpublishes(pair: Pair):
    grant = pair.src.publish("r", [5])
    pair.dst.start_read("dst-r", pair.ref("r", (5,), grant), [0])
    assert pair.dst.poll() == {"dst-r": TransferState.DONE}
    pair.dst.release("dst-r")
    pair.dst.release("dst-r")  # a second release is ignored
    assert pair.src.take_released() == ["r"]
    assert pair.src.take_released() == []
    pair.dst.start_read("again", pair.ref("r", (5,), grant), [0])
    assert pair.dst.poll() == {"again": TransferState.FAILED}


def test_reads_and_releases_need_the_publication_grant(pair: Pair):
    grant = pair.src.publish("r", [5])
    pair.dst.start_read("forged", pair.ref("r", (5,), bytes(len(grant))), [0])
    assert pair.dst.poll() == {"forged": TransferState.FAILED}
    assert not rows(pair.dst_cache).any()
    pair.dst.release("forged")  # presents the forged grant: ignored
    assert pair.src.take_released() == []
    pair.dst.start_read("granted", pair.ref("r", (5,), grant), [0])
    assert pair.dst.poll() == {"granted": TransferState.DONE}
    assert torch.equal(rows(pair.dst_cache)[0], rows(pair.src_cache)[5])


def test_pairing_errors(pair: Pair):
    with pytest.raises(KVTransferError, match=f"'bogus'.*{SPEC.compat_hash()}"):
        pair.dst.add_peer(replace(pair.src_info, compat_hash="bogus"))
    with pytest.raises(KVTransferError, match="not in this process"):
        pair.dst.add_peer(replace(pair.src_info, address="pid:0"))
    with pytest.raises(KVTransferError, match="already registered"):
        InprocBackend(pair.src.engine_id).register_kv_cache(pair.dst_cache, SPEC)
    with pytest.raises(KVTransferError, match="was not added"):
        pair.dst.start_read("x", KVRef("stranger", "x", (1,), 4), [1])
    with pytest.raises(ValueError, match="out of range"):
        pair.src.publish("x", [NUM_BLOCKS])
    with pytest.raises(ValueError, match="dtype"):
        InprocBackend("f32").register_kv_cache(pair.dst_cache.float(), SPEC)


def test_closed_source_fails_reads_and_close_is_idempotent(pair: Pair):
    grant = pair.src.publish("r", [5])
    pair.src.close()
    pair.src.close()
    pair.dst.start_read("dst-r", pair.ref("r", (5,), grant), [0])
    assert pair.dst.poll() == {"dst-r": TransferState.FAILED}
    pair.dst.release("dst-r")  # the source is gone: nothing to tell
    pair.dst.close()
    pair.dst.close()
    with pytest.raises(KVTransferError):
        pair.dst.start_read("late", pair.ref("r", (5,), grant), [0])


def test_layer_major_caches_of_different_sizes_move_every_layer_of_each_block():
    """vLLM's CPU layout (one region per layer): a 64-block source into a 24-block destination
    writes each requested block's every layer, and nothing else; a cache that is not in the
    spec's memory order is refused."""
    spec = replace(SPEC, layout=KVLayout.VLLM_CPU)
    n = next(_engine_ids)
    src, dst = InprocBackend(f"src-{n}"), InprocBackend(f"dst-{n}")
    values = torch.randn(
        (NUM_BLOCKS, *spec.block_shape), generator=torch.Generator().manual_seed(n)
    )
    src_cache = values.to(torch.bfloat16).transpose(0, 1).contiguous().transpose(0, 1)
    dst_cache = torch.zeros((24, *spec.block_shape), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="layer-major"):
        dst.register_kv_cache(dst_cache, spec)
    dst_cache = dst_cache.transpose(0, 1).contiguous().transpose(0, 1)
    try:
        dst.register_kv_cache(dst_cache, spec)
        dst.add_peer(src.register_kv_cache(src_cache, spec))
        src_ids, dst_ids = (62, 63, 0, 17), [22, 23, 1, 0]
        grant = src.publish("r", src_ids)
        dst.start_read("dst-r", KVRef(src.engine_id, "r", src_ids, 16, grant), dst_ids)
        assert dst.poll() == {"dst-r": TransferState.DONE}
        assert torch.equal(dst_cache[dst_ids], src_cache[list(src_ids)])
        untouched = [b for b in range(24) if b not in dst_ids]
        assert not dst_cache[untouched].any()
    finally:
        dst.close()
        src.close()
