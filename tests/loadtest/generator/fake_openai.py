"""A stand-in for the router's OpenAI HTTP API, for the loadtest client's tests: streams
``max_tokens`` tokens as events of ``tokens_per_event`` tokens each, ``gap_s`` apart.

A prompt (or user message) starting with one of these words picks a failure: ``http-400`` (the
request is refused), ``stream-error`` (an error event after the first tokens), ``cut`` (the
stream ends without ``[DONE]``). ``/health`` answers 503 to its first ``unhealthy_polls`` calls.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

CACHED_TOKENS = 3


@dataclass(slots=True)
class FakeServer:
    """What the server serves, and what it was sent."""

    root: str = "tiny"
    max_model_len: int = 256
    tokens_per_event: int = 2
    first_token_s: float = 0.0
    gap_s: float = 0.0
    unhealthy_polls: int = 0
    api_key: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    base_url: str = ""

    def _authorized(self, request: web.Request) -> bool:
        return not self.api_key or request.headers.get("Authorization") == f"Bearer {self.api_key}"

    async def health(self, request: web.Request) -> web.Response:
        if self.unhealthy_polls > 0:
            self.unhealthy_polls -= 1
            return web.Response(status=503)
        return web.Response(text="ok")

    async def models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        card = {"id": "fake-model", "root": self.root, "max_model_len": self.max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        body = await request.json()
        self.bodies.append(body)
        chat = request.path.endswith("/chat/completions")
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        failure = prompt.split()[0] if isinstance(prompt, str) else ""
        if failure == "http-400":
            return web.json_response({"error": {"message": "refused"}}, status=400)
        max_tokens = body["max_completion_tokens" if chat else "max_tokens"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def event(data: dict[str, Any]) -> None:
            await response.write(f"data: {json.dumps(data)}\n\n".encode())

        if chat:  # the role comes first, without content, as OpenAI's servers send it
            await event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        await asyncio.sleep(self.first_token_s)
        sent = 0
        while sent < max_tokens:
            if sent:
                await asyncio.sleep(self.gap_s)
            n = min(self.tokens_per_event, max_tokens - sent)
            text = "x" * n
            choice = {"index": 0, "delta": {"content": text}} if chat else {"text": text}
            await event({"choices": [choice]})
            sent += n
            if failure == "stream-error":
                await event({"error": {"message": "worker lost", "code": 500}})
                return response
        if failure == "cut":
            return response
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": max_tokens,
            "total_tokens": prompt_tokens + max_tokens,
            "prompt_tokens_details": {"cached_tokens": CACHED_TOKENS},
        }
        await event({"choices": [], "usage": usage})
        await response.write(b"data: [DONE]\n\n")
        return response


@contextmanager
def serving(server: FakeServer) -> Iterator[FakeServer]:
    """Serve ``server`` on a free local port from a thread of its own; ``base_url`` is set."""
    app = web.Application()
    app.router.add_get("/health", server.health)
    app.router.add_get("/v1/models", server.models)
    app.router.add_post("/v1/completions", server.generate)
    app.router.add_post("/v1/chat/completions", server.generate)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    server.base_url = f"http://127.0.0.1:{port}"
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.run_until_complete(runner.cleanup())
        loop.close()
