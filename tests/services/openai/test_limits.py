"""Bounded memory and time for what the HTTP API accepts (issue 37): a request's budget (n,
logprobs, generations x max_tokens), clients that read nothing, and the server's own limits
(head size, head and body read timeouts, keep-alive, connection cap), each tried by a raw
socket against a real router over a stand-in decode worker."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest

from services.router.app import RunningRouter
from services.router.config import RouterConfig
from splitserve.v1 import router_pb2, router_pb2_grpc
from tests.services.openai.standin import (
    MAX_MODEL_LEN,
    StandInDecodeWorker,
    freed,
    standin_router,
    vocab_size,
    wait_for,
)
from tests.services.openai.test_errors import get, post

WAIT_S = 60.0


def worker_for(model_dir: Path, stall_after: int | None = None) -> StandInDecodeWorker:
    return StandInDecodeWorker(vocab_size(model_dir), stall_after)


def request_bytes(path: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


def non_reader(port: int, body: dict[str, Any]) -> socket.socket:
    """A connection that sends a streamed completions request and then reads nothing, with a
    4 KB receive buffer (as a stalled client's)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(request_bytes("/v1/completions", {**body, "stream": True}))
    return sock


def read_until_closed(sock: socket.socket, timeout_s: float = WAIT_S) -> bytes:
    """Everything the server sends until it closes the connection (a reset ends it too);
    ``TimeoutError`` if it is still open after ``timeout_s``."""
    sock.settimeout(timeout_s)
    reply = b""
    try:
        while data := sock.recv(65536):
            reply += data
    except ConnectionResetError:
        pass
    return reply


def pulled_messages(router: RunningRouter) -> list[int]:
    """A counter, ``[n]``, of the messages the router's request path has handed the HTTP API
    (each generation's ``RouterServicer.generate``): what the router has taken from its
    workers, whether or not it has sent it on."""
    count = [0]
    generate = router.servicer.generate

    async def counted(*args: Any, **kwargs: Any) -> AsyncIterator[router_pb2.GenerateResponse]:
        async for message in generate(*args, **kwargs):
            count[0] += 1
            yield message

    router.servicer.generate = counted
    return count


async def until_steady(read: Any, steady_s: float, timeout_s: float) -> int:
    """``read()`` once it has not changed for ``steady_s`` (or has reached its end)."""
    loop = asyncio.get_running_loop()
    deadline_s = loop.time() + timeout_s
    value, since_s = read(), loop.time()
    while loop.time() - since_s < steady_s:
        if loop.time() >= deadline_s:
            raise AssertionError(f"still changing after {timeout_s:g} s (now {value})")
        await asyncio.sleep(0.05)
        if read() != value:
            value, since_s = read(), loop.time()
    return value


# ------------------------------------------------------------------------ the request budget
BUDGET = {"max_n": 4, "max_logprobs": 5, "max_request_output_tokens": 1000}
CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/v1/completions", {"prompt": "x", "n": 5}, "n", "at most 4 (max_n), got 5"),
        ("/v1/chat/completions", {"messages": CHAT, "n": 5}, "n", "at most 4 (max_n)"),
        ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs", "at most 5"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "logprobs": True, "top_logprobs": 6, "max_tokens": 1},
            "top_logprobs",
            "at most 5 (max_logprobs)",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "n": 4, "max_tokens": 251},
            "max_tokens",
            "4 generations x 251 tokens is more than 1000",
        ),
        (
            "/v1/completions",
            {"prompt": ["a", "b"], "n": 2, "max_tokens": 300},
            "max_tokens",
            "4 generations x 300 tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "n": 2},
            "max_tokens",
            f"not set, so 2 generations x {MAX_MODEL_LEN} tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "n": 2, "max_completion_tokens": 501},
            "max_completion_tokens",
            "max_request_output_tokens",
        ),
    ],
)
def test_a_request_over_its_budget_is_refused_naming_the_field_before_any_work(
    tiny_llama_dir, path, body, param, words
):
    worker = worker_for(tiny_llama_dir)

    async def run() -> None:
        async with standin_router(tiny_llama_dir, worker, **BUDGET) as router:
            url = f"http://127.0.0.1:{router.http_port}{path}"
            status, reply = await asyncio.to_thread(post, url, json.dumps(body).encode())
            assert status == 400, reply
            error = reply["error"]
            assert error["param"] == param and words in error["message"], error
            assert worker.num_calls == 0 and router.servicer._num_inflight == 0

    asyncio.run(run())


def test_a_request_within_its_budget_is_served_and_grpc_gets_the_same_bounds(tiny_llama_dir):
    worker = worker_for(tiny_llama_dir)

    async def run() -> None:
        async with standin_router(tiny_llama_dir, worker, **BUDGET) as router:
            body = {"prompt": "x", "n": 4, "max_tokens": 250, "logprobs": 5}
            url = f"http://127.0.0.1:{router.http_port}/v1/completions"
            status, reply = await asyncio.to_thread(post, url, json.dumps(body).encode())
            assert status == 200, reply
            assert [c["finish_reason"] for c in reply["choices"]] == ["length"] * 4
            assert reply["usage"]["completion_tokens"] == 1000
            num_calls = worker.num_calls
            async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                for sampling, words in (
                    (router_pb2.SamplingParams(logprobs=6), "sampling.logprobs: 6, more than 5"),
                    (
                        router_pb2.SamplingParams(max_tokens=1001),
                        "more than 1000 (max_request_output_tokens)",
                    ),
                ):
                    request = router_pb2.GenerateRequest(prompt="x", sampling=sampling)
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await stub.Generate(request).read()
                    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert words in caught.value.details()
            assert worker.num_calls == num_calls

    asyncio.run(run())


# ------------------------------------------------------------------------ clients that do not read
def test_a_fan_out_the_client_does_not_read_stops_pulling_from_the_workers(tiny_llama_dir):
    """n=4 choices of 10,000 tokens with 20 logprobs each, to a client that reads nothing:
    the router takes from its workers only what the connection's buffers hold, not all
    40,000 messages; once the client goes, every generation is cancelled."""
    worker = worker_for(tiny_llama_dir)
    total = 4 * 10_000

    async def run() -> None:
        async with standin_router(tiny_llama_dir, worker) as router:
            pulled = pulled_messages(router)
            body = {"prompt": "x", "n": 4, "max_tokens": total // 4, "logprobs": 20}
            sock = non_reader(router.http_port, body)
            try:
                await wait_for(lambda: pulled[0] > 0, WAIT_S, "the first message")
                steady = await until_steady(lambda: pulled[0], steady_s=1.0, timeout_s=120.0)
                # What is pulled but unread sits in the kernel's socket buffers and uvicorn's
                # 64 KiB one (a few thousand chunks of ~1.5 KB), far from every message.
                assert steady < total // 2, f"{steady} of {total} messages pulled"
                assert worker.num_calls == 4
            finally:
                sock.close()
            await wait_for(lambda: freed(router, worker), WAIT_S, "the fan-out's cancellation")

    asyncio.run(run())


def test_a_stream_the_client_does_not_read_stops_its_worker_within_small_buffers(tiny_llama_dir):
    """A plain stream (n=1, 20,000 tokens) to a client that reads nothing: the worker's writes
    stop once the connection's send buffer (--http-send-buffer-bytes, not the megabytes the
    kernel autotunes to) and the router's 4 KiB gRPC read-ahead are full: about 2,000 tokens
    of ~130-byte SSE chunks, where it used to send all 20,000 before any backpressure."""
    worker = worker_for(tiny_llama_dir)
    total = 20_000

    async def run() -> None:
        async with standin_router(tiny_llama_dir, worker) as router:
            sock = non_reader(router.http_port, {"prompt": "x", "max_tokens": total})
            try:
                await wait_for(lambda: worker.num_sent > 0, WAIT_S, "the first token")
                steady = await until_steady(lambda: worker.num_sent, steady_s=1.0, timeout_s=120.0)
                assert steady < 3000, f"{steady} of {total} tokens sent"
            finally:
                sock.close()
            await wait_for(lambda: freed(router, worker), WAIT_S, "the stream's cancellation")

    asyncio.run(run())


def test_a_stream_left_unread_ends_after_the_idle_timeout_and_is_freed_everywhere(
    tiny_llama_dir, caplog
):
    """A streaming client that stays connected and reads nothing: after
    --stream-idle-timeout-s of blocked sends the router cuts the connection and cancels the
    generation, so its worker call, its slot on the worker and the router's are freed."""
    caplog.set_level(logging.INFO, "services.router.openai")
    worker = worker_for(tiny_llama_dir)

    async def run() -> None:
        async with standin_router(tiny_llama_dir, worker, stream_idle_timeout_s=1.0) as router:
            body = {"prompt": "x", "max_tokens": MAX_MODEL_LEN - 100, "logprobs": 20}
            sock = non_reader(router.http_port, body)
            try:
                await wait_for(lambda: worker.num_calls == 1, WAIT_S, "the worker call")
                await wait_for(lambda: freed(router, worker), WAIT_S, "the stream's end")
                assert worker.num_cancelled == 1
                await asyncio.to_thread(read_until_closed, sock)  # closed, not left open
            finally:
                sock.close()
        assert any("read nothing for 1.0 s" in r.getMessage() for r in caplog.records)

    asyncio.run(run())


def test_a_grpc_stream_left_unread_ends_after_the_idle_timeout_and_is_freed_everywhere(
    tiny_llama_dir, caplog
):
    """The same over gRPC ``Router.Generate``: for a client whose flow-control window is full
    (1 KiB read-ahead, nothing read), the request is freed on its workers and the router after
    --stream-idle-timeout-s, and the call ends ABORTED when the client reads again."""
    caplog.set_level(logging.INFO, "services.router.server")
    worker = worker_for(tiny_llama_dir)
    options = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]

    async def run() -> None:
        async with standin_router(tiny_llama_dir, worker, stream_idle_timeout_s=1.0) as router:
            target = f"127.0.0.1:{router.port}"
            async with grpc.aio.insecure_channel(target, options=options) as channel:
                sampling = router_pb2.SamplingParams(max_tokens=MAX_MODEL_LEN - 100, logprobs=20)
                request = router_pb2.GenerateRequest(prompt="x", sampling=sampling)
                call = router_pb2_grpc.RouterStub(channel).Generate(request)
                await wait_for(lambda: worker.num_calls == 1, WAIT_S, "the worker call")
                await wait_for(lambda: freed(router, worker), WAIT_S, "the stream's end")
                assert worker.num_cancelled == 1
                # Reading again, it gets what was sent, then the status.
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    async with asyncio.timeout(WAIT_S):
                        async for _ in call:
                            pass
                assert ended.value.code() == grpc.StatusCode.ABORTED
                assert "took no output for 1 s" in (ended.value.details() or "")
        assert any("took no output for 1.0 s" in r.getMessage() for r in caplog.records)

    asyncio.run(run())


# ------------------------------------------------------------------------ the server's limits
def test_a_huge_request_head_is_refused_without_being_held(tiny_llama_dir):
    """A 200 MB header: refused (431, or the connection closed) after about
    --http-max-header-bytes, and the router's memory does not grow by it."""
    worker = worker_for(tiny_llama_dir)
    head_limit = 16384
    size = 200 * 2**20

    def send_huge_head(port: int) -> tuple[int, bytes]:
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
            sock.sendall(b"GET /version HTTP/1.1\r\nhost: x\r\nx-huge: ")
            chunk, sent = b"a" * 2**20, 0
            try:
                while sent < size:
                    sock.sendall(chunk)
                    sent += len(chunk)
                sock.sendall(b"\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass
            return sent, read_until_closed(sock)

    async def run() -> None:
        async with standin_router(
            tiny_llama_dir, worker, http_max_header_bytes=head_limit
        ) as router:
            rss = psutil.Process().memory_info().rss
            sent, reply = await asyncio.to_thread(send_huge_head, router.http_port)
            growth_mib = (psutil.Process().memory_info().rss - rss) / 2**20
            assert sent < size, "the whole head was taken"
            assert reply == b"" or reply.startswith(b"HTTP/1.1 431 "), reply[:200]
            assert growth_mib < 64, f"the router grew by {growth_mib:.0f} MiB"
            await _one_more_request(router)  # it serves on

    asyncio.run(run())


def test_a_head_trickled_byte_by_byte_is_cut_at_the_header_timeout(tiny_llama_dir):
    worker = worker_for(tiny_llama_dir)

    def trickle(port: int) -> bytes:
        """Send one header byte every 0.2 s until the server closes (at most 30 s)."""
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nx-slow: ")
            sock.settimeout(0.2)
            reply = b""
            deadline_s = time.monotonic() + 30.0
            while time.monotonic() < deadline_s:
                try:
                    data = sock.recv(65536)
                except TimeoutError:
                    sock.sendall(b"a")
                    continue
                except ConnectionResetError:
                    return reply
                if not data:
                    return reply
                reply += data
            raise AssertionError(f"still connected after 30 s of trickling (got {reply!r})")

    async def run() -> None:
        async with standin_router(tiny_llama_dir, worker, http_header_timeout_s=1.0) as router:
            reply = await asyncio.to_thread(trickle, router.http_port)
            assert reply.startswith(b"HTTP/1.1 408 ") and b"http_header_timeout_s" in reply

    asyncio.run(run())


def test_a_body_stopped_half_way_is_cut_at_the_body_timeout(tiny_llama_dir, caplog):
    caplog.set_level(logging.INFO)
    worker = worker_for(tiny_llama_dir)

    def half_a_body(port: int) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
            whole = request_bytes("/v1/completions", {"prompt": "x" * 2000})
            sock.sendall(whole[: len(whole) - 1000])
            return read_until_closed(sock)

    async def run() -> None:
        async with standin_router(tiny_llama_dir, worker, http_body_timeout_s=1.0) as router:
            reply = await asyncio.to_thread(half_a_body, router.http_port)
            assert reply.startswith(b"HTTP/1.1 408 ") and b"http_body_timeout_s" in reply
            await _one_more_request(router)
        assert worker.num_calls == 0
        lines = [r for r in caplog.records if "request body" in r.getMessage()]
        assert len(lines) == 1 and "within 1.0 s" in lines[0].getMessage()
        assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"

    asyncio.run(run())


def test_a_client_leaving_mid_upload_is_one_quiet_log_line(tiny_llama_dir, caplog):
    caplog.set_level(logging.INFO)
    worker = worker_for(tiny_llama_dir)

    def leave_mid_upload(port: int) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
            whole = request_bytes("/v1/completions", {"prompt": "x" * 2000})
            sock.sendall(whole[: len(whole) - 1000])

    def went_away() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "went away during its request body" in r.message]

    async def run() -> None:
        async with standin_router(tiny_llama_dir, worker) as router:
            await asyncio.to_thread(leave_mid_upload, router.http_port)
            await wait_for(lambda: went_away(), WAIT_S, "the log line")
            # The route reading that body has seen the disconnect by the time a whole new
            # request has been served on the same loop.
            await _one_more_request(router)
        assert len(went_away()) == 1
        assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
        assert not [r for r in caplog.records if "Exception in ASGI" in r.getMessage()]

    asyncio.run(run())


def test_an_idle_kept_alive_connection_closes_after_the_keep_alive_timeout(tiny_llama_dir):
    worker = worker_for(tiny_llama_dir)

    def one_request_then_idle(port: int) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
            sock.sendall(b"GET /version HTTP/1.1\r\nhost: x\r\n\r\n")
            return read_until_closed(sock)

    async def run() -> None:
        async with standin_router(tiny_llama_dir, worker, http_keep_alive_timeout_s=0.5) as router:
            reply = await asyncio.to_thread(one_request_then_idle, router.http_port)
            assert reply.startswith(b"HTTP/1.1 200 ") and b'"version"' in reply

    asyncio.run(run())


def test_connections_beyond_the_cap_get_503_until_one_closes(tiny_llama_dir):
    worker = worker_for(tiny_llama_dir)

    def version(port: int) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
            sock.sendall(b"GET /version HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            return read_until_closed(sock)

    async def run() -> None:
        async with standin_router(tiny_llama_dir, worker, http_max_connections=2) as router:
            port = router.http_port
            held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
            try:
                reply = await asyncio.to_thread(version, port)
                assert reply.startswith(b"HTTP/1.1 503 ") and b"http_max_connections" in reply
            finally:
                held.pop().close()
            replies: list[bytes] = []

            def served() -> bool:
                return bool(replies) and replies[-1].startswith(b"HTTP/1.1 200 ")

            while not served():  # once the server has seen the close
                replies.append(await asyncio.to_thread(version, port))
                assert len(replies) < 1000, replies[-1][:200]
            held.pop().close()

    asyncio.run(run())


async def _one_more_request(router: RunningRouter) -> None:
    url = f"http://127.0.0.1:{router.http_port}/version"
    assert (await asyncio.to_thread(get, url))[0] == 200


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("max_n", 0, "max_n must be in [1, 128], got 0"),
        ("max_n", 129, "max_n must be in [1, 128]"),
        ("max_logprobs", 21, "max_logprobs must be in [0, 20], got 21"),
        ("max_request_output_tokens", 0, "max_request_output_tokens must be >= 1"),
        ("http_max_header_bytes", 0, "http_max_header_bytes must be >= 1"),
        ("http_max_connections", 0, "http_max_connections must be >= 1"),
        ("http_send_buffer_bytes", 0, "http_send_buffer_bytes must be >= 1"),
        ("stream_idle_timeout_s", 0.0, "stream_idle_timeout_s must be > 0"),
        ("http_header_timeout_s", -1.0, "http_header_timeout_s must be > 0"),
        ("http_body_timeout_s", 0.0, "http_body_timeout_s must be > 0"),
        ("http_keep_alive_timeout_s", 0.0, "http_keep_alive_timeout_s must be > 0"),
    ],
)
def test_a_bad_limit_is_a_one_line_error_naming_its_flag(field, value, words):
    with pytest.raises(ValueError) as caught:
        RouterConfig(model="m", **{field: value})
    assert str(caught.value).startswith(words)
