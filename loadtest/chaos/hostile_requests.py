"""What each kind of hostile HTTP client sends (``loadtest.chaos.hostile_clients`` holds them open).

Every request is built once, as the raw bytes of an HTTP/1.1 request: the grammar body is
1.7 MB and the huge header tens of MB, too much to build again at each attempt.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass

FANOUT_N = 16
FANOUT_LOGPROBS = 20
FANOUT_MAX_TOKENS = 20000
GRAMMAR_CHOICES = 100_000
SLOWLORIS_BODY_BYTES = 16 * 2**20  # declared; half of it is sent
# What a slow reader's stream generates before it pauses (BENCHMARKS.md, hostile chaos).
READER_MAX_TOKENS = 1325
_PROMPT = "Write a very long story about a lighthouse keeper and the sea."


class HostileKind(enum.Enum):
    """What a hostile connection does."""

    # Streamed completion (n=1, long), 4 KiB receive buffer, never reads.
    SLOW_READER = "slow-reader"
    # Sends its request line, then one header byte every 2 s, never ending the header.
    SLOWLORIS_HEADERS = "slowloris-headers"
    # Declares a 16 MiB body, sends half of it, then sends nothing more.
    SLOWLORIS_BODY = "slowloris-body"
    # One header of ``--header-mb`` MB on GET /v1/models; reads the answer.
    HUGE_HEADER = "huge-header"
    # Streamed completion, n=16, max_tokens 20000, logprobs 20; never reads.
    FANOUT_STREAM = "fanout-stream"
    # Non-streamed chat, n=16, max_tokens 20000, top_logprobs 20; never reads.
    FANOUT_CHAT = "fanout-chat"
    # Chat constrained to a guided_choice of 100,000 strings; reads the answer.
    HUGE_GRAMMAR = "huge-grammar"
    # Not hostile, and not in the default set: the control for slow readers. The same streamed
    # completion, for the tokens a slow reader gets before its stream pauses, read as they
    # come; then it keeps its connection until its hold limit, as a slow reader does.
    READER = "reader"


@dataclass(frozen=True, slots=True)
class Target:
    """The server and what the attempts send it."""

    host: str
    port: int
    max_tokens: int
    header_bytes: int
    hold_s: float


class RequestBytes:
    """Each kind's bytes, built once (the grammar body is 1.7 MB, the header tens of MB)."""

    def __init__(self, target: Target) -> None:
        host = f"{target.host}:{target.port}"
        long_gen = {"max_tokens": target.max_tokens, "ignore_eos": True, "temperature": 1.0}
        chat = {"messages": [{"role": "user", "content": _PROMPT}]}
        self.by_kind = {
            HostileKind.SLOW_READER: _post(
                host, "/v1/completions", {"prompt": _PROMPT, "stream": True, **long_gen}
            ),
            HostileKind.READER: _post(
                host,
                "/v1/completions",
                {"prompt": _PROMPT, "stream": True, **long_gen}
                | {"max_tokens": min(target.max_tokens, READER_MAX_TOKENS)},
            ),
            HostileKind.FANOUT_STREAM: _post(
                host,
                "/v1/completions",
                {"prompt": _PROMPT, "stream": True, "n": FANOUT_N, "logprobs": FANOUT_LOGPROBS}
                | long_gen,
            ),
            HostileKind.FANOUT_CHAT: _post(
                host,
                "/v1/chat/completions",
                chat
                | long_gen
                | {"n": FANOUT_N, "logprobs": True, "top_logprobs": FANOUT_LOGPROBS},
            ),
            HostileKind.HUGE_GRAMMAR: _post(
                host,
                "/v1/chat/completions",
                chat
                | {
                    "max_tokens": 16,
                    "guided_choice": [f"choice {i}" for i in range(GRAMMAR_CHOICES)],
                },
            ),
            HostileKind.HUGE_HEADER: (
                f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\nX-Filler: ".encode()
                + b"a" * target.header_bytes
                + b"\r\n\r\n"
            ),
            HostileKind.SLOWLORIS_HEADERS: (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nX-Slowloris: ".encode()
            ),
            HostileKind.SLOWLORIS_BODY: (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {SLOWLORIS_BODY_BYTES}\r\n\r\n"
                '{"messages": ['
            ).encode()
            + b" " * (SLOWLORIS_BODY_BYTES // 2),
        }


def _post(host: str, path: str, body: Mapping[str, object]) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


def parse_kinds(text: str | None) -> list[HostileKind]:
    """A comma-separated list of kind values; None or empty: every hostile kind (not the
    ``reader`` control)."""
    if not text:
        return [kind for kind in HostileKind if kind is not HostileKind.READER]
    return [HostileKind(name.strip()) for name in text.split(",") if name.strip()]
