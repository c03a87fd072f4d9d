"""Send a list of requests through a ``LoadClient`` on a schedule.

Open loop (``arrivals_s``): requests leave at their scheduled times whether or not earlier ones
have finished, as independent users would send them. Closed loop (``concurrency``): that many
requests are always in flight. Either way the run stops sending at the end of its requests or
after ``duration_s``, and then waits for what is in flight (each request has ``timeout_s``).
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from loadtest.generator.backends import LoadClient
from loadtest.generator.metrics import RequestRecord, Summary, summarize
from loadtest.generator.synthetic import LoadRequest


@dataclass(frozen=True, slots=True)
class RunPlan:
    """How to send a run's requests: at the open-loop send times ``arrivals_s`` (seconds from
    the start, one per request), or keeping ``concurrency`` in flight (exactly one of the
    two)."""

    duration_s: float
    arrivals_s: tuple[float, ...] | None = None
    concurrency: int | None = None
    timeout_s: float = 300.0


async def run(
    client: LoadClient,
    plan: RunPlan,
    requests: Sequence[LoadRequest],
    show_progress: bool = True,
    label: str = "",
) -> list[RequestRecord]:
    """Send ``requests`` in order through ``client`` as ``plan`` says; one record per request
    sent. With ``show_progress`` and stderr a terminal, a progress bar (``label``: its title)
    counts finished requests and errors there. Side effect: what the process holds already is
    frozen out of the cyclic GC (``gc.freeze``) for the rest of its life: a load generator's
    own process."""
    progress = tqdm(
        total=len(requests),
        desc=label or None,
        unit="req",
        file=sys.stderr,
        disable=not (show_progress and sys.stderr.isatty()),
    )
    errors = 0

    async def send(request: LoadRequest) -> RequestRecord:
        nonlocal errors
        record = await client.send(request, plan.timeout_s)
        if record.error is not None:
            errors += 1
            progress.set_postfix(errors=errors, refresh=False)
        progress.update()
        return record

    progress.set_postfix(errors=0)
    # What this process holds already (torch, a tokenizer: ~250k objects, ~230 ms for a full
    # collection) is not walked by the collector again: that pause would count as the latency
    # of whatever request was in flight.
    gc.freeze()
    with progress:
        async with client:
            start_s = time.perf_counter()
            end_s = start_s + plan.duration_s
            if plan.arrivals_s is not None:
                tasks = []
                for request, at_s in zip(requests, plan.arrivals_s, strict=False):
                    if at_s > plan.duration_s:
                        break
                    delay_s = start_s + at_s - time.perf_counter()
                    if delay_s > 0:
                        await asyncio.sleep(delay_s)
                    tasks.append(asyncio.create_task(send(request)))
                return list(await asyncio.gather(*tasks))
            assert plan.concurrency is not None
            records: list[RequestRecord] = []
            pending = iter(requests)

            async def user() -> None:
                while time.perf_counter() < end_s and (request := next(pending, None)) is not None:
                    records.append(await send(request))

            await asyncio.gather(*(user() for _ in range(plan.concurrency)))
            return records


def closed_loop_summary(
    client: LoadClient, requests: Sequence[LoadRequest], concurrency: int
) -> Summary:
    """Send every one of ``requests`` with ``concurrency`` in flight (no time limit, no
    progress bar) and summarize them, without SLOs; ``AssertionError`` naming the errors if
    any request failed (the benchmarks' runs must be complete)."""
    plan = RunPlan(duration_s=3600.0, concurrency=concurrency)
    summary = summarize(asyncio.run(run(client, plan, requests, False)), None, None)
    assert not summary.errors, summary.errors
    return summary
