"""Run one HTTP request's generations through the router's request path, merge them and
answer the request: the whole body once every generation ended, or a stream of chunks.

Every generation is ``RouterServicer.generate``, the code path of gRPC ``Generate``. With
several choices of one prompt, the first runs alone until its first token (its prefill) and
the others then start: they find the prompt's blocks in the prefix cache instead of computing
them again. Closing or cancelling the merged iteration cancels every generation (each aborts
on its workers and frees its blocks).

Memory is bounded by what the client reads: the merged messages pass through a queue of
``_QUEUED_PER_CHOICE`` messages per choice, and a generation whose message finds it full waits,
reading nothing more from its worker. gRPC flow control then stops the worker's writes, and the
worker's engine pauses the request (the single-choice path has no queue: the client's reads
pull each message straight through).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from services.common.tracing import TRACE_HEADERS
from services.router.call_context import CallAborted, HttpCallContext
from services.router.openai.errors import from_call_aborted
from services.router.openai.protocol import StreamUsage
from services.router.openai.requests import GenerationPlan
from services.router.openai.streaming import (
    ClientDisconnected,
    EventStreamResponse,
    JsonPiecesResponse,
    until_disconnect,
)
from services.router.request_prep import MaxTokensDefault
from splitserve.v1 import router_pb2

if TYPE_CHECKING:
    from services.router.openai.responses import ResponseBuilder
    from services.router.server import RouterServicer

logger = logging.getLogger(__name__)


async def respond(
    servicer: RouterServicer,
    request: Request,
    builder: ResponseBuilder,
    stream: bool,
    usage: StreamUsage,
) -> Response:
    """Run ``builder.plan``'s generations and answer ``request`` with what ``builder`` makes of
    them: server-sent chunks (``stream``; the usage chunk last unless ``usage`` is ``NONE``),
    or the whole body once they all ended (499 and nothing else when the client went first)."""
    # The W3C trace context travels on as the worker calls' metadata.
    context = HttpCallContext(
        [(key, request.headers[key]) for key in TRACE_HEADERS if key in request.headers]
    )
    if stream:
        return EventStreamResponse(_chunks(servicer, builder, context, usage))
    try:
        await until_disconnect(request.receive, _whole(servicer, builder, context))
    except ClientDisconnected:
        logger.debug("%s: client disconnected; request cancelled", builder.response_id)
        return Response(status_code=499)
    return JsonPiecesResponse(builder.body())


async def _chunks(
    servicer: RouterServicer,
    builder: ResponseBuilder,
    context: HttpCallContext,
    usage: StreamUsage,
) -> AsyncGenerator[dict[str, Any], None]:
    messages = run_plan(servicer, builder.plan, context)
    try:
        async for item in messages:
            chunk = builder.chunk(item, usage)
            if chunk is not None:
                yield chunk
    finally:
        await messages.aclose()
    if usage is not StreamUsage.NONE:
        yield builder.usage_chunk()


async def _whole(
    servicer: RouterServicer, builder: ResponseBuilder, context: HttpCallContext
) -> None:
    """Run the plan to its end, ``builder`` keeping every choice for the body."""
    async for item in run_plan(servicer, builder.plan, context):
        builder.add(item)


@dataclass(frozen=True, slots=True)
class ChoiceMessage:
    """One router message of choice ``index`` (OpenAI's choice index)."""

    index: int
    message: router_pb2.GenerateResponse


async def run_plan(
    servicer: RouterServicer, plan: GenerationPlan, context: HttpCallContext
) -> AsyncGenerator[ChoiceMessage, None]:
    """The messages of every generation of ``plan`` as they come, each run under ``context``
    (the HTTP call's); raises ``OpenAIError`` for the first generation the router refuses or
    fails (the others are then cancelled)."""
    if plan.num_choices == 1:
        request = plan.requests[0][0]
        async for message in _generate(servicer, request, plan.max_tokens_default, context):
            yield ChoiceMessage(0, message)
        return
    fan_out = _FanOut(servicer, plan, context)
    try:
        async for item in fan_out.messages():
            yield item
    finally:
        await fan_out.close()


async def _generate(
    servicer: RouterServicer,
    request: router_pb2.GenerateRequest,
    default: MaxTokensDefault,
    context: HttpCallContext,
) -> AsyncIterator[router_pb2.GenerateResponse]:
    try:
        async for message in servicer.generate(request, context, default):
            yield message
    except CallAborted as exc:
        raise from_call_aborted(exc) from None


# What a generation's task hands the merger: a message, its failure, or None once done.
_Item = tuple[int, router_pb2.GenerateResponse | Exception | None]
# Enough for every choice to hand over a message while the merger sends another.
_QUEUED_PER_CHOICE = 2


class _FanOut:
    """Each generation in a task of its own, feeding one bounded queue."""

    def __init__(
        self, servicer: RouterServicer, plan: GenerationPlan, context: HttpCallContext
    ) -> None:
        self._servicer = servicer
        self._default = plan.max_tokens_default
        self._context = context
        self._queue: asyncio.Queue[_Item] = asyncio.Queue(_QUEUED_PER_CHOICE * plan.num_choices)
        self._tasks: list[asyncio.Task[None]] = []
        self._num_running = plan.num_choices
        index = 0
        for choices in plan.requests:
            followers = list(enumerate(choices[1:], start=index + 1))
            self._start(index, choices[0], followers)
            index += len(choices)

    def _start(
        self,
        index: int,
        request: router_pb2.GenerateRequest,
        followers: list[tuple[int, router_pb2.GenerateRequest]],
    ) -> None:
        self._tasks.append(asyncio.create_task(self._run(index, request, followers)))

    async def _run(
        self,
        index: int,
        request: router_pb2.GenerateRequest,
        followers: list[tuple[int, router_pb2.GenerateRequest]],
    ) -> None:
        try:
            async for message in _generate(self._servicer, request, self._default, self._context):
                # Queued before the followers start: the prompt's first message (with its
                # prompt logprobs, when asked for) reaches the merger before any of theirs.
                await self._queue.put((index, message))
                for follower_index, follower in followers:
                    self._start(follower_index, follower, [])
                followers = []
        except Exception as exc:  # handed to the merger, which raises it to the client
            await self._queue.put((index, exc))
            return
        await self._queue.put((index, None))

    async def messages(self) -> AsyncIterator[ChoiceMessage]:
        while self._num_running:
            index, item = await self._queue.get()
            if item is None:
                self._num_running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield ChoiceMessage(index, item)

    async def close(self) -> None:
        """Cancel the generations still running and wait until they have let go."""
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, return_exceptions=True)
