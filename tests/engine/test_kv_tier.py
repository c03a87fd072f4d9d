"""The second KV tier's stores: bytes kept and checked, bounded, rebuilt after a restart."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from engine.kv_tier import (
    HEADER_BYTES,
    DiskKVTier,
    HostKVTier,
    TierIdentity,
    TierLockedError,
    model_fingerprint,
)

BLOCK_BYTES = 4096
IDENTITY = TierIdentity("model-a", "float32", "layout-1")


def block(i: int) -> tuple[bytes, bytes]:
    """A block hash and a payload that differ for every ``i``."""
    block_hash = hashlib.sha256(f"block {i}".encode()).digest()
    return block_hash, (hashlib.sha256(block_hash).digest() * (BLOCK_BYTES // 32))


def open_disk(root: Path, num_blocks: int = 8, identity: TierIdentity = IDENTITY) -> DiskKVTier:
    return DiskKVTier(root, num_blocks * (HEADER_BYTES + BLOCK_BYTES), BLOCK_BYTES, identity)


def block_file(tier: DiskKVTier, block_hash: bytes) -> Path:
    name = block_hash.hex()
    return tier.directory / name[:2] / f"{name}.kv"


def test_disk_block_read_back_is_bit_identical_before_and_after_its_write(tmp_path):
    tier = open_disk(tmp_path)
    block_hash, payload = block(0)
    assert tier.put(block_hash, payload)
    assert tier.get(block_hash) == payload  # served from memory or the file, either way equal
    tier.flush()
    assert block_file(tier, block_hash).stat().st_size == HEADER_BYTES + BLOCK_BYTES
    assert tier.get(block_hash) == payload  # from the file now
    tier.close()
    reopened = open_disk(tmp_path)
    assert reopened.get(block_hash) == payload
    assert reopened.counters.num_hits == 1
    reopened.close()


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "another model's header"])
def test_a_damaged_block_file_is_refused_deleted_and_reported_as_a_miss(tmp_path, damage):
    tier = open_disk(tmp_path)
    block_hash, payload = block(1)
    tier.put(block_hash, payload)
    tier.close()
    path = block_file(tier, block_hash)
    data = bytearray(path.read_bytes())
    if damage == "flip a payload byte":
        data[HEADER_BYTES + 100] ^= 0x01
    elif damage == "truncate":
        data = data[: len(data) - 7]
    else:
        other = open_disk(tmp_path / "other", identity=TierIdentity("model-b", "float32", "l"))
        other.put(block_hash, payload)
        other.close()
        data = bytearray(block_file(other, block_hash).read_bytes())
    reopened = open_disk(tmp_path)
    path.write_bytes(bytes(data))  # damaged after the index was rebuilt: the read must catch it
    assert reopened.get(block_hash) is None
    assert not path.exists()
    assert block_hash not in reopened
    assert reopened.counters.num_refused == 1
    reopened.close()


def test_another_identity_sees_none_of_the_blocks(tmp_path):
    tier = open_disk(tmp_path)
    block_hash, payload = block(2)
    tier.put(block_hash, payload)
    tier.close()
    other = open_disk(tmp_path, identity=TierIdentity("model-a", "bfloat16", "layout-1"))
    assert block_hash not in other
    assert other.get(block_hash) is None
    other.close()


@pytest.mark.parametrize("kind", ["disk", "host"])
def test_the_tier_keeps_its_most_recently_used_blocks_within_capacity(tmp_path, kind):
    tier = open_disk(tmp_path, 4) if kind == "disk" else HostKVTier(4 * BLOCK_BYTES, BLOCK_BYTES)
    for i in range(4):
        tier.put(*block(i))
    assert tier.get(block(0)[0]) == block(0)[1]  # block 0 is now the most recent
    tier.put(*block(4))
    tier.put(*block(5))
    held = [i for i in range(6) if block(i)[0] in tier]
    assert held == [0, 3, 4, 5]
    assert tier.used_bytes <= tier.capacity_bytes
    assert tier.counters.num_evicted == 2
    tier.close()
    if isinstance(tier, DiskKVTier):
        files = sorted(p.name for p in tier.directory.glob("*/*.kv"))
        assert files == sorted(f"{block(i)[0].hex()}.kv" for i in held)


def test_a_restart_rebuilds_the_index_oldest_first_and_drops_partial_writes(tmp_path):
    tier = open_disk(tmp_path, 4)
    for i in range(3):
        tier.put(*block(i))
    tier.close()
    for i in range(3):  # written in this order: block 0 is the oldest
        os.utime(block_file(tier, block(i)[0]), (1_000 + i, 1_000 + i))
    partial = block_file(tier, block(0)[0]).with_suffix(".tmp")
    partial.write_bytes(b"half a block")
    reopened = open_disk(tmp_path, 4)
    assert not partial.exists()
    assert all(block(i)[0] in reopened for i in range(3))
    reopened.put(*block(3))
    reopened.put(*block(4))  # evicts the oldest file, block 0
    assert block(0)[0] not in reopened
    assert not block_file(reopened, block(0)[0]).exists()
    assert reopened.get(block(1)[0]) == block(1)[1]
    reopened.close()


def test_workers_sharing_a_directory_take_a_slot_each_and_a_restart_finds_one(
    tmp_path, monkeypatch
):
    first, second = open_disk(tmp_path), open_disk(tmp_path)
    assert first.directory != second.directory
    block_hash, payload = block(7)
    second.put(block_hash, payload)
    second.close()
    restarted = open_disk(tmp_path)  # the slot the second worker left, with its blocks
    assert restarted.directory == second.directory
    assert restarted.get(block_hash) == payload
    monkeypatch.setattr("engine.kv_tier.MAX_SLOTS", 2)
    with pytest.raises(TierLockedError, match="--kv-offload-dir"):
        open_disk(tmp_path)
    first.close()
    restarted.close()


def test_model_fingerprint_tells_checkpoints_of_one_architecture_apart(tmp_path):
    for name, fill in (("a", b"\x01"), ("b", b"\x02")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"hidden_size": 8}')
        weights = bytearray(fill * (3 * 2**20))
        (tmp_path / name / "model.safetensors").write_bytes(bytes(weights))
    same = tmp_path / "a-copy"
    same.mkdir()
    for path in (tmp_path / "a").iterdir():
        (same / path.name).write_bytes(path.read_bytes())
    assert model_fingerprint(tmp_path / "a") == model_fingerprint(same)
    assert model_fingerprint(tmp_path / "a") != model_fingerprint(tmp_path / "b")
