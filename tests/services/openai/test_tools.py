"""Tool calling through the official ``openai`` client on a real cluster (tiny random model):
with ``tool_choice`` ``required`` or a named function, random function schemas always give
calls whose arguments validate, streamed or not, and the streamed pieces concatenate to the
whole response's calls; ``auto`` on a model that writes no calls is content; the history's
calls and results reach the template; malformed tools are 400s naming the field. gRPC clients
get the same calls."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from loadtest.fixtures.tiny_model import make_tiny_model
from splitserve.v1 import router_pb2
from tests.services.conftest import greedy

NUM_SCHEMAS = 50
# The tiny model's tokenizer spends about a token per character of the tools' JSON in the
# prompt: a longer context than the tests' usual model's (1,024) holds them.
MAX_POSITION_EMBEDDINGS = 4096
MAX_TOKENS = 600
CONCURRENCY = 3  # requests of ~1,500 tokens within the workers' 4,096 KV slots


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """The tests' tiny model with a context long enough for a few tools (overrides the
    session's for this module's cluster)."""
    out_dir = tmp_path_factory.mktemp("tools-model")
    return make_tiny_model(out_dir, "llama", max_position_embeddings=MAX_POSITION_EMBEDDINGS)


MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _random_value_schema(rng: random.Random, depth: int) -> dict[str, Any]:
    """A bounded schema: whatever the model samples under it ends within MAX_TOKENS."""
    kinds = ["string", "integer", "boolean", "enum"]
    if depth < 1:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "c", "f", "k"], rng.randint(1, 3))}
    if kind == "array":
        return {"type": "array", "items": _random_value_schema(rng, depth + 1), "maxItems": 2}
    return _random_object_schema(rng, depth + 1)


def _random_object_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    names = rng.sample(["city", "unit", "days", "lat", "lon", "query", "flag", "tags"], 3)
    properties = {name: _random_value_schema(rng, depth) for name in names[: rng.randint(1, 3)]}
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def _tools(seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{seed}_{k}",
                "description": f"set {seed}",
                "parameters": _random_object_schema(rng),
            },
        }
        for k in range(rng.randint(1, 2))
    ]


def _validate(calls: list[Any], tools: list[dict[str, Any]]) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


async def _streamed_calls(client: openai.AsyncOpenAI, **kwargs: Any) -> tuple[list, str | None]:
    """The stream's calls, each's pieces joined, and its finish reason."""
    calls: dict[int, dict[str, str]] = {}
    finish_reason = None
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            assert not choice.delta.content
            finish_reason = choice.finish_reason or finish_reason
            for piece in choice.delta.tool_calls or ():
                if piece.id:
                    assert piece.index == len(calls)
                    calls[piece.index] = {"name": piece.function.name, "arguments": ""}
                calls[piece.index]["arguments"] += piece.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish_reason


@pytest.mark.parametrize("named", [False, True], ids=["required", "named"])
def test_random_schemas_always_give_calls_that_validate(base_url, model, named):
    async def run(seed: int, client: openai.AsyncOpenAI) -> None:
        tools = _tools(seed)
        choice: Any = "required"
        if named:
            choice = {"type": "function", "function": {"name": tools[-1]["function"]["name"]}}
        kwargs = dict(
            model=model,
            messages=MESSAGES,
            tools=tools,
            tool_choice=choice,
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        whole = await client.chat.completions.create(**kwargs)
        message = whole.choices[0].message
        assert message.content is None
        _validate(message.tool_calls, tools)
        assert whole.choices[0].finish_reason == ("stop" if named else "tool_calls")
        if named:
            assert [c.function.name for c in message.tool_calls] == [choice["function"]["name"]]
        # Greedy: the same calls, streamed.
        streamed, finish_reason = await _streamed_calls(client, **kwargs)
        assert finish_reason == whole.choices[0].finish_reason
        assert streamed == [
            {"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls
        ]

    async def run_all() -> None:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as c:
            semaphore = asyncio.Semaphore(CONCURRENCY)

            async def bounded(seed: int) -> None:
                async with semaphore:
                    await run(seed, c)

            await asyncio.gather(*(bounded(seed) for seed in range(NUM_SCHEMAS)))

    asyncio.run(run_all())


def test_one_call_without_parallel_tool_calls_and_sampled_calls_validate(sync_client, model):
    tools = _tools(7) + _tools(8)
    completion = sync_client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=3,
        n=3,
    )
    for choice in completion.choices:
        assert len(choice.message.tool_calls) == 1
        _validate(choice.message.tool_calls, tools)


def test_auto_on_a_model_that_writes_no_call_is_content(sync_client, base_url, model):
    """The tiny model writes no ``<tool_call>``: its text is content, as without tools, and
    the history's call and result reach the template (the prompt grows by them)."""
    tools = _tools(1)
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": tools[0]["function"]["name"], "arguments": '{"a": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    completion = sync_client.chat.completions.create(
        model=model, messages=history, tools=tools, max_tokens=8, temperature=0
    )
    choice = completion.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    without = sync_client.chat.completions.create(
        model=model, messages=MESSAGES, tools=tools, max_tokens=8, temperature=0
    )
    assert completion.usage.prompt_tokens > without.usage.prompt_tokens
    # /tokenize renders tools and history as the chat request does.
    counted = httpx.post(
        f"{base_url.removesuffix('/v1')}/tokenize",
        json={"model": model, "messages": history, "tools": tools},
        timeout=30,
    ).json()
    assert counted["count"] == completion.usage.prompt_tokens
    plain = sync_client.chat.completions.create(
        model=model, messages=MESSAGES, tools=tools, tool_choice="none", max_tokens=8, temperature=0
    )
    assert plain.choices[0].message.content == without.choices[0].message.content


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].name"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "function_name"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"response_format": {"type": "json_object"}, "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_malformed_tools_are_400s_naming_the_field(sync_client, model, change, param):
    body = {"tools": _tools(2), "tool_choice": "auto", **change}
    with pytest.raises(openai.BadRequestError) as excinfo:
        sync_client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, **body)
    assert param in excinfo.value.message
    ok = sync_client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


def test_oversized_and_deep_tools_are_400s_and_serving_goes_on(base_url, sync_client, model):
    """Tools whose grammar is over the structured-output budget, tools over the prompt's
    bytes, and parameters nested past what any parser takes: each a 400 naming the field."""
    wide = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "description": "x" * 40} for i in range(400)},
    }
    many = [
        {"type": "function", "function": {"name": f"f{k}", "parameters": wide}} for k in range(4)
    ]
    depth = 5000  # written as text: json.dumps itself gives up at about 1,000
    deep = '{"type":"object","properties":{"a":' * depth + "{}" + "}}" * depth
    body = json.dumps({"model": model, "messages": MESSAGES, "max_tokens": 4})[:-1]
    cases = [
        (json.dumps({"tools": many, "tool_choice": "required"}), "tools"),
        (json.dumps({"tools": many * 120}), "messages"),
        (
            '{"tools":[{"type":"function","function":{"name":"d","parameters":' + deep + "}}]}",
            "the body is not valid JSON",
        ),
    ]
    for extra, param in cases:
        reply = httpx.post(
            f"{base_url}/chat/completions",
            content=body + "," + extra[1:],
            headers={"content-type": "application/json"},
            timeout=120,
        )
        assert reply.status_code == 400, reply.text[:300]
        assert reply.json()["error"]["message"].startswith(param), reply.text[:300]
    ok = sync_client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


def test_grpc_generate_streams_the_same_calls(grpc_client, sync_client, model):
    tools = _tools(11)
    name = tools[0]["function"]["name"]
    request = router_pb2.GenerateRequest(
        messages=[router_pb2.ChatMessage(role="user", content=MESSAGES[0]["content"])],
        tools=[
            router_pb2.Tool(
                name=t["function"]["name"],
                description=t["function"]["description"],
                parameters=json.dumps(t["function"]["parameters"]),
            )
            for t in tools
        ],
        tool_choice=router_pb2.ToolChoice(function_name=name),
        sampling=greedy(MAX_TOKENS),
    )
    messages = list(grpc_client.stub.Generate(request, timeout=120))
    pieces = [piece for message in messages for piece in message.tool_calls]
    assert not "".join(message.text for message in messages)
    assert pieces[0].name == name and pieces[0].id and all(p.index == 0 for p in pieces)
    arguments = "".join(piece.arguments for piece in pieces)
    http = sync_client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": name}},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert arguments == http.choices[0].message.tool_calls[0].function.arguments
    assert messages[-1].finish_reason == router_pb2.FINISH_REASON_STOP
