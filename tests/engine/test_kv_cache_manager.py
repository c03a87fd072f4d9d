"""The KV cache manager's ownership invariant: the blocks of a request id belong to the
``Request`` that got them until they are freed, so a reused id cannot write into (or free) the
blocks a finished request holds for a KV pull, and a finished request takes no new tokens."""

from __future__ import annotations

import pytest

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from tests.engine.scheduler_script import BLOCK_SIZE, req, tokens


def held_request(manager: KVCacheManager) -> Request:
    """A finished request "A" of 9 tokens whose 3 blocks stay allocated (a lease)."""
    held = req("A", 9).build()
    assert manager.allocate_slots(held, 9)
    held.num_computed_tokens = 9
    held.status = RequestStatus.FINISHED_LENGTH_CAPPED
    return held


def test_a_reused_id_cannot_extend_cache_or_free_the_blocks_of_another_request() -> None:
    manager = KVCacheManager(8, BLOCK_SIZE, enable_prefix_caching=True)
    held = held_request(manager)
    block_ids = manager.get_block_ids("A")
    cached = [manager.block_pool.get_cached_block(h) for h in held.block_hashes]
    reused = req("A", (*tokens(2, 8), 1)).build()
    with pytest.raises(RuntimeError, match="reused"):
        manager.allocate_slots(reused, 9)
    with pytest.raises(RuntimeError, match="reused"):
        manager.cache_blocks(reused, 9)
    with pytest.raises(RuntimeError, match="reused"):
        manager.free(reused)
    assert manager.get_block_ids("A") == block_ids
    assert [manager.block_pool.get_cached_block(h) for h in held.block_hashes] == cached
    assert manager.block_pool.num_free_blocks == 8 - len(block_ids)
    manager.check_integrity()
    manager.free(held)
    assert manager.allocate_slots(reused, 9)  # free again: the id is the new request's
    manager.check_integrity()


def test_a_finished_request_cannot_extend_its_held_blocks() -> None:
    manager = KVCacheManager(8, BLOCK_SIZE, enable_prefix_caching=True)
    held = held_request(manager)
    with pytest.raises(RuntimeError, match="finished"):
        manager.allocate_slots(held, 4)
    assert len(manager.get_block_ids("A")) == 3
