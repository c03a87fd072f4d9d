"""Constrained generation through the engine on the tiny random model, whose unconstrained
output is noise: every output satisfies its constraint and ends with ``stop`` at the grammar's
end; greedy constrained output is the same after preemptions (recompute keeps the matcher),
when the request resumes from tokens sampled elsewhere (a decode worker, a migration), and
whatever shares its batch; unconstrained requests in the batch are untouched."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from engine import LLM, LLMEngine, SamplingParams
from engine.config import EngineConfig
from engine.constraint import Constraint, ConstraintKind
from loadtest.schemas import random_schema


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
