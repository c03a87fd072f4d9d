"""How ``splitserve loadtest`` sends one request and times its tokens, per API of the router.

``loadtest.generator.runner`` schedules requests; a ``LoadClient`` sends each one and returns its
``RequestRecord``. ``GrpcClient`` speaks the router's ``Generate`` RPC; ``OpenAIClient``
(``loadtest.generator.openai_http``) its OpenAI-compatible HTTP API.
"""

from __future__ import annotations

import enum
import time
from types import TracebackType
from typing import Protocol, Self

import grpc

from loadtest.generator.metrics import RequestRecord
from loadtest.generator.synthetic import LoadRequest
from services.common.router_channel import open_router_aio_channel
from splitserve.v1 import router_pb2, router_pb2_grpc


class Backend(enum.Enum):
    """The API a loadtest speaks to the router."""

    GRPC = "grpc"
    OPENAI_CHAT = "openai-chat"  # POST /v1/chat/completions: text prompts only
    OPENAI_COMPLETIONS = "openai-completions"  # POST /v1/completions


class LoadClient(Protocol):
    """Sends requests over one connection, opened by ``async with`` (inside the event loop
    that runs the requests) and closed on leaving it."""

    backend: Backend

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None: ...

    async def send(self, request: LoadRequest, timeout_s: float) -> RequestRecord:
        """Send ``request`` (greedy, ``ignore_eos``: it generates exactly ``max_tokens``), time
        each arrival of tokens, and return its record; failures are recorded, never raised."""
        ...


class GrpcClient:
    """``Router.Generate`` at ``target``, presenting ``api_key`` (TLS verified against
    ``ca_file`` when given). Entering waits until the channel is connected."""

    backend = Backend.GRPC

    def __init__(self, target: str, api_key: str = "", ca_file: str = "") -> None:
        self.target = target
        self._api_key = api_key
        self._ca_file = ca_file
        self._channel: grpc.aio.Channel | None = None
        self._stub: router_pb2_grpc.RouterStub | None = None

    async def __aenter__(self) -> Self:
        self._channel = open_router_aio_channel(self.target, self._api_key, self._ca_file)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        await self._channel.channel_ready()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._channel is not None
        await self._channel.close()
        self._channel = self._stub = None

    async def send(self, request: LoadRequest, timeout_s: float) -> RequestRecord:
        assert self._stub is not None, "send outside `async with`"
        sampling = router_pb2.SamplingParams(
            max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True
        )
        # Text prompts (datasets) go as text: the router tokenizes them as its HTTP API does, so
        # both APIs do the same work per request, and into the tokens the dataset was filtered by.
        message = (
            router_pb2.GenerateRequest(prompt=request.prompt_text, sampling=sampling)
            if request.prompt_text is not None
            else router_pb2.GenerateRequest(token_ids=request.prompt_token_ids, sampling=sampling)
        )
        record = RequestRecord(
            sent_s=time.perf_counter(), prompt_tokens=len(request.prompt_token_ids)
        )
        try:
            async for response in self._stub.Generate(message, timeout=timeout_s):
                if response.token_ids:
                    record.token_times_s.append(time.perf_counter())
                    record.token_counts.append(len(response.token_ids))
                if response.HasField("usage"):
                    record.prompt_tokens = response.usage.prompt_tokens
                    record.cached_tokens = response.usage.cached_tokens
            record.end_s = time.perf_counter()
        except grpc.aio.AioRpcError as exc:
            record.error = exc.code().name
        return record
