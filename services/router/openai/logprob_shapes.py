"""Logprob entries in OpenAI's two shapes: chat's ``logprobs.content`` (token, logprob, bytes
and ``top_logprobs`` per entry) and completions' legacy columns (``tokens``,
``token_logprobs``, ``top_logprobs`` keyed by text, ``text_offset``), for a stream chunk at
once or for a whole body in pieces of ``ENTRIES_PER_PIECE`` entries."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from services.router.openai.logprob_columns import LogprobColumns, LogprobEntry
from services.router.openai.streaming import json_array
from splitserve.v1 import worker_pb2

# Logprob entries serialized per piece of a whole body (about 1 KB each at top_logprobs=20):
# each piece takes the loop for a millisecond or so.
ENTRIES_PER_PIECE = 64

TokenText = Callable[[int], str]


def batches(columns: LogprobColumns) -> Iterator[list[LogprobEntry]]:
    """``columns``' entries, ``ENTRIES_PER_PIECE`` at a time."""
    for start in range(0, len(columns), ENTRIES_PER_PIECE):
        yield list(columns.entries(start, start + ENTRIES_PER_PIECE))


def proto_entries(logprobs: Sequence[worker_pb2.TokenLogprob]) -> Iterator[LogprobEntry]:
    for entry in logprobs:
        yield entry.token_id, entry.logprob, ((t.token_id, t.logprob) for t in entry.top)


def chat_entries(entries: Iterable[LogprobEntry], text: TokenText) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content`` items."""
    return [
        {
            **_chat_token(text(token_id), logprob),
            "top_logprobs": [_chat_token(text(t), t_logprob) for t, t_logprob in tops],
        }
        for token_id, logprob, tops in entries
    ]


def completion_logprobs(
    entries: Iterable[LogprobEntry], text: TokenText, offset: int, head: int | None = None
) -> tuple[dict[str, Any], int]:
    """The legacy shape of one chunk's entries, their text offsets from ``offset``, and the
    offset after them. ``head``: an echoed prompt's first token, first, with null logprobs."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    if head is not None:
        tokens.append(text(head))
        token_logprobs.append(None)
        tops.append(None)
        offsets.append(offset)
        offset += len(tokens[0])
    for entry in entries:
        token = text(entry[0])
        tokens.append(token)
        token_logprobs.append(entry[1])
        tops.append(_completion_top(token, entry, text))
        offsets.append(offset)
        offset += len(token)
    shape = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
    return shape, offset


def completion_columns(
    entry_batches: Callable[[], Iterator[list[LogprobEntry]]],
    text: TokenText,
    head: int | None = None,
) -> Iterator[str]:
    """The legacy shape's four arrays, each in pieces (``entry_batches`` is read once per
    array); ``head`` as in ``completion_logprobs``."""
    lead = [] if head is None else [head]
    nulls = [None] * len(lead)
    yield '{"tokens":'
    yield from json_array(
        itertools.chain(
            [[text(token_id) for token_id in lead]],
            ([text(token_id) for token_id, _, _ in batch] for batch in entry_batches()),
        )
    )
    yield ',"token_logprobs":'
    yield from json_array(
        itertools.chain([nulls], ([logprob for _, logprob, _ in b] for b in entry_batches()))
    )
    yield ',"top_logprobs":'
    yield from json_array(
        itertools.chain(
            [nulls],
            ([_completion_top(text(e[0]), e, text) for e in batch] for batch in entry_batches()),
        )
    )
    yield ',"text_offset":'
    yield from json_array(_text_offsets(itertools.chain([lead], entry_batches()), text))
    yield "}"


def _text_offsets(
    batches: Iterable[Sequence[int | LogprobEntry]], text: TokenText
) -> Iterator[list[int]]:
    """Each token's text_offset (the characters of the token texts before it), in batches
    of token ids or entries."""
    offset = 0
    for batch in batches:
        offsets = []
        for item in batch:
            offsets.append(offset)
            offset += len(text(item if isinstance(item, int) else item[0]))
        yield offsets


def _completion_top(token: str, entry: LogprobEntry, text: TokenText) -> dict[str, float]:
    """The legacy ``top_logprobs`` entry: text to logprob, the sampled token's included."""
    top = {text(token_id): logprob for token_id, logprob in entry[2]}
    top.setdefault(token, entry[1])
    return top


def _chat_token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
