"""A tool-calling round trip on SmolLM2-135M-Instruct with its own chat template (which has no
tools: the router shows them in Hermes' form) through the official ``openai`` client: the
model calls a tool, the call and its result go back in the history, and the model answers."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from engine.config import EngineConfig
from engine.loader.models import resolve_model
from services.launcher import LocalCluster
from tests.engine.loader.tiny_gguf import needs_smollm2
from tests.services.conftest import Client, serving
from tests.services.openai.conftest import CLIENT_OPTIONS

pytestmark = needs_smollm2

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time now, in a time zone"},
    },
]
QUESTION = {"role": "user", "content": "What is the weather like in Paris today?"}


@pytest.fixture(scope="module")
def smollm2_cluster() -> Iterator[tuple[LocalCluster, Client]]:
    engine = EngineConfig(
        model=str(resolve_model("smollm2-135m")),
        dtype="float32",
        num_kv_blocks=256,
        max_model_len=2048,
        num_threads=1,
    )
    with serving(LocalCluster(engine=engine)) as running:
        yield running


@pytest.fixture(scope="module")
def client(smollm2_cluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{smollm2_cluster[0].http_url}/v1", **CLIENT_OPTIONS) as c:
        yield c


def test_call_result_and_answer_round_trip(client):
    model = client.models.list().data[0].id
    first = client.chat.completions.create(
        model=model,
        messages=[QUESTION],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = first.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        jsonschema.validate(arguments, WEATHER)
    assert call.function.name in ("get_weather", "get_time")

    history = [
        QUESTION,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "temp_c": 21}'},
    ]
    answer = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, max_tokens=40, temperature=0
    )
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.content and choice.message.tool_calls is None
    # The call and its result are in the prompt: it is longer than the question's by them.
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + 20
    streamed = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, max_tokens=40, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == choice.message.content
