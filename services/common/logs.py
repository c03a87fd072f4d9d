"""Logging setup shared by every splitserve process: the level, text or JSON lines, and a
limit on warnings that repeat.

``--log-format json`` (``SPLITSERVE_LOG_FORMAT``) writes one JSON object per line: ``ts``,
``level``, ``logger``, ``message``, the record's structured ``fields`` (``log_fields``) and
``exception``. The format is exported to the environment, so that the processes a process
starts (workers, Ray actors) log alike.

Warnings marked with ``rate_limited(key)`` (Redis down, a flapping worker) are written once per
``REPEAT_WINDOW_S`` per key; the next one written says how many were dropped.
"""

from __future__ import annotations

import argparse
import datetime
import enum
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

LOG_LEVEL_ENV = "SPLITSERVE_LOG_LEVEL"
LOG_FORMAT_ENV = "SPLITSERVE_LOG_FORMAT"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
REPEAT_WINDOW_S = 30.0
_FIELDS = "splitserve_fields"
_RATE_LIMIT_KEY = "splitserve_rate_limit_key"


class LogFormat(enum.Enum):
    TEXT = "text"
    JSON = "json"


def add_log_flags(parser: argparse.ArgumentParser, default: str = "INFO") -> None:
    """``--log-level`` and ``--log-format`` (their env vars give the defaults)."""
    parser.add_argument(
        "--log-level",
        default=os.environ.get(LOG_LEVEL_ENV, default),
        help=f"logging level [env {LOG_LEVEL_ENV}]",
    )
    parser.add_argument(
        "--log-format",
        choices=[f.value for f in LogFormat],
        default=None,
        help=f"text, or one JSON object per line (default: text) [env {LOG_FORMAT_ENV}]",
    )


def log_fields(**fields: Any) -> dict[str, Any]:
    """``extra=`` for a record with structured fields (JSON lines carry them as keys)."""
    return {_FIELDS: fields}


def rate_limited(key: str) -> dict[str, Any]:
    """``extra=`` for a warning that can repeat: one line per ``REPEAT_WINDOW_S`` per
    (logger, message, ``key``)."""
    return {_RATE_LIMIT_KEY: key}


def configure_logging(level: str, log_format: str | None = None) -> None:
    """Log at ``level`` to stderr as ``log_format`` (None: ``SPLITSERVE_LOG_FORMAT``, else
    text); exports the format to the environment. A bad env value exits (status 2) naming the
    variable."""
    if log_format is None:
        text = os.environ.get(LOG_FORMAT_ENV, LogFormat.TEXT.value)
        try:
            chosen = LogFormat(text)
        except ValueError:
            # The process cannot log yet: one line on stderr, as for any bad env value.
            print(f"{LOG_FORMAT_ENV}={text!r} is not valid: expected text or json", file=sys.stderr)
            raise SystemExit(2) from None
    else:
        chosen = LogFormat(log_format)
    os.environ[LOG_FORMAT_ENV] = chosen.value
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter() if chosen is LogFormat.JSON else logging.Formatter(TEXT_FORMAT)
    )
    handler.addFilter(RepeatLimiter())
    logging.basicConfig(level=level.upper(), handlers=[handler])


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(getattr(record, _FIELDS, None) or {})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class RepeatLimiter(logging.Filter):
    """Drops a ``rate_limited`` record seen less than ``window_s`` ago (same logger, message
    and key); the next one let through says how many were dropped. Other records pass."""

    def __init__(
        self, window_s: float = REPEAT_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self._window_s = window_s
        self._clock = clock
        # (logger, message template, key) -> (when one was last written, dropped since)
        self._seen: dict[tuple[str, str, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = getattr(record, _RATE_LIMIT_KEY, None)
        if key is None:
            return True
        seen_key = (record.name, str(record.msg), key)
        now_s = self._clock()
        written_s, dropped = self._seen.get(seen_key, (-self._window_s, 0))
        if now_s - written_s < self._window_s:
            self._seen[seen_key] = (written_s, dropped + 1)
            return False
        self._seen[seen_key] = (now_s, 0)
        if dropped:
            record.msg = f"{record.msg} ({dropped} more like it in the last {self._window_s:.0f} s)"
        return True
