"""Failures confined to one request: it finishes with an error, the batch goes on exactly."""

from __future__ import annotations

import pytest

from engine import LLMEngine, SamplingParams
from engine.batch_runner import NON_FINITE_LOGITS, EngineBrokenError
from engine.config import EngineConfig
from loadtest.fixtures.tiny_model import make_poisoned_model
from tests.engine.test_engine import random_prompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=5)
POISON = 7


@pytest.fixture(scope="module")
def poisoned_dir(tiny_llama_dir, tmp_path_factory):
    return make_poisoned_model(tiny_llama_dir, tmp_path_factory.mktemp("poisoned") / "m", POISON)


def make_engine(model_dir) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            num_kv_blocks=48,
            max_model_len=48 * 16,
            max_num_seqs=8,
        )
    )


def run(engine: LLMEngine) -> dict[str, tuple[list[int], str | None, str | None]]:
    """Step until idle (integrity checked every step): req_id -> (tokens, finish, error)."""
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.req_id] = (out.token_ids, out.finish_reason, out.error)
        engine.kv_cache_manager.check_integrity()
    return results


def clean_prompts() -> dict[str, list[int]]:
    prompts = {f"ok-{i}": random_prompt(20 + 7 * i, seed=40 + i) for i in range(4)}
    for prompt in prompts.values():
        prompt[:] = [t for t in prompt if t != POISON]
    return prompts


def reference(model_dir, prompts: dict[str, list[int]], params: SamplingParams) -> dict:
    """Each prompt alone on a fresh engine."""
    engine = make_engine(model_dir)
    for req_id, prompt in prompts.items():
        engine.add_request(req_id, prompt, params)
    return {k: v[0] for k, v in run(engine).items()}


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_nan_logits_fail_only_their_request_and_poison_no_later_one(
    poisoned_dir, tiny_llama_dir, params
):
    prompts = clean_prompts()
    expected = reference(tiny_llama_dir, prompts, params)
    engine = make_engine(poisoned_dir)
    poisoned = random_prompt(33, seed=3)
    poisoned[20] = POISON
    engine.add_request("poisoned", poisoned, params)
    for req_id, prompt in prompts.items():
        engine.add_request(req_id, prompt, params)
    results = run(engine)
    assert results.pop("poisoned") == ([], "error", NON_FINITE_LOGITS)
    assert {k: v[0] for k, v in results.items()} == expected
    # The blocks the failed request wrote are reused (with its NaN in their unused slots) and
    # were withdrawn from the prefix cache: later requests are still exact.
    for req_id, prompt in prompts.items():
        engine.add_request(f"again-{req_id}", prompt[:-3], params)
    again = run(engine)
    assert {k: v[0] for k, v in again.items()} == reference(
        tiny_llama_dir, {f"again-{k}": p[:-3] for k, p in prompts.items()}, params
    )
    pool = engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks


def test_a_request_that_makes_the_forward_raise_fails_alone(tiny_llama_dir, monkeypatch):
    prompts = clean_prompts()
    expected = reference(tiny_llama_dir, prompts, GREEDY)
    engine = make_engine(tiny_llama_dir)
    execute = engine.runner.execute

    def execute_raising_on_poison(scheduled):
        if any(POISON in s.request.all_token_ids for s in scheduled):
            raise RuntimeError("kernel fault on the poisoned token")
        return execute(scheduled)

    monkeypatch.setattr(engine.runner, "execute", execute_raising_on_poison)
    engine.add_request("poisoned", [*random_prompt(9, seed=8), POISON], GREEDY)
    for req_id, prompt in prompts.items():
        engine.add_request(req_id, prompt, GREEDY)
    results = run(engine)
    tokens, finish_reason, error = results.pop("poisoned")
    assert (tokens, finish_reason) == ([], "error")
    assert "kernel fault on the poisoned token" in error
    assert {k: v[0] for k, v in results.items()} == expected


def test_an_engine_whose_every_step_fails_is_broken(tiny_llama_dir, monkeypatch):
    engine = make_engine(tiny_llama_dir)

    def broken(scheduled):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "execute", broken)
    engine.add_request("a", random_prompt(10, seed=1), GREEDY)
    engine.add_request("b", random_prompt(12, seed=2), GREEDY)
    with pytest.raises(EngineBrokenError, match="device lost"):
        run(engine)


def test_one_request_failing_alone_again_and_again_breaks_the_engine(tiny_llama_dir, monkeypatch):
    """With one request at a time nothing tells a bad request from a broken engine, until
    several different requests in a row fail."""
    engine = make_engine(tiny_llama_dir)

    def broken(scheduled):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "execute", broken)
    for i in range(2):
        engine.add_request(f"r{i}", random_prompt(10, seed=i), GREEDY)
        assert run(engine)[f"r{i}"][1] == "error"
    engine.add_request("r2", random_prompt(10, seed=2), GREEDY)
    with pytest.raises(EngineBrokenError):
        run(engine)
