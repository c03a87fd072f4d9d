"""Structured output through the HTTP API with the official ``openai`` client: OpenAI's
``response_format`` and vLLM's ``guided_*`` / ``structured_outputs`` extensions reach the
constraint; outputs satisfy it, streamed or not; malformed or doubled constraints, and ones
over the constraint budget, are 400s naming the field (and the limit, never llguidance's panic
text), and the server goes on serving."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"enum": ["cheap", "quiet", "busy"]}, "maxItems": 2},
    },
    "required": ["city", "rating", "tags"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Rate a city."}]


def test_chat_response_format_json_schema_validates(sync_client, model):
    completion = sync_client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=120,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "rating", "schema": SCHEMA, "strict": True},
        },
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_streamed_json_object_parses_and_sampled_choices_too(sync_client, model):
    stream = sync_client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert isinstance(json.loads(text), dict)
    completion = sync_client.completions.create(
        model=model,
        prompt="The answer is",
        max_tokens=20,
        temperature=1.0,
        seed=3,
        n=4,
        extra_body={"guided_choice": ["yes", "no", "it depends"]},
    )
    assert {c.text for c in completion.choices} <= {"yes", "no", "it depends"}


@pytest.mark.parametrize(
    "extra",
    [
        {"guided_regex": r"[a-z]{3}-[0-9]{3}"},
        {"structured_outputs": {"regex": r"[a-z]{3}-[0-9]{3}"}},
    ],
    ids=["guided_regex", "structured_outputs"],
)
def test_vllm_regex_extensions_hold(sync_client, model, extra):
    completion = sync_client.completions.create(
        model=model, prompt="Code:", max_tokens=20, temperature=0, extra_body=extra
    )
    assert re.fullmatch(r"[a-z]{3}-[0-9]{3}", completion.choices[0].text)


GRAMMAR = 'start: ANSWER " " NUMBER\nANSWER: "yes" | "no"\nNUMBER: /[0-9]{1,3}/\n'
GRAMMAR_TEXT = r"(yes|no) [0-9]{1,3}"


def holds_schema(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


def holds_object(text: str) -> None:
    assert isinstance(json.loads(text), dict)


def holds_grammar(text: str) -> None:
    assert re.fullmatch(GRAMMAR_TEXT, text), text


def holds_choice(text: str) -> None:
    assert text in ("red", "green", "blue")


@pytest.mark.parametrize(
    ("extra", "holds"),
    [
        ({"guided_json": SCHEMA}, holds_schema),
        ({"guided_grammar": GRAMMAR}, holds_grammar),
        ({"structured_outputs": {"json": SCHEMA}}, holds_schema),
        ({"structured_outputs": {"json_object": True}}, holds_object),
        ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, holds_choice),
        ({"structured_outputs": {"grammar": GRAMMAR}}, holds_grammar),
    ],
    ids=[
        "guided_json_object",
        "guided_grammar",
        "structured_outputs_json",
        "structured_outputs_json_object",
        "structured_outputs_choice",
        "structured_outputs_grammar",
    ],
)
def test_every_vllm_extension_reaches_the_constraint(sync_client, model, extra, holds):
    completion = sync_client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=150, temperature=0, extra_body=extra
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    holds(choice.message.content)


def test_guided_json_given_as_text(sync_client, model):
    completion = sync_client.completions.create(
        model=model,
        prompt="JSON:",
        max_tokens=120,
        temperature=0,
        extra_body={"guided_json": json.dumps(SCHEMA)},
    )
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMA)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"guided_json": {"type": "no-such-type"}}, "constraint.json_schema"),
        ({"guided_regex": "(unclosed"}, "constraint.regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ],
    ids=["bad_type", "no_schema", "bad_schema", "bad_regex", "two_kinds", "two_fields"],
)
def test_bad_constraints_are_400s_naming_the_field(sync_client, model, extra, param):
    with pytest.raises(openai.BadRequestError) as error:
        sync_client.completions.create(model=model, prompt="x", max_tokens=5, extra_body=extra)
    assert param in error.value.message
    ok = sync_client.completions.create(model=model, prompt="x", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2


def test_a_huge_guided_choice_is_a_400_naming_the_limit(sync_client, model):
    # 1.7 MB: far under the body limit. It used to take the router seconds to validate and a
    # worker's engine thread seconds to refuse, with llguidance's panic and backtrace.
    choices = [f"choice number {i}" for i in range(100_000)]
    with pytest.raises(openai.BadRequestError) as error:
        sync_client.completions.create(
            model=model, prompt="x", max_tokens=5, extra_body={"guided_choice": choices}
        )
    message = error.value.message
    assert "guided_choice: 100000 choices, more than 10000" in message
    assert error.value.body["param"] == "guided_choice"
    assert "backtrace" not in message and "panic" not in message
    ok = sync_client.completions.create(model=model, prompt="x", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_grammar": "start: " + " | ".join(['"a"'] * 20_000)}, "guided_grammar"),
        ({"structured_outputs": {"regex": "a" * 70_000}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": ["a"] * 10_001}}, "structured_outputs.choice"),
    ],
    ids=["grammar_bytes", "regex_bytes", "choice_count"],
)
def test_a_constraint_over_its_size_budget_is_a_400_naming_the_clients_field(
    sync_client, model, extra, param
):
    with pytest.raises(openai.BadRequestError) as error:
        sync_client.completions.create(model=model, prompt="x", max_tokens=5, extra_body=extra)
    assert error.value.body["param"] == param
    assert "more than" in error.value.message
