"""The engine with a second KV tier: evicted prefixes come back from it with the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLMEngine, SamplingParams
from engine.block_hash import hash_block_tokens
from engine.block_pool import BlockRemoved, BlockStored, KVMedium
from engine.config import EngineConfig
from engine.kv_offload import KVOffload
from engine.kv_tier import DiskKVTier
from engine.outputs import RequestOutput
from tests.engine.test_engine import random_prompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
# 11 blocks per request in a 24-block cache: three other prompts evict all of a first one's.
PROMPT_TOKENS = 160
NUM_KV_BLOCKS = 24
TIER_HIT_TOKENS = (PROMPT_TOKENS - 1) // 16 * 16


def make_engine(model_dir: Path, tier_dir: Path | None, **overrides: object) -> LLMEngine:
    kwargs: dict[str, object] = {
        "model": str(model_dir),
        "dtype": "float32",
        "num_kv_blocks": NUM_KV_BLOCKS,
        "max_model_len": 320,
        "kv_offload_gib": 0.05,
        "kv_offload_dir": None if tier_dir is None else str(tier_dir),
        "check_kv_integrity": True,
        **overrides,
    }
    return LLMEngine(EngineConfig(**kwargs))  # type: ignore[arg-type]


def generate(engine: LLMEngine, req_id: str, prompt: list[int], salt: str = "") -> RequestOutput:
    engine.add_request(req_id, prompt, GREEDY, cache_salt=salt)
    finished: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    (out,) = finished
    return out


def offload_of(engine: LLMEngine) -> KVOffload:
    offload = engine.kv_cache_manager.offload
    assert offload is not None
    return offload


def evict_with_other_prompts(engine: LLMEngine, seed: int) -> None:
    for i in range(3):
        generate(engine, f"evict-{seed}-{i}", random_prompt(PROMPT_TOKENS, seed=seed + i))


@pytest.mark.parametrize("tier", ["disk", "host"])
def test_an_evicted_prefix_comes_back_from_the_tier_with_the_same_tokens(
    tiny_llama_dir, tmp_path, tier
):
    engine = make_engine(tiny_llama_dir, tmp_path if tier == "disk" else None)
    prompt = random_prompt(PROMPT_TOKENS, seed=100)
    cold = generate(engine, "cold", prompt)
    evict_with_other_prompts(engine, seed=200)
    pool = engine.kv_cache_manager.block_pool
    assert pool.get_cached_block(hash_block_tokens(prompt, 16)[0]) is None
    counters = offload_of(engine).tier.counters
    assert counters.num_stored >= TIER_HIT_TOKENS // 16
    hits_before = counters.num_hits
    warm = generate(engine, "warm", prompt)
    assert warm.token_ids == cold.token_ids
    assert warm.num_cached_tokens == TIER_HIT_TOKENS  # none of it from the engine's cache
    assert counters.num_hits - hits_before == TIER_HIT_TOKENS // 16
    stats = engine.stats()
    assert stats.num_tier_hit_blocks == counters.num_hits
    assert 0 < stats.num_tier_blocks <= stats.num_tier_stored_blocks
    # The loaded blocks are in the cache again: the next run hits there, not in the tier.
    again = generate(engine, "again", prompt)
    assert (again.token_ids, again.num_cached_tokens) == (cold.token_ids, TIER_HIT_TOKENS)
    assert counters.num_hits - hits_before == TIER_HIT_TOKENS // 16


def test_the_disk_tier_serves_a_restarted_worker(tiny_llama_dir, tmp_path):
    prompt = random_prompt(PROMPT_TOKENS, seed=300)
    first = make_engine(tiny_llama_dir, tmp_path)
    cold = generate(first, "cold", prompt)
    evict_with_other_prompts(first, seed=400)
    offload_of(first).close()
    restarted = make_engine(tiny_llama_dir, tmp_path)
    warm = generate(restarted, "warm", prompt)
    assert (warm.token_ids, warm.num_cached_tokens) == (cold.token_ids, TIER_HIT_TOKENS)
    offload_of(restarted).close()


def test_a_corrupted_tier_block_is_recomputed_with_the_same_tokens(tiny_llama_dir, tmp_path):
    engine = make_engine(tiny_llama_dir, tmp_path)
    prompt = random_prompt(PROMPT_TOKENS, seed=500)
    cold = generate(engine, "cold", prompt)
    evict_with_other_prompts(engine, seed=600)
    tier = offload_of(engine).tier
    assert isinstance(tier, DiskKVTier)
    tier.close()  # every queued block is on disk now
    reopened = make_engine(tiny_llama_dir, tmp_path)
    damaged_tier = offload_of(reopened).tier
    assert isinstance(damaged_tier, DiskKVTier)
    # Damage the prompt's fourth block: the first three load, the rest is recomputed.
    name = hash_block_tokens(prompt, 16)[3].hex()
    path = damaged_tier.directory / name[:2] / f"{name}.kv"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    warm = generate(reopened, "warm", prompt)
    assert warm.token_ids == cold.token_ids
    assert warm.num_cached_tokens == 3 * 16
    assert damaged_tier.counters.num_refused == 1
    damaged_tier.close()


def test_two_salts_never_read_each_others_tier_blocks(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, None)
    prompt = random_prompt(PROMPT_TOKENS, seed=700)
    cold = generate(engine, "a", prompt, salt="tenant-a")
    evict_with_other_prompts(engine, seed=800)
    counters = offload_of(engine).tier.counters
    hits = counters.num_hits
    other = generate(engine, "b", prompt, salt="tenant-b")
    assert (other.token_ids, other.num_cached_tokens) == (cold.token_ids, 0)
    assert counters.num_hits == hits
    same = generate(engine, "a2", prompt, salt="tenant-a")
    assert (same.token_ids, same.num_cached_tokens) == (cold.token_ids, TIER_HIT_TOKENS)


def test_an_unusable_tier_directory_is_a_clear_error(tiny_llama_dir, tmp_path):
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    with pytest.raises(ValueError, match=r"--kv-offload-dir .*file"):
        make_engine(tiny_llama_dir, not_a_directory / "tier")


def test_kv_offload_flags_are_checked():
    with pytest.raises(ValueError, match="kv_offload_dir needs kv_offload_gib"):
        EngineConfig(model="m", kv_offload_dir="/tmp/x")
    with pytest.raises(ValueError, match="engine has none here"):
        EngineConfig(model="m", engine="vllm", kv_offload_gib=1.0)
    with pytest.raises(ValueError, match="kv_offload_gib must be >= 0"):
        EngineConfig(model="m", kv_offload_gib=-1.0)


def test_kv_events_report_the_blocks_held_in_the_cache_or_the_tier(tiny_llama_dir):
    """Replaying the events gives, after every step, exactly what a prefix hit can use and where
    it is, so the router's index keeps sending a conversation to the worker whose tier holds it
    and prices the hit as a load; a tier too small for everything reports the blocks it drops."""
    block_bytes = make_engine(tiny_llama_dir, None).kv_cache_spec.block_bytes
    # A tier of 12 blocks, about one request's: the rest of what is evicted is dropped.
    engine = make_engine(tiny_llama_dir, None, kv_offload_gib=12 * block_bytes / 2**30)
    offload = offload_of(engine)
    held: dict[bytes, KVMedium] = {}
    media_seen: set[KVMedium] = set()
    prompts = [random_prompt(PROMPT_TOKENS, seed=900 + i) for i in range(5)]
    for i, prompt in enumerate([*prompts, prompts[-2]]):
        engine.add_request(f"r{i}", prompt, GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
            for event in engine.take_kv_cache_events():
                if isinstance(event, BlockStored):
                    held.update(dict.fromkeys(event.block_hashes, event.medium))
                    media_seen.add(event.medium)
                elif isinstance(event, BlockRemoved):
                    for block_hash in event.block_hashes:
                        held.pop(block_hash, None)
                else:
                    held.clear()
            assert held == engine.prefix_cache_blocks()
    assert media_seen == set(KVMedium)
    assert offload.tier.counters.num_evicted > 0  # the tier dropped blocks, and said so
    loaded_back = hash_block_tokens(prompts[-2], 16)[:9]
    assert all(held[h] is KVMedium.CACHE for h in loaded_back)  # back from the tier
    assert not set(hash_block_tokens(prompts[0], 16)) & held.keys()  # evicted from both
    in_tier = {h for h, medium in held.items() if medium is KVMedium.TIER}
    assert in_tier and in_tier <= set(offload.tier.hashes())
    assert not in_tier & set(engine.kv_cache_manager.block_pool.block_hashes())
