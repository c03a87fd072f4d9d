"""The loadtest's OpenAI HTTP client against a fake server: what it sends, how it times and
counts streamed tokens, how failures are recorded, and how it waits for a server."""

from __future__ import annotations

import asyncio
import io
import socket
import time

import pytest

from loadtest.generator.backends import Backend
from loadtest.generator.metrics import RequestRecord
from loadtest.generator.openai_http import ModelCard, OpenAIClient, ServerRefused, wait_for_model
from loadtest.generator.synthetic import LoadRequest
from services.startup import ClusterNotReady, WaitMessages
from tests.loadtest.generator.fake_openai import CACHED_TOKENS, FakeServer, serving


def send(
    server: FakeServer, backend: Backend, requests: list[LoadRequest], api_key: str = ""
) -> list[RequestRecord]:
    async def go() -> list[RequestRecord]:
        async with OpenAIClient(backend, server.base_url, "fake-model", api_key) as client:
            return [await client.send(r, timeout_s=10) for r in requests]

    return asyncio.run(go())


def test_completions_send_token_ids_and_count_the_server_usage():
    with serving(FakeServer(tokens_per_event=2)) as server:
        (record,) = send(server, Backend.OPENAI_COMPLETIONS, [LoadRequest((5, 6, 7), 7, "chat")])
    assert server.bodies == [
        {
            "model": "fake-model",
            "prompt": [5, 6, 7],
            "max_tokens": 7,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ]
    assert record.ok and record.error is None
    # 4 events of 2, 2, 2, 1 tokens, each counted as one; usage says 7: the rest on the last.
    assert record.token_counts == [1, 1, 1, 4] and record.output_tokens == 7
    assert (record.prompt_tokens, record.cached_tokens) == (3, CACHED_TOKENS)


def test_chat_sends_text_and_times_each_event_with_content():
    with serving(FakeServer(tokens_per_event=1, first_token_s=0.1, gap_s=0.03)) as server:
        request = LoadRequest((1, 2), 4, "sharegpt", prompt_text="two words")
        (record,) = send(server, Backend.OPENAI_CHAT, [request])
    (body,) = server.bodies
    assert body["messages"] == [{"role": "user", "content": "two words"}]
    assert body["max_completion_tokens"] == 4 and "max_tokens" not in body
    assert record.ok and record.token_counts == [1, 1, 1, 1]  # the role event is no token
    assert record.ttft_s is not None and record.ttft_s >= 0.1
    assert all(gap >= 0.025 for gap in record.itl_s()) and len(record.itl_s()) == 3
    assert record.end_s is not None and record.end_s >= record.token_times_s[-1]
    assert record.prompt_tokens == 2  # the server's count of the text


def test_completions_send_a_dataset_prompt_as_text():
    with serving(FakeServer()) as server:
        send(server, Backend.OPENAI_COMPLETIONS, [LoadRequest((1, 2, 3), 2, "jsonl", "a b c")])
    assert server.bodies[0]["prompt"] == "a b c"


@pytest.mark.parametrize(
    ("prompt", "error"),
    [
        ("http-400 x", "HTTP 400"),
        ("stream-error x", "stream error"),
        ("cut x", "incomplete stream"),
    ],
)
def test_failures_are_recorded(prompt, error):
    with serving(FakeServer()) as server:
        (record,) = send(
            server, Backend.OPENAI_COMPLETIONS, [LoadRequest((1,), 4, "jsonl", prompt)]
        )
    assert record.error == error and not record.ok


def test_a_connection_error_records_its_class_name():
    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = FakeServer(base_url=f"http://127.0.0.1:{port}")
    (record,) = send(server, Backend.OPENAI_COMPLETIONS, [LoadRequest((1,), 4, "chat")])
    assert record.error == "ClientConnectorError"


def test_the_api_key_goes_as_a_bearer_token():
    with serving(FakeServer(api_key="k1")) as server:
        good, bad = (
            send(server, Backend.OPENAI_COMPLETIONS, [LoadRequest((1,), 2, "chat")], key)[0]
            for key in ("k1", "wrong")
        )
    assert good.ok and bad.error == "HTTP 401"


def test_wait_for_model_waits_for_health_then_lists_the_model():
    stderr = io.StringIO()
    with serving(FakeServer(root="/models/tiny", unhealthy_polls=2)) as server:
        card = asyncio.run(
            wait_for_model(server.base_url, time.monotonic() + 30, WaitMessages(stderr))
        )
    assert card == ModelCard("fake-model", "/models/tiny", 256)
    assert stderr.getvalue() == "waiting for the cluster: GET /health answers HTTP 503\n"


def test_wait_for_model_gives_up_at_the_deadline_and_at_a_refusal():
    with serving(FakeServer(unhealthy_polls=1000, api_key="k1")) as server:
        with pytest.raises(ClusterNotReady, match="HTTP 503"):
            asyncio.run(
                wait_for_model(server.base_url, time.monotonic() + 1, WaitMessages(io.StringIO()))
            )
        server.unhealthy_polls = 0
        with pytest.raises(ServerRefused, match="/v1/models: HTTP 401"):
            asyncio.run(
                wait_for_model(server.base_url, time.monotonic() + 30, WaitMessages(io.StringIO()))
            )
