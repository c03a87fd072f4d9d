"""Engine behaviour: prefix caching, integrity, abort, seeds, stop strings, external KV."""

from __future__ import annotations

import random

import pytest

from engine import LLM, LLMEngine, SamplingParams
from engine.config import EngineConfig
from engine.kv_cache_manager import cdiv
from engine.scheduler import DuplicateRequestError
from tests.engine.test_generate_vs_hf import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=128)


def random_prompt(n: int, seed: int, vocab: int = 400) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def run_checked(engine: LLMEngine) -> dict[str, list[int]]:
    """Step until idle, checking block-pool integrity after every step."""
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.req_id] = out.token_ids
        engine.kv_cache_manager.check_integrity()
    return tokens


def test_integrity_holds_after_every_step(tiny_llama_dir):
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir),
            dtype="float32",
            num_kv_blocks=20,
            max_model_len=320,
            max_num_batched_tokens=40,
            max_num_seqs=4,
        )
    )
    for i in range(10):
        engine.add_request(str(i), random_prompt(10 + 9 * i, seed=i % 3), GREEDY)
    tokens = run_checked(engine)
    assert len(tokens) == 10
    pool = engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks


def test_prefix_cache_hit_matches_cold_run_and_reports_cached_tokens(llm, tiny_llama_dir):
    shared = random_prompt(50, seed=1)
    first = shared + random_prompt(7, seed=2)
    second = shared + random_prompt(9, seed=3)
    llm.generate([first], GREEDY)
    out = llm.generate([second], GREEDY)[0]
    assert out.num_cached_tokens == 48  # three full 16-token blocks of the shared prefix
    assert out.token_ids == hf_greedy(tiny_llama_dir, [second], GREEDY.max_tokens)[0]


def test_identical_prompt_hits_all_but_last_block(llm):
    prompt = random_prompt(64, seed=11)
    cold = llm.generate([prompt], GREEDY)[0]
    warm = llm.generate([prompt], GREEDY)[0]
    assert warm.token_ids == cold.token_ids
    assert warm.num_cached_tokens == 48  # the last token is always recomputed for its logits


def test_cache_salt_separates_prefix_caches(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64))
    prompt = random_prompt(64, seed=21)

    def run(req_id: str, salt: str) -> tuple[list[int], int]:
        engine.add_request(req_id, prompt, GREEDY, cache_salt=salt)
        while engine.has_unfinished_requests():
            finished = [o for o in engine.step() if o.finished]
        return finished[0].token_ids, finished[0].num_cached_tokens

    cold, cold_cached = run("a", "tenant-a")
    assert cold_cached == 0
    assert run("b", "tenant-b") == (cold, 0)  # another salt: no hit, same math
    assert run("c", "") == (cold, 0)  # no salt is a salt of its own
    assert run("a2", "tenant-a") == (cold, 48)  # the same salt hits


def test_queued_prefill_tokens_leave_out_prefix_hits_of_waiting_requests(tiny_llama_dir):
    """The load a worker reports counts what it will compute, not what its cache holds."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64))
    shared = random_prompt(64, seed=30)
    engine.add_request("warm", shared + random_prompt(5, seed=31), GREEDY)
    run_checked(engine)
    engine.add_request("hit", shared + random_prompt(10, seed=32), GREEDY)  # 74 tokens
    engine.add_request("miss", random_prompt(40, seed=33), GREEDY)
    assert engine.stats().num_queued_prefill_tokens == (74 - 64) + 40
    run_checked(engine)
    assert engine.stats().num_queued_prefill_tokens == 0


def test_abort_frees_every_block(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64))
    for i in range(5):
        engine.add_request(str(i), random_prompt(40, seed=20 + i), GREEDY)
    engine.step()
    engine.step()
    pool = engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks < pool.num_blocks
    outs = engine.abort_requests([str(i) for i in range(5)])
    assert {o.finish_reason for o in outs} == {"abort"}
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.req_to_blocks == {}
    assert pool.num_free_blocks == pool.num_blocks
    engine.kv_cache_manager.check_integrity()


def test_seeded_sampling_reproducible_across_runs_and_batches(llm):
    target = random_prompt(20, seed=5)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12)
    alone = llm.generate([target], params)[0].token_ids
    again = llm.generate([target], params)[0].token_ids
    others = [random_prompt(n, seed=n) for n in (3, 30, 45)]
    other_params = SamplingParams(temperature=1.0, max_tokens=12)
    mixed = llm.generate(
        [others[0], target, *others[1:]], [other_params, params, *[other_params] * 2]
    )
    last = llm.generate([*others, target], [other_params] * 3 + [params])
    assert alone == again == mixed[1].token_ids == last[3].token_ids


def test_unseeded_sampling_varies(llm):
    params = SamplingParams(temperature=1.0, max_tokens=12)
    outs = llm.generate([random_prompt(10, seed=6)] * 4, params)
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_stop_string_cuts_text_exactly(llm):
    prompt = random_prompt(12, seed=7)
    base = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24))[0]
    text = base.text
    assert len(text) > 12
    stop = text[8:11]
    cut = text.index(stop)
    streamed = "".join(
        o.delta_text
        for o in llm.generate_stream(
            [prompt], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop])
        )
    )
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]))[0]
    assert out.text == text[:cut]
    assert streamed == text[:cut]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop


def test_stop_token_ids_and_max_tokens(llm):
    prompt = random_prompt(12, seed=8)
    base = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 10
    stop_id = base.token_ids[4]
    first = base.token_ids.index(stop_id)
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_id])
    )[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_logprobs_reported_per_token(llm):
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3)
    out = llm.generate([random_prompt(9, seed=9)], params)[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    for token_id, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token_id
        assert lp.rank == 1  # greedy picks the most likely token
        assert len(lp.top) == 3 and lp.top[0][0] == token_id


def test_bad_requests_rejected_with_field_names(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("x", [], GREEDY)
    with pytest.raises(ValueError, match="token_ids"):
        engine.add_request("x", [engine.vocab_size], GREEDY)
    with pytest.raises(ValueError, match="context"):
        engine.add_request("x", [5] * engine.max_model_len, GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("x", [5], SamplingParams(max_tokens=engine.max_model_len))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("success", [True, False])
def test_external_kv_admission_matches_local_compute(tiny_llama_dir, success):
    """A request admitted with its first N tokens' KV copied in from another engine decodes
    exactly like a local run; a failed load falls back to recomputing."""
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    source, target = LLMEngine(config), LLMEngine(config)
    prompt = random_prompt(45, seed=30)
    num_external = len(prompt) - 1

    source.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=2))
    source.step()  # prefill writes the whole prompt's KV
    src_blocks = source.kv_cache_manager.get_block_ids("r")

    # The target already holds the first block through its own prefix cache.
    target.add_request("warm", prompt[:20], SamplingParams(temperature=0.0, max_tokens=1))
    run_checked(target)
    target.add_request("r", prompt, GREEDY, num_external_tokens=num_external)
    assert target.step() == []
    (load,) = target.take_kv_loads()
    assert load.num_local_hit_tokens == 16
    first_missing = load.num_local_hit_tokens // 16
    num_blocks = cdiv(num_external, 16)
    assert len(load.block_ids) == num_blocks
    if success:
        for i in range(first_missing, num_blocks):
            target.runner.kv_cache[load.block_ids[i]] = source.runner.kv_cache[src_blocks[i]]
    target.finish_kv_load("r", success)
    tokens = run_checked(target)["r"]
    assert tokens == hf_greedy(tiny_llama_dir, [prompt], GREEDY.max_tokens)[0]


def test_a_reused_id_cannot_overwrite_the_kv_it_holds_under_a_lease(tiny_llama_dir):
    """A second request with the id of one whose blocks a lease holds is refused, so the
    prefix cache still maps those blocks to the first prompt's KV."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64))
    first = random_prompt(40, seed=40)  # two full blocks, cached and held
    engine.add_request("r", first, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    run_checked(engine)
    held = engine.held_kv_block_ids("r")
    with pytest.raises(DuplicateRequestError, match="lease"):
        engine.add_request("r", random_prompt(40, seed=41), GREEDY, hold_kv=True)
    assert not engine.has_unfinished_requests() and engine.held_kv_block_ids("r") == held
    engine.add_request("again", first, GREEDY)
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    (out,) = finals
    assert out.num_cached_tokens == 32
    assert out.token_ids == hf_greedy(tiny_llama_dir, [first], GREEDY.max_tokens)[0]


def test_a_kv_cache_smaller_than_one_max_model_len_request_refuses_to_start(tiny_llama_dir):
    """A request the whole cache cannot hold would preempt itself forever (vLLM refuses too)."""
    with pytest.raises(ValueError, match="fewer than one request of max_model_len 1024"):
        LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=63))
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=63, max_model_len=63 * 16
        )
    )
    assert engine.max_model_len == 1008


def test_check_kv_integrity_catches_a_broken_block_pool_at_the_next_step(tiny_llama_dir):
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, check_kv_integrity=True
        )
    )
    engine.add_request("a", random_prompt(40, seed=5), GREEDY)
    engine.step()
    block_id = engine.kv_cache_manager.get_block_ids("a")[0]
    engine.kv_cache_manager.block_pool.blocks[block_id].ref_cnt = 0  # a block freed under it
    with pytest.raises(AssertionError, match="in use 2 != 64"):
        engine.step()


def test_phase_stamps_order_and_survive_preemption(tiny_llama_dir):
    """arrival <= first admission (``scheduled_time_s``) <= first token on every finished
    output, and a preempted request keeps the time it was first admitted (its queue wait ended
    then; the metrics and traces must not count the re-admission as queueing)."""
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir),
            dtype="float32",
            num_kv_blocks=20,
            max_model_len=320,
            max_num_seqs=4,
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    for i in range(6):
        engine.add_request(str(i), random_prompt(40, seed=i), params)
    first_scheduled: dict[str, float] = {}
    finals = {}
    while engine.has_unfinished_requests():
        for request in [*engine.scheduler.running, *engine.scheduler.waiting]:
            if request.scheduled_time_s is not None:
                first_scheduled.setdefault(request.req_id, request.scheduled_time_s)
        for out in engine.step():
            if out.finished:
                finals[out.req_id] = out
    assert engine.scheduler.num_preemptions > 0
    assert len(finals) == 6
    for req_id, out in finals.items():
        assert out.scheduled_time_s is not None and out.first_token_time_s is not None
        assert out.arrival_time_s <= out.scheduled_time_s <= out.first_token_time_s
        assert out.scheduled_time_s == first_scheduled[req_id]
