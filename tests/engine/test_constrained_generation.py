"""Constrained generation through the engine on the tiny random model, whose unconstrained
output is noise: every output satisfies its constraint and ends with ``stop`` at the grammar's
end; greedy constrained output is the same after preemptions (recompute keeps the matcher),
when the request resumes from tokens sampled elsewhere (a decode worker, a migration), and
whatever shares its batch; unconstrained requests in the batch are untouched. A grammar
compiles off the engine's thread: the other requests step meanwhile, its own request waits
(and can be aborted, or fails with a clean error when its compile fails or takes too long),
and a repeated constraint compiles once."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import threading

import jsonschema
import pytest

from engine import LLM, LLMEngine, SamplingParams
from engine.config import EngineConfig
from engine.constraint import Constraint, ConstraintKind, ConstraintLimits
from engine.grammar_pool import GrammarPool
from engine.outputs import RequestOutput
from engine.scheduler import DuplicateRequestError
from engine.structured_output import CompiledGrammar, GrammarCompiler
from loadtest.fixtures.schemas import random_schema
from tests.engine.test_grammar_pool import GATE_TIMEOUT_S

CHOICES = ("alpha", "beta", "gamma delta")


def json_schema_params(schema: dict, max_tokens: int = 400) -> SamplingParams:
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, constraint=constraint)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=512)


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 400) for _ in range(rng.randint(5, 40))] for _ in range(n)]


def test_fifty_random_schemas_in_one_batch_all_validate(llm):
    schemas = [random_schema(random.Random(seed)) for seed in range(50)]
    outputs = llm.generate(prompts(50), [json_schema_params(s) for s in schemas])
    for schema, output in zip(schemas, outputs, strict=True):
        assert output.finish_reason == "stop", output.text
        jsonschema.validate(json.loads(output.text), schema)


def test_regex_and_choice_hold_and_sampled_outputs_too(llm):
    regex = Constraint(ConstraintKind.REGEX, r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)")
    choice = Constraint(ConstraintKind.CHOICE, choices=("alpha", "beta", "gamma delta"))
    params = [
        SamplingParams(temperature=t, seed=s, max_tokens=64, constraint=c)
        for c in (regex, choice)
        for t, s in ((0.0, None), (1.0, 1), (1.0, 2))
    ]
    outputs = llm.generate(prompts(len(params)), params)
    for p, output in zip(params, outputs, strict=True):
        assert output.finish_reason == "stop"
        if p.constraint is regex:
            assert re.fullmatch(regex.spec, output.text), output.text
        else:
            assert output.text in choice.choices


def test_grammar_and_json_object_hold_greedy_and_sampled(llm):
    grammar = Constraint(
        ConstraintKind.GRAMMAR,
        'start: "(" PAIR ("," PAIR)* ")"\nPAIR: /[a-c]/ "=" /[0-9]{1,2}/\n',
    )
    any_object = Constraint(ConstraintKind.JSON_OBJECT)
    params = [
        SamplingParams(temperature=t, seed=s, max_tokens=200, constraint=c)
        for c in (grammar, any_object)
        for t, s in ((0.0, None), (1.0, 1), (1.0, 2))
    ]
    outputs = llm.generate(prompts(len(params)), params)
    for p, output in zip(params, outputs, strict=True):
        if p.constraint is grammar:
            assert output.finish_reason == "stop", output.text
            assert re.fullmatch(r"\([a-c]=[0-9]{1,2}(,[a-c]=[0-9]{1,2})*\)", output.text)
        elif output.finish_reason == "stop":
            assert isinstance(json.loads(output.text), dict), output.text
        else:  # any object's strings are unbounded: noise may fill one up to max_tokens
            assert output.finish_reason == "length" and output.text.startswith('{"')
    assert any(o.finish_reason == "stop" for o in outputs[3:])


def test_constrained_greedy_output_survives_preemption_and_batch_company(tiny_llama_dir, llm):
    schemas = [random_schema(random.Random(seed)) for seed in range(8)]
    params = [json_schema_params(s, max_tokens=300) for s in schemas]
    alone = [llm.generate([p], [q])[0].token_ids for p, q in zip(prompts(8), params, strict=True)]
    unconstrained = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    plain_alone = llm.generate(prompts(3), unconstrained)
    # A cache of 24 blocks for 11 requests: they preempt one another.
    tight = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=24, max_model_len=352
        )
    )
    for i, (prompt, p) in enumerate(zip(prompts(8), params, strict=True)):
        tight.add_request(f"c{i}", prompt, p)
    for i, prompt in enumerate(prompts(3)):
        tight.add_request(f"u{i}", prompt, unconstrained)
    finals = {}
    while tight.has_unfinished_requests():
        for output in tight.step():
            if output.finished:
                finals[output.req_id] = output.token_ids
    assert tight.scheduler.num_preemptions > 0
    assert [finals[f"c{i}"] for i in range(8)] == alone
    assert [finals[f"u{i}"] for i in range(3)] == [o.token_ids for o in plain_alone]


def test_a_request_resumed_from_tokens_sampled_elsewhere_continues_identically(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=128))
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    params = json_schema_params(schema)
    prompt = prompts(1)[0]
    engine.add_request("whole", prompt, params)
    reference: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            reference = output.token_ids or reference
    assert len(reference) > 4
    for cut in (1, len(reference) // 2, len(reference) - 1):
        engine.add_request(f"from{cut}", prompt, params, output_token_ids=reference[:cut])
        final: list[int] = []
        while engine.has_unfinished_requests():
            for output in engine.step():
                final = output.token_ids or final
        assert final == reference, cut
    with pytest.raises(ValueError, match="break the constraint"):
        engine.add_request("bad", prompt, params, output_token_ids=[reference[0]] * 40)


def gated_grammars(
    engine: LLMEngine, gate: threading.Event, limits: ConstraintLimits | None = None
) -> GrammarPool[CompiledGrammar]:
    """The engine's grammars, each compile held until ``gate`` opens (a slow compile that the
    test ends when it chooses)."""
    tokenizer = engine.tokenizer
    compiler = GrammarCompiler(
        tokenizer.backend.to_str(), engine.vocab_size, tokenizer.eos_token_ids
    )

    def compile(constraint: Constraint) -> CompiledGrammar:
        gate.wait(GATE_TIMEOUT_S)
        return compiler.compile(constraint)

    return GrammarPool(compile, limits or engine.grammars.limits)


def run_to_end(engine: LLMEngine) -> dict[str, RequestOutput]:
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.req_id] = output
        if not engine.last_num_scheduled_tokens:
            engine.wait_for_grammars()
    return finals


@pytest.fixture
def engine(tiny_llama_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64))


def test_a_compiling_grammar_holds_its_request_only(engine):
    gate = threading.Event()
    engine.grammars = gated_grammars(engine, gate)
    choice = Constraint(ConstraintKind.CHOICE, choices=CHOICES)
    guided = SamplingParams(temperature=0.0, max_tokens=16, constraint=choice)
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    try:
        engine.add_request("guided", prompts(1)[0], guided)  # returns with the compile held
        engine.add_request("plain", prompts(2)[1], plain)
        plain_tokens: list[int] = []
        while len(plain_tokens) < 20:
            for output in engine.step():
                assert output.req_id == "plain"
                plain_tokens += output.new_token_ids
        assert engine.has_unfinished_requests()  # the guided one, still waiting
        assert engine.stats().num_waiting == 1  # counted for routing, though not scheduled
    finally:
        gate.set()
    final = run_to_end(engine)["guided"]
    assert final.finish_reason == "stop" and final.text in CHOICES


def test_a_held_request_can_be_aborted_and_fails_cleanly_when_its_compile_does(engine):
    gate = threading.Event()
    engine.grammars = gated_grammars(engine, gate)
    prompt = prompts(1)[0]

    def params(constraint: Constraint) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=8, constraint=constraint)

    try:
        engine.add_request("held", prompt, params(Constraint(ConstraintKind.REGEX, "[a-z]{3}")))
        with pytest.raises(DuplicateRequestError, match="'held'"):
            engine.add_request("held", prompt, SamplingParams(max_tokens=2))
        (aborted,) = engine.abort_requests(["held"])
        assert aborted.finished and aborted.finish_reason == "abort"
        assert not engine.has_unfinished_requests()
        engine.add_request("bad", prompt, params(Constraint(ConstraintKind.GRAMMAR, "start: x")))
    finally:
        gate.set()
    bad = run_to_end(engine)["bad"]
    assert bad.finish_reason == "error" and bad.error is not None
    assert bad.error.startswith("constraint: grammar: ") and "backtrace" not in bad.error


def test_a_grammar_that_outlasts_its_budget_fails_its_request(engine):
    gate = threading.Event()
    limits = dataclasses.replace(engine.grammars.limits, compile_timeout_s=0.05)
    engine.grammars = gated_grammars(engine, gate, limits)
    regex = Constraint(ConstraintKind.REGEX, "[0-9]{2}")
    try:
        engine.add_request("slow", prompts(1)[0], SamplingParams(max_tokens=4, constraint=regex))
        final = run_to_end(engine)["slow"]  # waits for the budget, not for the gate
    finally:
        gate.set()
    assert final.finish_reason == "error"
    assert (
        final.error
        == "constraint: regex: not compiled within 0.05 s (a smaller constraint compiles faster)"
    )


def test_a_repeated_constraint_compiles_once(llm):
    regex = Constraint(ConstraintKind.REGEX, r"[a-z]{2,5}-[0-9]{2}")
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=16, constraint=regex)
    grammars = llm.engine.grammars
    misses, hits = grammars.num_misses, grammars.num_hits
    outputs = llm.generate(prompts(4), [params] * 4)
    assert all(re.fullmatch(regex.spec, o.text) for o in outputs)
    assert (grammars.num_misses - misses, grammars.num_hits - hits) == (1, 3)
