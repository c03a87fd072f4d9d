"""The router's request loop over stand-in workers (``stand_ins``) on real gRPC: what a request
does when no decode worker is routable, and when a decode stream ends without its final
message."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import grpc
import pytest

from services.router.app import start_router
from services.router.config import RouterConfig
from splitserve.v1 import router_pb2, router_pb2_grpc
from tests.services.router.stand_ins import (
    StandInDecode,
    StandInPrefill,
    serve_decode,
    serve_prefill,
    token_at,
)

PROMPT = [3 + i % 50 for i in range(40)]
MAX_TOKENS = 6
WANT = [token_at(len(PROMPT), i) for i in range(MAX_TOKENS)]
WAIT_S = 60.0


async def until(predicate: Callable[[], object], what: str, timeout_s: float = WAIT_S) -> None:
    """Poll ``predicate`` on the running loop until it is truthy; fail after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline_s = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline_s:
            raise AssertionError(f"{what} not within {timeout_s:g} s")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def router_over(
    model_dir: Path, prefill: Sequence[StandInPrefill], decode: Sequence[StandInDecode]
) -> AsyncIterator[router_pb2_grpc.RouterStub]:
    """A router (in this process) over the stand-ins, each served on its own port; every
    prompt goes to the prefill pool. Yields a client stub."""
    for worker in (*prefill, *decode):
        worker.model = str(model_dir)
    servers = [*[await serve_prefill(p) for p in prefill], *[await serve_decode(d) for d in decode]]
    addresses = [f"127.0.0.1:{s.port}" for s in servers]
    config = RouterConfig(
        model=str(model_dir),
        port=0,
        http=False,
        prefill_workers=",".join(addresses[: len(prefill)]),
        decode_workers=",".join(addresses[len(prefill) :]),
        health_check_interval_s=0.05,
        decode_failover_wait_s=WAIT_S,
        local_prefill_max_tokens=0,
    )
    router = await start_router(config)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
    try:
        yield router_pb2_grpc.RouterStub(channel)
    finally:
        await channel.close()
        await router.stop(grace_s=0)
        for server in servers:
            await server.stop(grace_s=0)


async def generate(stub: router_pb2_grpc.RouterStub, priority: int | None = None) -> list[int]:
    """Greedy ``MAX_TOKENS`` tokens of ``PROMPT`` (at ``priority``): the token ids the client
    receives."""
    sampling = router_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    request = router_pb2.GenerateRequest(token_ids=PROMPT, sampling=sampling, priority=priority)
    call = stub.Generate(request, timeout=WAIT_S)
    return [token for message in [m async for m in call] for token in message.token_ids]


def test_a_request_with_no_routable_decode_worker_waits_for_one_before_its_prefill(
    tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The only decode worker is shutting down when the request arrives: the request waits
    (``--decode-failover-wait-s``) without prefilling, then runs on it once it is routable."""
    caplog.set_level(logging.INFO, logger="services.router.routed_request")

    async def main() -> None:
        prefill, decode = StandInPrefill("p0"), StandInDecode("d0", routable=False)
        async with router_over(tiny_llama_dir, [prefill], [decode]) as stub:
            receiving = asyncio.ensure_future(generate(stub))
            waiting = "no decode worker is routable"
            await until(lambda: receiving.done() or waiting in caplog.text, "the request waiting")
            assert waiting in caplog.text
            assert prefill.requests == []
            decode.routable = True
            assert await receiving == WANT
        assert len(prefill.requests) == 1 and len(decode.requests) == 1

    asyncio.run(main())


def test_a_decode_stream_ending_without_its_final_message_continues_from_the_tokens_sent(
    tiny_llama_dir: Path,
) -> None:
    """d0 (the idler, chosen first) ends its stream OK after 2 tokens without a final message:
    d1 continues from the prompt plus the 3 tokens the client has, computing the prompt
    instead of pulling it, and the client gets exactly ``max_tokens`` tokens."""

    async def main() -> None:
        prefill = StandInPrefill("p0")
        cut_short, busier = StandInDecode("d0", end_after=2), StandInDecode("d1", running=1)
        async with router_over(tiny_llama_dir, [prefill], [cut_short, busier]) as stub:
            assert await generate(stub) == WANT
            (first,) = cut_short.requests
            assert list(first.output_token_ids) == WANT[:1] and first.HasField("kv_ref")
            (second,) = busier.requests
            assert list(second.output_token_ids) == WANT[:3]
            assert not second.HasField("kv_ref")

    asyncio.run(main())


def test_a_better_priority_prompt_skips_a_prefill_worker_busy_with_worse_priority_work(
    tiny_llama_dir: Path,
) -> None:
    """The prefill worker holds a priority-10 prompt (a long step in progress): a priority-0
    prompt is prefilled by its decode worker at once; another priority-10 one queues on the
    prefill worker as usual."""

    async def main() -> None:
        prefill = StandInPrefill("p0", hold=asyncio.Event())
        decode = StandInDecode("d0", scheduling_policy="priority")
        async with router_over(tiny_llama_dir, [prefill], [decode]) as stub:
            bulk = asyncio.ensure_future(generate(stub, priority=10))
            await until(lambda: prefill.requests, "the bulk prompt on the prefill worker")
            assert await generate(stub, priority=0) == WANT
            (interactive,) = decode.requests
            assert interactive.priority == 0 and not interactive.HasField("kv_ref")
            second_bulk = asyncio.ensure_future(generate(stub, priority=10))
            await until(lambda: len(prefill.requests) == 2, "the second bulk prompt queued")
            assert prefill.hold is not None
            prefill.hold.set()
            assert await bulk == await second_bulk == WANT
        assert [r.priority for r in prefill.requests] == [10, 10]

    asyncio.run(main())
