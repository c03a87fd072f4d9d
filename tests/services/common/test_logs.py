"""Log lines as JSON, and warnings that repeat written once per window."""

from __future__ import annotations

import json
import logging
import sys

from services.common.logs import JsonFormatter, RepeatLimiter, log_fields, rate_limited


def record(msg: str, *args: object, extra: dict | None = None, exc_info=None) -> logging.LogRecord:
    logger = logging.getLogger("splitserve.test")
    made = logger.makeRecord(logger.name, logging.WARNING, __file__, 1, msg, args, exc_info)
    for key, value in (extra or {}).items():
        setattr(made, key, value)
    return made


def test_a_json_line_carries_the_message_and_its_fields():
    line = JsonFormatter().format(
        record("req_id=%s finished", "abc", extra=log_fields(req_id="abc", ttft_ms=12.5))
    )
    entry = json.loads(line)
    assert entry["message"] == "req_id=abc finished"
    assert (entry["level"], entry["logger"]) == ("WARNING", "splitserve.test")
    assert (entry["req_id"], entry["ttft_ms"]) == ("abc", 12.5)
    assert entry["ts"].endswith("+00:00")


def test_an_exception_is_one_json_field():
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        made = record("failed", exc_info=sys.exc_info())
    entry = json.loads(JsonFormatter().format(made))
    assert "RuntimeError: boom" in entry["exception"]


def test_repeated_warnings_are_written_once_per_window_per_key():
    now = [0.0]
    limiter = RepeatLimiter(window_s=30.0, clock=lambda: now[0])

    def passes(key: str) -> bool:
        return limiter.filter(record("worker %s unhealthy", key, extra=rate_limited(key)))

    assert passes("a") and passes("b")  # one line per key
    assert not passes("a") and not passes("a")
    now[0] = 31.0
    written = record("worker %s unhealthy", "a", extra=rate_limited("a"))
    assert limiter.filter(written)
    assert written.getMessage() == "worker a unhealthy (2 more like it in the last 30 s)"
    # Records not marked are never dropped.
    assert all(limiter.filter(record("plain")) for _ in range(3))
