"""vLLM's prefix-cache events become splitserve's: every stored block gets the hash the router
computes for the same tokens and salt (``engine.block_hash``), chained through its parent."""

from __future__ import annotations

import pytest

from engine.block_hash import hash_block_tokens
from engine.block_pool import AllBlocksCleared, BlockRemoved, BlockStored
from engine.vllm_engine.events import EventTranslator

kv_events = pytest.importorskip("vllm.distributed.kv_events")
BLOCK = 4


def _stored(hashes, parent, tokens, salt=None):
    extra = [(salt,) if salt and parent is None and i == 0 else None for i in range(len(hashes))]
    return kv_events.BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BLOCK,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=extra,
    )


def test_a_chain_stored_in_two_events_hashes_as_the_router_does():
    tokens = list(range(100, 112))
    translator = EventTranslator(BLOCK)
    out = translator.translate(
        [
            _stored([b"v1", b"v2"], None, tokens[:8], salt="tenant"),
            _stored([b"v3"], b"v2", tokens[8:]),
        ]
    )
    expected = hash_block_tokens(tokens, BLOCK, "tenant")
    assert out == [
        BlockStored(tuple(expected[:2]), None, BLOCK),
        BlockStored((expected[2],), expected[1], BLOCK),
    ]
    assert translator.live_block_hashes() == expected
    assert expected != hash_block_tokens(tokens, BLOCK)  # the salt is in every block


def test_removal_clear_and_unknown_parents():
    tokens = list(range(8))
    translator = EventTranslator(BLOCK)
    translator.translate([_stored([b"a", b"b"], None, tokens)])
    expected = hash_block_tokens(tokens, BLOCK)
    removed = translator.translate(
        [kv_events.BlockRemoved(block_hashes=[b"b", b"zz"], medium="GPU")]
    )
    assert removed == [BlockRemoved((expected[1],))]
    # A block whose parent's store was never seen is left out: a missed hit, never a false one.
    assert translator.translate([_stored([b"c"], b"never", tokens[:4])]) == []
    assert translator.translate([kv_events.AllBlocksCleared()]) == [AllBlocksCleared()]
    assert translator.live_block_hashes() == []
