"""``DutyCycle``: expensive pieces of work (large bodies' parses) run one at a time, each after
a pause that keeps them to their share of the time, and other tasks run in the pauses."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from services.router.openai.duty_cycle import DutyCycle
from tests.services.openai.loop_ticks import LoopTicks

PIECE_S = 0.02
# asyncio may run a timer up to its clock's resolution early.
EARLY_S = 0.002


def hold_the_loop(duration_s: float) -> None:
    """Busy for ``duration_s`` without yielding, as a parse is."""
    end_s = time.monotonic() + duration_s
    while time.monotonic() < end_s:
        pass


def test_pieces_run_one_at_a_time_within_their_share_and_other_tasks_run_between() -> None:
    async def run() -> None:
        share = DutyCycle(0.25)  # each piece is followed by 3 times its duration of pause
        ends: list[tuple[float, int]] = []
        async with LoopTicks() as ticks:

            async def piece(i: int) -> int:
                hold_the_loop(PIECE_S)
                ends.append((time.monotonic(), ticks.count))
                return i

            results = await asyncio.gather(*(share.run(lambda i=i: piece(i)) for i in range(4)))
        assert results == [0, 1, 2, 3]
        for (end_s, ticks_then), (next_end_s, next_ticks) in itertools.pairwise(ends):
            # The next piece started 3 x PIECE_S (at least) after this one ended.
            assert next_end_s - end_s >= 3 * PIECE_S + PIECE_S - EARLY_S
            assert next_ticks > ticks_then  # the other task ran in between

    asyncio.run(run())


def test_a_failing_piece_raises_and_still_counts_its_time() -> None:
    async def run() -> None:
        share = DutyCycle(0.5)

        async def fails() -> None:
            hold_the_loop(PIECE_S)
            raise ValueError("bad body")

        with pytest.raises(ValueError, match="bad body"):
            await share.run(fails)
        failed_s = time.monotonic()
        started: list[float] = []

        async def start() -> None:
            started.append(time.monotonic())

        await share.run(start)
        assert started[0] - failed_s >= PIECE_S - EARLY_S

    asyncio.run(run())


@pytest.mark.parametrize("share", [0.0, -1.0, 1.5])
def test_a_share_outside_0_to_1_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match=r"share must be in \(0, 1\]"):
        DutyCycle(share)
