"""The router's memory for a non-streaming response with many logprobs (issue 37): what it
holds grows with a compact form of the tokens (arrays of ids and floats), not with the JSON
body or a Python object per token. The router runs in this process, so ``tracemalloc`` sees
its allocations; the client reads the body and drops it."""

from __future__ import annotations

import asyncio
import http.client
import json
import tracemalloc

from tests.services.openai.standin import StandInDecodeWorker, standin_router, vocab_size

N = 16
MAX_TOKENS = 512
TOP_LOGPROBS = 20
# Held per token: the arrays' 172 bytes at 20 alternatives, plus the serializer's pieces and
# gRPC's buffers (about 480 in all here); the old body (dicts per token, then the whole JSON
# text and its bytes) peaked at about 9 KB per token.
MAX_PEAK_BYTES_PER_TOKEN = 2048


def read_and_drop(port: int, body: dict[str, object]) -> tuple[int, str, int, bytes]:
    """POST ``body`` to the chat endpoint; its status, content type, body size and last bytes
    (the body itself is not kept: its size would count as the router's)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        connection.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(body),
            {"content-type": "application/json"},
        )
        reply = connection.getresponse()
        size, tail = 0, b""
        while data := reply.read(1 << 16):
            size += len(data)
            tail = (tail + data)[-256:]
        return reply.status, reply.getheader("content-type", ""), size, tail
    finally:
        connection.close()


def test_a_whole_chat_response_with_top_logprobs_holds_a_compact_form_per_token(
    tiny_llama_dir,
):
    worker = StandInDecodeWorker(vocab_size(tiny_llama_dir))
    num_tokens = N * MAX_TOKENS
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "n": N,
        "max_tokens": MAX_TOKENS,
        "logprobs": True,
        "top_logprobs": TOP_LOGPROBS,
    }

    async def run() -> None:
        async with standin_router(tiny_llama_dir, worker) as router:
            port = router.http_port
            assert port is not None
            tracemalloc.start()
            try:
                before, _ = tracemalloc.get_traced_memory()
                tracemalloc.reset_peak()
                status, content_type, size, tail = await asyncio.to_thread(
                    read_and_drop, port, body
                )
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert status == 200 and content_type == "application/json"
            assert f'"completion_tokens":{num_tokens},'.encode() in tail, tail
            per_token = (peak - before) / num_tokens
            assert per_token < MAX_PEAK_BYTES_PER_TOKEN, (
                f"{peak - before} bytes at peak for {num_tokens} tokens ({per_token:.0f} per"
                f" token), body {size} bytes"
            )

    asyncio.run(run())
