"""``loadtest.bench.multi_turn`` end to end at a small size, on the tiny model: conversations
whose histories the cache cannot keep are recomputed without a tier and loaded from the disk
tier with one; with peer pulls the prefill worker pulls the replies (and histories) its decode
worker holds instead of computing them."""

from __future__ import annotations

import argparse

from engine.config import EngineConfig
from loadtest.bench.multi_turn import run_arm
from loadtest.generator.conversations import Conversation


def test_the_tier_and_peer_arms_recompute_less_of_later_turns(tiny_llama_dir, tmp_path) -> None:
    engine = EngineConfig(
        model=str(tiny_llama_dir),
        dtype="float32",
        # 24 blocks of 16 tokens: three conversations in flight of up to ~10 blocks each
        # evict each other's history between turns.
        num_kv_blocks=24,
        max_model_len=384,
        num_threads=1,
    )
    words = [f"w{i}" for i in range(400)]
    conversations = [
        Conversation(tuple(" ".join(words[c * 50 + t * 15 :][:15]) for t in range(3)))
        for c in range(6)
    ]
    args = argparse.Namespace(
        out=tmp_path,
        tier_gib=0.05,
        prefill_workers=1,
        decode_workers=1,
        # The decode worker's cache is not what is measured: room for every conversation.
        decode_num_kv_blocks=96,
        users=3,
        turns=3,
        reply_tokens=8,
        think_time_s=0.0,
        seed=0,
    )
    cache = run_arm("cache", engine, args, conversations)
    tier = run_arm("tier", engine, args, conversations)
    peer = run_arm("peer", engine, args, conversations)
    for arm in (cache, tier, peer):
        assert arm["first_turn"]["num_errors"] == arm["later_turns"]["num_errors"] == 0
        assert arm["later_turns"]["num_turns"] == 6 * 2
    assert cache["tier_tokens"] == cache["peer_tokens"] == tier["peer_tokens"] == 0
    assert tier["tier_tokens"] > 0
    assert peer["peer_tokens"] > 0 and peer["tier_tokens"] == 0
    assert peer["later_turns_computed_tokens"] < cache["later_turns_computed_tokens"]
    assert tier["later_turns"]["prompt_tokens"] == cache["later_turns"]["prompt_tokens"]
    assert tier["later_turns_computed_tokens"] < cache["later_turns_computed_tokens"]
    assert (
        tier["later_turns_history_recomputed_tokens"]
        < cache["later_turns_history_recomputed_tokens"]
    )
    assert sorted(tier["per_turn"], key=lambda t: t["turns"])[0]["turns"] == "1"
