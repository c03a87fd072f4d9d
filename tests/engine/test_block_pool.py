from __future__ import annotations

import random

import pytest

from engine.block_pool import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    DoubleFreeError,
    NoFreeBlocksError,
)


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_unhashed_blocks_are_reused_before_cached_ones():
    pool = BlockPool(4, block_size=16)
    a, b = pool.allocate(2)
    pool.cache_blocks([a], [h(1)], None)
    pool.free([a, b])
    (c,) = pool.allocate(1)
    assert c is not a  # b (unhashed) or a never-used block comes first
    assert pool.get_cached_block(h(1)) is a
    pool.check_integrity()


def test_lru_eviction_order_and_events():
    pool = BlockPool(3, block_size=16)
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks, [h(1), h(2), h(3)], None)
    assert pool.take_events() == [BlockStored((h(1), h(2), h(3)), None, 16)]
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[2]])
    (first,) = pool.allocate(1)
    assert first is blocks[1]  # released first, evicted first
    assert pool.take_events() == [BlockRemoved((h(2),))]
    assert pool.get_cached_block(h(2)) is None
    pool.check_integrity()


def test_touch_revives_cached_block_and_protects_it_from_eviction():
    pool = BlockPool(2, block_size=16)
    a, b = pool.allocate(2)
    pool.cache_blocks([a], [h(7)], None)
    pool.free([a, b])
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    assert pool.allocate(1) == [b]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.check_integrity()


def test_duplicate_hash_keeps_first_copy():
    pool = BlockPool(2, block_size=16)
    a, b = pool.allocate(2)
    pool.cache_blocks([a], [h(5)], None)
    pool.cache_blocks([b], [h(5)], None)
    assert pool.get_cached_block(h(5)) is a and b.block_hash is None
    pool.check_integrity()


def test_double_free_is_refused_and_changes_nothing():
    pool = BlockPool(3, block_size=16)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(DoubleFreeError):
        pool.free([b, a])
    with pytest.raises(DoubleFreeError):
        pool.free([b, b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.check_integrity()


def test_uncache_withdraws_cached_and_in_use_blocks_from_prefix_hits():
    pool = BlockPool(3, block_size=16)
    a, b = pool.allocate(2)
    pool.cache_blocks([a, b], [h(1), h(2)], None)
    pool.free([a])
    pool.take_events()
    pool.uncache([a, b])
    assert pool.get_cached_block(h(1)) is None and pool.get_cached_block(h(2)) is None
    assert pool.take_events() == [BlockRemoved((h(1), h(2)))]
    assert pool.num_cached_blocks == 0 and b.ref_cnt == 1
    pool.free([b])
    assert pool.num_free_blocks == 3 and pool.num_cached_blocks == 0
    pool.check_integrity()


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2, block_size=16)
    (a,) = pool.allocate(1)
    pool.cache_blocks([a], [h(9)], None)
    assert not pool.reset_prefix_cache()
    pool.free([a])
    pool.take_events()
    assert pool.reset_prefix_cache()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.get_cached_block(h(9)) is None
    pool.check_integrity()


def test_random_operations_keep_integrity():
    rng = random.Random(0)
    pool = BlockPool(32, block_size=16)
    held: list = []
    next_hash = 0
    for _ in range(2000):
        op = rng.random()
        if op < 0.4 and pool.num_free_blocks:
            held.extend(pool.allocate(rng.randint(1, min(4, pool.num_free_blocks))))
        elif op < 0.6 and held:
            block = rng.choice(held)
            next_hash += 1
            pool.cache_blocks([block], [h(next_hash)], None)
        elif op < 0.75 and held:
            cached = [b for b in pool.blocks if b.block_hash is not None]
            if cached:
                block = rng.choice(cached)
                pool.touch([block])
                held.append(block)
        elif held:
            block = held.pop(rng.randrange(len(held)))
            pool.free([block])
        pool.check_integrity()
