"""A request's tool use: the grammar of ``required`` accepts exactly the calls of the tools
(one only without parallel calls), malformed tools are refused naming the field, and a
template without tools gets the conversation in Hermes' form, which the Hermes parser reads
back."""

from __future__ import annotations

import json

import jsonschema
import pytest

from services.router.tool_calls.parsers import HermesParser, ToolCallFormat
from services.router.tool_calls.rendering import template_inputs
from services.router.tool_calls.tool_use import ToolChoice, tool_use
from splitserve.v1 import router_pb2

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    router_pb2.Tool(name="get_weather", description="weather", parameters=json.dumps(CITY)),
    router_pb2.Tool(name="now"),
]
USER = router_pb2.ChatMessage(role="user", content="Paris?")


def _request(**fields) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(messages=[USER], tools=TOOLS, **fields)


def _schema(request: router_pb2.GenerateRequest) -> dict:
    tools = tool_use(request, ToolCallFormat.HERMES)
    assert tools is not None
    constraint = tools.constraint()
    assert constraint is not None
    return json.loads(constraint.json_schema)


def test_required_grammar_takes_the_tools_calls_only():
    required = router_pb2.ToolChoice(mode=router_pb2.TOOL_CHOICE_MODE_REQUIRED)
    schema = _schema(_request(tool_choice=required))
    weather = {"name": "get_weather", "parameters": {"city": "Paris"}}
    now = {"name": "now", "parameters": {}}
    jsonschema.validate([weather, now], schema)
    for bad in (
        [],
        [{"name": "get_weather", "parameters": {}}],
        [{"name": "other", "parameters": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = _schema(_request(tool_choice=required, parallel_tool_calls=False))
    jsonschema.validate([weather], single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([weather, now], single)


def test_named_grammar_is_the_functions_arguments_and_auto_has_none():
    named = _schema(_request(tool_choice=router_pb2.ToolChoice(function_name="get_weather")))
    assert named == CITY
    auto = tool_use(_request(), ToolCallFormat.HERMES)
    assert auto is not None and auto.choice is ToolChoice.AUTO and auto.constraint() is None
    none = tool_use(
        _request(tool_choice=router_pb2.ToolChoice(mode=router_pb2.TOOL_CHOICE_MODE_NONE)),
        ToolCallFormat.HERMES,
    )
    assert none is not None and none.parser() is None and none.template_tools()


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (_request(tool_choice=router_pb2.ToolChoice(function_name="nope")), "tool_choice"),
        (
            router_pb2.GenerateRequest(messages=[USER], tools=[TOOLS[1], TOOLS[1]]),
            "tools: two tools",
        ),
        (
            router_pb2.GenerateRequest(
                messages=[USER], tools=[router_pb2.Tool(name="a", parameters="[1]")]
            ),
            "tools[0].parameters",
        ),
        (
            router_pb2.GenerateRequest(
                messages=[USER], tools=[router_pb2.Tool(name="a", parameters="{")]
            ),
            "tools[0].parameters",
        ),
        (router_pb2.GenerateRequest(prompt="x", tools=TOOLS), "tools: only chat"),
        (
            router_pb2.GenerateRequest(
                messages=[USER],
                tool_choice=router_pb2.ToolChoice(mode=router_pb2.TOOL_CHOICE_MODE_REQUIRED),
            ),
            "tool_choice: needs tools",
        ),
    ],
)
def test_malformed_tool_use_is_refused_naming_the_field(request_, field):
    with pytest.raises(ValueError, match="^" + field.replace("[", r"\[").replace("]", r"\]")):
        tool_use(request_, ToolCallFormat.HERMES)


def test_a_template_without_tools_gets_hermes_form_that_parses_back():
    chatml = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    messages = [
        router_pb2.ChatMessage(role="system", content="Be brief."),
        USER,
        router_pb2.ChatMessage(
            role="assistant",
            tool_calls=[
                router_pb2.ToolCall(id="c1", name="get_weather", arguments='{"city": "Paris"}')
            ],
        ),
        router_pb2.ChatMessage(role="tool", tool_call_id="c1", content="sunny"),
    ]
    tools = tool_use(
        router_pb2.GenerateRequest(messages=messages, tools=TOOLS), ToolCallFormat.HERMES
    )
    rendered, template_tools = template_inputs(messages, tools, chatml)
    assert template_tools is None
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert (
        rendered[0]["content"].startswith("Be brief.\n\n")
        and "get_weather" in rendered[0]["content"]
    )
    assert rendered[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    parser = HermesParser(parallel=True)
    parsed = parser.feed(rendered[2]["content"])
    parsed.add(parser.finish())
    assert parsed.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    # A template that shows tools itself gets them, and the messages in OpenAI's shape.
    native, native_tools = template_inputs(messages, tools, chatml + "{{ tools }}")
    assert native_tools == tools.template_tools()
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert native[3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    with pytest.raises(ValueError, match=r"^messages\[0\]\.tool_calls\[0\]\.arguments"):
        bad = router_pb2.ChatMessage(
            role="assistant", tool_calls=[router_pb2.ToolCall(name="now", arguments="[]")]
        )
        template_inputs([bad], tools, chatml)
