"""Send a workload to a router over gRPC and time every token.

Open loop (``rate``): requests leave at their scheduled times whether or not earlier ones have
finished, as independent users would send them. Closed loop (``concurrency``): that many
requests are always in flight. Either way the run stops sending after ``num_requests`` or
``duration_s`` and then waits for what is in flight (each request has ``timeout_s``).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from loadtest.metrics import RequestRecord
from loadtest.synthetic import SyntheticRequest
from services.common.router_channel import open_router_aio_channel
from splitserve.v1 import router_pb2, router_pb2_grpc


@dataclass(frozen=True, slots=True)
class RunPlan:
    """How many requests to send and how: at the open-loop send times ``arrivals_s`` (seconds
    from the start), or keeping ``concurrency`` in flight (exactly one of the two)."""

    num_requests: int
    duration_s: float
    arrivals_s: tuple[float, ...] | None = None
    concurrency: int | None = None
    timeout_s: float = 300.0


class Progress:
    """One self-rewriting stderr line: sent, completed, errors."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total = total
        self.enabled = enabled and sys.stderr.isatty()
        self.sent = self.done = self.errors = 0

    def update(self) -> None:
        if not self.enabled:
            return
        width = 30
        filled = int(width * (self.done + self.errors) / max(self.total, 1))
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] sent {self.sent}/{self.total}, "
            f"done {self.done}, errors {self.errors}"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


async def _send(
    stub: router_pb2_grpc.RouterStub,
    request: SyntheticRequest,
    timeout_s: float,
    progress: Progress,
) -> RequestRecord:
    record = RequestRecord(sent_s=time.perf_counter(), prompt_tokens=len(request.prompt_token_ids))
    progress.sent += 1
    message = router_pb2.GenerateRequest(
        token_ids=request.prompt_token_ids,
        sampling=router_pb2.SamplingParams(
            max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True
        ),
    )
    try:
        async for response in stub.Generate(message, timeout=timeout_s):
            if response.token_ids:
                record.token_times_s.append(time.perf_counter())
                record.token_counts.append(len(response.token_ids))
            if response.HasField("usage"):
                record.cached_tokens = response.usage.cached_tokens
        record.end_s = time.perf_counter()
        progress.done += 1
    except grpc.aio.AioRpcError as exc:
        record.error = exc.code().name
        progress.errors += 1
    progress.update()
    return record


async def run(
    target: str,
    plan: RunPlan,
    make_request: Callable[[], SyntheticRequest],
    show_progress: bool = True,
    api_key: str = "",
    ca_file: str = "",
) -> list[RequestRecord]:
    """Run ``plan`` against the router at ``target``, presenting ``api_key`` (TLS verified
    against ``ca_file`` when given); one record per request sent."""
    progress = Progress(plan.num_requests, show_progress)
    async with open_router_aio_channel(target, api_key, ca_file) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        await channel.channel_ready()
        start_s = time.perf_counter()
        end_s = start_s + plan.duration_s
        if plan.arrivals_s is not None:
            tasks = []
            for at_s in plan.arrivals_s[: plan.num_requests]:
                delay_s = start_s + at_s - time.perf_counter()
                if start_s + at_s > end_s:
                    break
                if delay_s > 0:
                    await asyncio.sleep(delay_s)
                tasks.append(
                    asyncio.create_task(_send(stub, make_request(), plan.timeout_s, progress))
                )
            records = list(await asyncio.gather(*tasks))
        else:
            assert plan.concurrency is not None
            records = []
            budget = iter(range(plan.num_requests))

            async def user() -> None:
                while time.perf_counter() < end_s and next(budget, None) is not None:
                    records.append(await _send(stub, make_request(), plan.timeout_s, progress))

            await asyncio.gather(*(user() for _ in range(plan.concurrency)))
    progress.close()
    return records
