"""Waiting in tests: poll the condition itself, with a deadline, instead of sleeping."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float,
    what: str | Callable[[], str],
    interval_s: float = 0.05,
) -> T:
    """Call ``predicate`` every ``interval_s`` until it returns something truthy, and return
    that; ``AssertionError(f"{what} not within {timeout_s} s")`` once ``timeout_s`` has passed.

    ``what`` names the awaited event; a callable is evaluated only on failure (to show the
    state reached). An exception from ``predicate`` (e.g. an ``assert``) ends the wait at once.
    """
    deadline_s = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline_s:
            described = what() if callable(what) else what
            raise AssertionError(f"{described} not within {timeout_s:g} s")
        time.sleep(interval_s)
