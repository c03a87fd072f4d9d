"""``engine.structured_output`` against the tiny model's tokenizer, with noise for logits: whatever
the scores, masked sampling yields text that satisfies the constraint (parsed and validated
with ``jsonschema``, matched with ``re``), and a matcher rebuilt from the tokens so far allows
exactly what the original allows next (what a decode worker or a migration target relies on)."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from engine.constraint import Constraint, ConstraintKind
from engine.structured_output import GrammarCompiler, GuidedMatcher, apply_bitmask
from engine.tokenizer import Tokenizer
from loadtest.schemas import random_schema

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
    tokens = sample_constrained(compiler, compiler.matcher(constraint), seed)
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
        tokens = sample_constrained(compiler, compiler.matcher(constraint), seed, closers)
        text = tokenizer.decode(tokens)
        assert check(text), text


def test_a_matcher_rebuilt_from_the_tokens_so_far_allows_what_the_original_does(compiler):
    schema = random_schema(random.Random(7))
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
    original = compiler.matcher(constraint)
    tokens = sample_constrained(compiler, original, seed=3)
    for cut in range(len(tokens)):
        rebuilt = compiler.matcher(constraint, tokens[:cut])
        replayed = compiler.matcher(constraint)
        for token in tokens[:cut]:
            assert replayed.accept(token)
        masks = compiler.allocate_bitmask(2)
        rebuilt.fill_bitmask(masks, 0)
        replayed.fill_bitmask(masks, 1)
        assert torch.equal(masks[0], masks[1]), cut
    with pytest.raises(ValueError, match="break the constraint"):
        compiler.matcher(Constraint(ConstraintKind.CHOICE, choices=("yes",)), tokens[:1] * 3)


def test_only_the_constrained_rows_of_a_batch_are_masked(compiler):
    matcher = compiler.matcher(Constraint(ConstraintKind.CHOICE, choices=("yes", "no")))
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
