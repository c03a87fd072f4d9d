"""Each ``tool_choice: auto`` parser reads back the calls its family's template writes, fed
whole or in random pieces (the stream's pieces always join to the whole response's); the
template's format is the one detected; text that is not a call stays content."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from engine.tokenizer import Tokenizer
from services.router.tool_calls.parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ParsedDelta,
    ToolCallFormat,
    ToolCallParser,
    auto_parser,
)
from services.router.tool_calls.rendering import detect_format, template_inputs
from services.router.tool_calls.tool_use import tool_use
from splitserve.v1 import router_pb2
from tests.services.router.tool_calls import templates

CALLS = [
    ("get_weather", {"city": "Paris", "unit": "celsius"}),
    ("search", {"query": 'say "hi" {not json} ; [TOOL_CALLS] <tool_call>', "n": [1, {"a": None}]}),
    ("now", {}),
]
TEMPLATES = {
    ToolCallFormat.HERMES: (templates.HERMES, templates.HERMES_END),
    ToolCallFormat.LLAMA3_JSON: (templates.LLAMA3_JSON, templates.LLAMA3_JSON_END),
    ToolCallFormat.MISTRAL: (templates.MISTRAL, templates.MISTRAL_END),
}


def _tokenizer(model_dir: Path, template: str) -> Tokenizer:
    tokenizer = Tokenizer(model_dir)
    tokenizer.chat_template = template
    return tokenizer


def _request(calls: list[tuple[str, dict]]) -> router_pb2.GenerateRequest:
    """A conversation whose last message is the assistant's ``calls``."""
    return router_pb2.GenerateRequest(
        messages=[
            router_pb2.ChatMessage(role="user", content="Weather in Paris, and search?"),
            router_pb2.ChatMessage(
                role="assistant",
                tool_calls=[
                    router_pb2.ToolCall(id=f"call{i:05d}", name=name, arguments=json.dumps(args))
                    for i, (name, args) in enumerate(calls)
                ],
            ),
        ],
        tools=[router_pb2.Tool(name=name) for name in dict(calls)],
    )


def _assistant_text(tokenizer: Tokenizer, call_format: ToolCallFormat, calls) -> str:
    """What the model writes for ``calls``: the assistant turn the template renders, without
    the end of turn (generation stops at that token; it adds no text). The tools are left out:
    Mistral's show them before the last user message, which the turn does not change."""
    request = _request(calls)
    tools = tool_use(request, call_format)
    messages, template_tools = template_inputs(request.messages, tools, tokenizer.chat_template)
    assert template_tools == tools.template_tools()
    prefix = tokenizer.apply_chat_template(messages[:-1], True)
    whole = tokenizer.apply_chat_template(messages, False)
    assert whole.startswith(prefix)
    end = TEMPLATES[call_format][1].replace("</s>", tokenizer.eos_token or "</s>")
    assert whole.endswith(end)
    return whole[len(prefix) : len(whole) - len(end)]


def _run(parser: ToolCallParser, text: str, rng: random.Random | None = None) -> ParsedDelta:
    """Feed ``text`` whole, or in random pieces of 1 to 6 characters; join what comes back."""
    out = ParsedDelta()
    if rng is None:
        out.add(parser.feed(text))
    else:
        i = 0
        while i < len(text):
            step = rng.randint(1, 6)
            out.add(parser.feed(text[i : i + step]))
            i += step
    out.add(parser.finish())
    return out


def _calls(parsed: ParsedDelta) -> list[tuple[str, dict]]:
    """Each call's name and arguments, its pieces joined."""
    calls: list[list] = []
    for piece in parsed.calls:
        if piece.id:
            assert piece.index == len(calls)
            calls.append([piece.name, ""])
        calls[piece.index][1] += piece.arguments
    return [(name, json.loads(arguments)) for name, arguments in calls]


@pytest.mark.parametrize("call_format", list(ToolCallFormat))
@pytest.mark.parametrize("num_calls", [1, 3])
def test_parser_reads_back_what_its_template_writes(tiny_llama_dir, call_format, num_calls):
    template = TEMPLATES[call_format][0]
    tokenizer = _tokenizer(tiny_llama_dir, template)
    assert detect_format(template) is call_format
    calls = CALLS[:num_calls]
    text = _assistant_text(tokenizer, call_format, calls)
    whole = _run(auto_parser(call_format, parallel=True), text)
    assert whole.content == "" and _calls(whole) == calls
    for seed in range(20):
        pieces = _run(auto_parser(call_format, parallel=True), text, random.Random(seed))
        assert pieces.content == "" and _calls(pieces) == calls
    first_only = _run(auto_parser(call_format, parallel=False), text)
    assert _calls(first_only) == calls[:1]


@pytest.mark.parametrize("call_format", list(ToolCallFormat))
def test_text_without_calls_is_content_whole_and_in_pieces(call_format):
    text = "It is sunny; {maybe} <tool_ and [TOOL_ are not calls. Done"
    for rng in (None, random.Random(1), random.Random(2)):
        parsed = _run(auto_parser(call_format, parallel=True), text, rng)
        assert parsed.content == text and not parsed.calls


def test_hermes_content_before_a_call_streams_first_and_broken_calls_are_content():
    parser = HermesParser(parallel=True)
    first = parser.feed("Let me check. <tool_")
    assert first.content == "Let me check. " and not first.calls  # "<tool_" may begin a call
    body = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    second = parser.feed("call>" + body[len("<tool_call>") :])
    assert [(c.name, c.arguments) for c in second.calls] == [("now", "{}")]
    broken = "\n<tool_call>\n{not json}\n</tool_call>"
    assert parser.feed(broken) == ParsedDelta()  # held: after a call, content waits
    assert parser.finish().content == broken
    # A list of calls in one tag (SmolLM2's habit) and a call cut off before its end tag.
    listed = _run(
        HermesParser(parallel=True),
        '<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
        '</tool_call>\n<tool_call>{"name": "c", "arguments": {}}\n</tool_',
    )
    assert [c.name for c in listed.calls] == ["a", "b", "c"] and listed.content == ""


def test_llama3_python_tag_and_separators_and_trailing_text():
    parsed = _run(
        Llama3JsonParser(parallel=True),
        ' <|python_tag|>{"name": "a", "parameters": {"q": "x;y"}}; {"name": "b", "parameters": {}}',
    )
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("a", {"q": "x;y"}),
        ("b", {}),
    ]
    trailing = _run(Llama3JsonParser(parallel=True), '{"name": "a", "parameters": {}} and more')
    assert [c.name for c in trailing.calls] == ["a"] and trailing.content == " and more"
    not_a_call = _run(Llama3JsonParser(parallel=True), '{"answer": 42}')
    assert not not_a_call.calls and not_a_call.content == '{"answer": 42}'


def test_mistral_single_object_and_unclosed_array():
    single = _run(MistralParser(parallel=True), '[TOOL_CALLS] {"name": "a", "arguments": {}}')
    assert [c.name for c in single.calls] == ["a"]
    unclosed = '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}'
    cut = _run(MistralParser(parallel=True), unclosed)
    assert not cut.calls and cut.content == unclosed


@pytest.mark.parametrize("seed", [None, 1, 2, 3])
def test_mistral_v11_name_and_args_form_in_any_pieces(seed):
    rng = None if seed is None else random.Random(seed)
    text = (
        'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris [ARGS] }"}'
        '[TOOL_CALLS] add [ARGS]{"a": 1, "b": {"c": [1, 2]}}'
    )
    out = _run(MistralParser(parallel=True), text, rng)
    assert out.content == "Checking."
    assert [(c.index, c.name) for c in out.calls] == [(0, "get_weather"), (1, "add")]
    assert [json.loads(c.arguments) for c in out.calls] == [
        {"city": "Paris [ARGS] }"},
        {"a": 1, "b": {"c": [1, 2]}},
    ]
    # A name whose arguments never came is content, as any broken call.
    cut = _run(MistralParser(parallel=True), "[TOOL_CALLS]get_weather", rng)
    assert not cut.calls and cut.content == "[TOOL_CALLS]get_weather"
