"""Every error class of the HTTP API with its status and OpenAI's JSON shape, on real routers;
a client that goes away mid-request leaves no work behind on any worker."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest

from services.router.app import start_router
from services.router.config import RouterConfig
from services.service_process import free_port
from tests.services.openai.conftest import CLIENT_OPTIONS
from tests.services.openai.standin import (
    StandInDecodeWorker,
    freed,
    standin_router,
    vocab_size,
    wait_for,
)

ADMIN = "admin-key-for-the-http-tests-0123"
DATA = "data-key-for-the-http-tests-01234"


def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(
        url, data=body, headers={"content-type": "application/json", **(headers or {})}
    )
    return _call(request)


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    return _call(urllib.request.Request(url, headers=headers or {}))


def _call(request: urllib.request.Request) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def assert_error_shape(body: Any, error_type: str) -> dict[str, Any]:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type and error["message"]
    return error


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": "x", "temperature": -1}, "temperature", "temperature must be >= 0"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "0 needs echo"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
        ({"prompt": "x", "max_tokens": 100000}, "max_tokens", "exceeds the context"),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", "at most 20 (max_logprobs)"),
        ({"prompt": []}, "prompt", "must not be empty"),
        ({"prompt": [1, "a"]}, "prompt", ""),
        ({"prompt": [99999999]}, "token_ids", "outside the vocabulary"),
        ({"prompt": "x", "n": 17}, "n", "at most 16 (max_n), got 17"),
        ({"prompt": "x", "logprobs": 21}, "logprobs", "at most 20 (max_logprobs)"),
        ({"prompt": "x", "stop": [""]}, "stop", "non-empty"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", ""),
        ({"prompt": "x", "logit_bias": {"5": 1}}, "logit_bias", "not supported"),
    ],
)
def test_bad_completions_get_400_naming_the_field(base_url, body, param, words):
    status, reply = post(f"{base_url}/completions", json.dumps(body).encode())
    assert status == 400
    error = assert_error_shape(reply, "invalid_request_error")
    assert error["param"] == param and words in error["message"]


def test_bad_chat_requests_get_400(base_url):
    cases = [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools[0].function",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
            "tool_choice",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
            "top_logprobs",
        ),
    ]
    for body, param in cases:
        status, reply = post(f"{base_url}/chat/completions", json.dumps(body).encode())
        assert status == 400, body
        assert assert_error_shape(reply, "invalid_request_error")["param"] == param, reply


def test_malformed_and_oversized_bodies_get_clear_errors(base_url):
    status, reply = post(f"{base_url}/completions", b"{not json")
    assert (
        status == 400
        and "not valid JSON" in assert_error_shape(reply, "invalid_request_error")["message"]
    )
    status, reply = post(f"{base_url}/completions", b"[1, 2]")
    assert status == 400
    # A huge body is refused from its declared length, before it is read.
    host_port = base_url.removeprefix("http://").removesuffix("/v1")
    host, port = host_port.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 1000000000\r\n\r\n"
        )
        reply = b""
        while b"larger than" not in reply and (data := sock.recv(65536)):
            reply += data  # the head and the body may come in separate segments
    assert reply.startswith(b"HTTP/1.1 413") and b"larger than" in reply


def test_unknown_model_and_path_get_404(sync_client, base_url):
    with pytest.raises(openai.NotFoundError) as caught:
        sync_client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert caught.value.body["code"] == "model_not_found"
    assert caught.value.body["param"] == "model"
    status, reply = get(f"{base_url}/no-such-endpoint")
    assert status == 404
    assert_error_shape(reply, "not_found_error")


def test_unknown_fields_are_ignored(sync_client, model):
    got = sync_client.completions.create(
        model=model, prompt="x", max_tokens=2, extra_body={"not_a_field": [1, 2], "user": "u1"}
    )
    assert got.usage.completion_tokens == 2


# ------------------------------------------------------------------------ keys and admission
@pytest.fixture(scope="module")
def keyed_cluster(start_cluster, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text(f"{ADMIN} admin\n{DATA} data\n")
    cluster, client = start_cluster(
        admin_api_key=ADMIN,
        extra_router_flags=("--api-key-file", str(key_file), "--max-inflight-requests", "1"),
    )
    return f"{cluster.http_url}/v1", client


def test_api_keys_401_and_403(keyed_cluster):
    base_url, _ = keyed_cluster
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    status, reply = post(f"{base_url}/completions", body)
    assert (
        status == 401
        and assert_error_shape(reply, "authentication_error")["code"] == "invalid_api_key"
    )
    status, reply = post(
        f"{base_url}/completions", body, {"authorization": "Bearer wrong-key-0123456789"}
    )
    assert status == 401
    status, reply = post(f"{base_url}/completions", body, {"authorization": f"Bearer {DATA}"})
    assert status == 200 and reply["usage"]["completion_tokens"] == 1
    root = base_url.removesuffix("/v1")
    status, reply = get(f"{root}/status", {"authorization": f"Bearer {DATA}"})
    assert status == 403 and assert_error_shape(reply, "permission_error")
    status, reply = get(f"{root}/status", {"authorization": f"Bearer {ADMIN}"})
    assert status == 200 and len(reply["workers"]) == 2
    tokenize = json.dumps({"prompt": "x"}).encode()
    assert post(f"{root}/tokenize", tokenize)[0] == 401
    status, reply = post(f"{root}/tokenize", tokenize, {"authorization": f"Bearer {DATA}"})
    assert status == 200 and reply["count"] >= 1
    # Probes and scrapes carry no key.
    assert get(f"{root}/health")[0] == 200
    with urllib.request.urlopen(f"{root}/metrics", timeout=60) as reply:
        assert reply.status == 200 and b"splitserve_router_requests_total" in reply.read()


def test_over_the_inflight_limit_is_429(keyed_cluster):
    base_url, grpc_client = keyed_cluster
    with openai.OpenAI(base_url=base_url, **{**CLIENT_OPTIONS, "api_key": DATA}) as client:
        model = client.models.list().data[0].id
        stream = client.completions.create(
            model=model, prompt="hold", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model=model, prompt="x", max_tokens=1)
        assert "max_inflight_requests" in caught.value.body["message"]
        stream.close()
    grpc_client.wait_idle()


def test_no_decode_worker_is_503(tiny_llama_dir):
    async def run() -> None:
        config = RouterConfig(
            model=str(tiny_llama_dir),
            port=0,
            http_port=0,
            decode_workers=f"127.0.0.1:{free_port()}",
            mode="colocated",
        )
        router = await start_router(config)
        try:
            client = openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{router.http_port}/v1", **CLIENT_OPTIONS
            )
            async with client:
                with pytest.raises(openai.InternalServerError) as caught:
                    await client.completions.create(model=str(tiny_llama_dir), prompt="x")
            assert caught.value.status_code == 503
            assert caught.value.body["type"] == "service_unavailable_error"
            status, reply = await asyncio.to_thread(
                get, f"http://127.0.0.1:{router.http_port}/health"
            )
            assert status == 503 and "no decode worker" in reply["error"]["message"]
        finally:
            await router.stop()

    asyncio.run(run())


# ------------------------------------------------------------------------ disconnects
def test_client_disconnect_mid_stream_frees_every_worker(sync_client, grpc_client, model):
    stream = sync_client.completions.create(
        model=model, prompt="go", max_tokens=1000, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    assert grpc_client.status().num_inflight_requests == 1
    stream.close()
    grpc_client.wait_idle()


def test_client_timeout_on_a_whole_response_frees_every_worker(tiny_llama_dir):
    """A client that gives up on a whole response (times out: it closes its connection) while
    its two choices generate: both generations are cancelled on their worker and every slot is
    freed. The stand-in's generations stop after one token until cancelled, so the client
    always gives up first, on any host."""
    worker = StandInDecodeWorker(vocab_size(tiny_llama_dir), stall_after=1)

    async def run() -> None:
        async with standin_router(tiny_llama_dir, worker) as router:
            client = openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{router.http_port}/v1", **CLIENT_OPTIONS
            )
            async with client:
                request = asyncio.create_task(
                    client.chat.completions.create(
                        model=str(tiny_llama_dir),
                        messages=[{"role": "user", "content": "long"}],
                        max_tokens=1000,
                        n=2,
                    )
                )
                await wait_for(lambda: worker.num_sent == 2, 60, "a token of each choice")
                request.cancel()  # the client's timeout
                with pytest.raises(asyncio.CancelledError):
                    await request
            await wait_for(lambda: freed(router, worker), 60, "every generation freed")
            assert worker.num_cancelled == worker.num_calls == 2

    asyncio.run(run())
