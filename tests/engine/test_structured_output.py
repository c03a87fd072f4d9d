"""``engine.structured_output`` against the tiny model's tokenizer, with noise for logits: whatever
the scores, masked sampling yields text that satisfies the constraint (parsed and validated
with ``jsonschema``, matched with ``re``), and a matcher rebuilt from the tokens so far allows
exactly what the original allows next (what a decode worker or a migration target relies on).
Constraints that cannot compile are refused with a sentence naming the limit: the size budget
(``ConstraintLimits``), llguidance's own limits, never its panic text."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from engine.constraint import (
    MAX_GRAMMAR_SYMBOLS,
    Constraint,
    ConstraintKind,
    ConstraintLimits,
    readable_error,
)
from engine.structured_output import GrammarCompiler, GuidedMatcher, apply_bitmask
from engine.tokenizer import Tokenizer
from loadtest.fixtures.schemas import random_schema

MAX_TOKENS = 400


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir) -> Tokenizer:
    return Tokenizer(tiny_llama_dir)


@pytest.fixture(scope="module")
def compiler(tiny_llama_dir, tokenizer) -> GrammarCompiler:
    vocab_size = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    return GrammarCompiler(tokenizer.backend.to_str(), vocab_size, tokenizer.eos_token_ids)


def sample_constrained(
    compiler: GrammarCompiler,
    matcher: GuidedMatcher,
    seed: int,
    prefer: tuple[int, ...] = (),
) -> list[int]:
    """Greedy over random logits under the matcher's bitmask until it finishes; ``prefer``
    gets a bonus (a model that closes what it opens: an open-ended constraint ends)."""
    generator = torch.Generator().manual_seed(seed)
    bitmask = compiler.allocate_bitmask(1)
    tokens: list[int] = []
    for _ in range(MAX_TOKENS):
        if matcher.is_finished:
            return tokens
        logits = torch.randn(1, compiler.vocab_size, generator=generator)
        logits[0, list(prefer)] += 2.5
        matcher.fill_bitmask(bitmask, 0)
        apply_bitmask(logits, bitmask, torch.tensor([0]))
        token = int(logits[0].argmax())
        assert matcher.accept(token), matcher.error
        tokens.append(token)
    raise AssertionError(f"no end within {MAX_TOKENS} tokens")


@pytest.mark.parametrize("seed", range(50))
def test_random_json_schemas_always_yield_valid_json(compiler, tokenizer, seed):
    schema = random_schema(random.Random(seed))
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
    constraint.validate()
    tokens = sample_constrained(compiler, compiler.compile(constraint).matcher(), seed)
    value = json.loads(tokenizer.decode(tokens))
    jsonschema.validate(value, schema)


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        (Constraint(ConstraintKind.JSON_OBJECT), lambda t: isinstance(json.loads(t), dict)),
        (
            Constraint(ConstraintKind.REGEX, r"[A-Z][a-z]{2,6} [0-9]{1,3}"),
            lambda t: re.fullmatch(r"[A-Z][a-z]{2,6} [0-9]{1,3}", t) is not None,
        ),
        (
            Constraint(ConstraintKind.CHOICE, choices=("positive", "negative", "neutral")),
            lambda t: t in ("positive", "negative", "neutral"),
        ),
        (
            Constraint(ConstraintKind.GRAMMAR, 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,2}/'),
            lambda t: re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", t) is not None,
        ),
    ],
    ids=["json_object", "regex", "choice", "grammar"],
)
def test_regex_choice_and_grammar_outputs_match(compiler, tokenizer, constraint, check):
    closers = tuple(tokenizer.encode(c, add_special_tokens=False)[0] for c in ('"', "}", "]"))
    for seed in range(5):
        tokens = sample_constrained(compiler, compiler.compile(constraint).matcher(), seed, closers)
        text = tokenizer.decode(tokens)
        assert check(text), text


def test_a_matcher_rebuilt_from_the_tokens_so_far_allows_what_the_original_does(compiler):
    schema = random_schema(random.Random(7))
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
    compiled, compiled_again = compiler.compile(constraint), compiler.compile(constraint)
    tokens = sample_constrained(compiler, compiled.matcher(), seed=3)
    for cut in range(len(tokens)):
        rebuilt = compiled.matcher(tokens[:cut])
        replayed = compiled_again.matcher()
        for token in tokens[:cut]:
            assert replayed.accept(token)
        masks = compiler.allocate_bitmask(2)
        rebuilt.fill_bitmask(masks, 0)
        replayed.fill_bitmask(masks, 1)
        assert torch.equal(masks[0], masks[1]), cut
    with pytest.raises(ValueError, match="break the constraint"):
        yes = compiler.compile(Constraint(ConstraintKind.CHOICE, choices=("yes",)))
        yes.matcher(tokens[:1] * 3)


def test_only_the_constrained_rows_of_a_batch_are_masked(compiler):
    matcher = compiler.compile(Constraint(ConstraintKind.CHOICE, choices=("yes", "no"))).matcher()
    bitmask = compiler.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    logits = torch.randn(3, compiler.vocab_size)
    before = logits.clone()
    apply_bitmask(logits, bitmask, torch.tensor([1]))
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = torch.isfinite(logits[1])
    assert 0 < int(allowed.sum()) < compiler.vocab_size
    assert torch.equal(logits[1][allowed], before[1][allowed])


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (Constraint(ConstraintKind.JSON_SCHEMA, "{not json"), "json_schema"),
        (Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "no-such-type"}'), "json_schema"),
        (Constraint(ConstraintKind.REGEX, "[a-z"), "regex"),
        (Constraint(ConstraintKind.GRAMMAR, "start: missing_rule"), "grammar"),
    ],
    ids=["bad_json", "bad_schema", "bad_regex", "bad_grammar"],
)
def test_invalid_constraints_are_refused_with_a_message(constraint, message):
    with pytest.raises(ValueError, match=message):
        constraint.validate()


def test_a_choice_constraint_needs_choices():
    with pytest.raises(ValueError, match="at least one choice"):
        Constraint(ConstraintKind.CHOICE)


def test_constraints_over_the_size_budget_are_refused_naming_the_limit():
    limits = ConstraintLimits()
    many = Constraint(ConstraintKind.CHOICE, choices=tuple(str(i) for i in range(100_000)))
    with pytest.raises(ValueError, match=r"^choice: 100000 choices, more than 10000$"):
        limits.check(many)
    # Bytes, not characters: 40,000 two-byte characters.
    big = Constraint(
        ConstraintKind.JSON_SCHEMA, json.dumps({"enum": ["é" * 40_000]}, ensure_ascii=False)
    )
    with pytest.raises(ValueError, match=r"^json_schema: 80014 bytes, more than 65536$"):
        limits.check(big)
    limits.check(Constraint(ConstraintKind.CHOICE, choices=tuple(str(i) for i in range(10_000))))


def test_a_grammar_past_llguidances_symbol_limit_fails_with_a_sentence(compiler):
    # Each group is a symbol: llguidance panics on building a matcher for more than 65,524.
    too_many = Constraint(ConstraintKind.GRAMMAR, "start: " + '("a") ' * 66_000)
    with pytest.raises(ValueError) as error:
        compiler.compile(too_many)
    message = str(error.value)
    assert message == (
        f"grammar: the grammar has more than {MAX_GRAMMAR_SYMBOLS} symbols (literals and "
        "rules), llguidance's limit"
    )


def test_llguidance_panics_and_errors_lose_their_backtrace():
    panic = "panic: assertion failed: lexer.len() < 7\n<backtrace>\n   0: <unknown>\n   1: x"
    assert readable_error(panic) == "llguidance cannot build it (assertion failed: lexer.len() < 7)"
    assert readable_error("invalid regex\n<backtrace>\n0: <unknown>") == "invalid regex"


def test_a_schema_nested_too_deeply_for_python_is_a_value_error():
    nested = '{"type": "integer"}'
    for _ in range(3000):
        nested = f'{{"type": "array", "items": {nested}}}'
    with pytest.raises(ValueError, match=r"^json_schema: the schema is nested too deeply$"):
        Constraint(ConstraintKind.JSON_SCHEMA, nested).validate()
