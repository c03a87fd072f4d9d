"""Request datasets for ``splitserve loadtest --dataset jsonl|sharegpt --dataset-path FILE``.

- ``jsonl``: one JSON object a line, ``{"prompt": str, "output_tokens": int}``
  (``max_tokens`` is accepted for ``output_tokens``; without either, ``--output-len``). Blank
  lines are skipped.
- ``sharegpt``: the JSON file vLLM's benchmarks use, a list of
  ``{"id": ..., "conversations": [{"from": "human", "value": str}, {"from": "gpt", ...}, ...]}``.
  The prompt is the first human turn; the output length is the token count of the gpt reply
  after it. Conversations with fewer than two turns, or not opening with a human turn answered
  by a gpt one, are skipped.

Each run takes the entries in the order of a shuffle seeded by its seed (vLLM shuffles too),
skipping those that do not fit: as vLLM filters ShareGPT, a prompt or output under 4 tokens
(ShareGPT only) and a prompt + output over the context length. It stops at ``num_requests``;
a dataset with fewer usable entries makes a shorter run. Prompts are sent as text; token counts
come from the model's tokenizer, special tokens included as the router adds them.

A malformed file raises ``DatasetError`` naming the file and the line (JSONL) or entry
(ShareGPT).
"""

from __future__ import annotations

import enum
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.tokenizer import Tokenizer
from loadtest.generator.synthetic import LoadRequest, fit_text, regular_token_ids

logger = logging.getLogger(__name__)

MIN_SHAREGPT_TOKENS = 4  # vLLM's bound on ShareGPT prompts and outputs


class DatasetKind(enum.Enum):
    """Where a loadtest's requests come from."""

    SYNTHETIC = "synthetic"  # ``loadtest.generator.synthetic``'s workloads
    JSONL = "jsonl"
    SHAREGPT = "sharegpt"


class DatasetError(ValueError):
    """A dataset file that cannot be read as its format; the message names where."""


@dataclass(frozen=True, slots=True)
class Entry:
    """A prompt and its output length: ``output_tokens``, or the token count of ``reply``
    (counted when sampled: a ShareGPT file has ~10^5 replies, a run needs a few hundred)."""

    prompt: str
    output_tokens: int | None = None
    reply: str = ""


@dataclass(frozen=True, slots=True)
class Dataset:
    """A parsed dataset file."""

    kind: DatasetKind
    path: Path
    entries: tuple[Entry, ...]

    def sample(
        self, num_requests: int, seed: int, tokenizer: Tokenizer, max_model_len: int
    ) -> list[LoadRequest]:
        """At most ``num_requests`` requests: the entries that fit ``max_model_len``, in the
        order of a shuffle seeded by ``seed``."""
        order = list(self.entries)
        random.Random(seed).shuffle(order)
        requests: list[LoadRequest] = []
        skipped = 0
        for entry in order:
            if len(requests) == num_requests:
                break
            prompt_ids = tuple(tokenizer.encode(entry.prompt))
            output_tokens = (
                entry.output_tokens
                if entry.output_tokens is not None
                else len(tokenizer.encode(entry.reply, add_special_tokens=False))
            )
            too_short = self.kind is DatasetKind.SHAREGPT and (
                min(len(prompt_ids), output_tokens) < MIN_SHAREGPT_TOKENS
            )
            if too_short or len(prompt_ids) + output_tokens > max_model_len:
                skipped += 1
                continue
            requests.append(LoadRequest(prompt_ids, output_tokens, self.kind.value, entry.prompt))
        if len(requests) < num_requests:
            logger.warning(
                "%s: %d usable entries of %d (%d too short or too long); the run sends %d",
                self.path,
                len(requests),
                len(self.entries),
                skipped,
                len(requests),
            )
        return requests


def load_dataset(kind: DatasetKind, path: Path, default_output_tokens: int) -> Dataset:
    """Parse ``path`` as ``kind`` (JSONL entries without an output length get
    ``default_output_tokens``); ``DatasetError`` for a malformed or unreadable file, or one with
    no usable entry."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path}: cannot read: {exc}") from None
    if kind is DatasetKind.JSONL:
        entries = _jsonl_entries(path, text, default_output_tokens)
    elif kind is DatasetKind.SHAREGPT:
        entries = _sharegpt_entries(path, text)
    else:
        raise ValueError(f"{kind.value} is not a dataset file format")
    if not entries:
        raise DatasetError(f"{path}: no usable {kind.value} entry")
    return Dataset(kind, path, tuple(entries))


def _jsonl_entries(path: Path, text: str, default_output_tokens: int) -> list[Entry]:
    entries = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: not JSON: {exc.msg}") from None
        if not isinstance(item, dict):
            raise DatasetError(f"{where}: not a JSON object")
        prompt = item.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise DatasetError(f"{where}: needs a non-empty string 'prompt'")
        given = [key for key in ("output_tokens", "max_tokens") if key in item]
        if len(given) > 1:
            raise DatasetError(f"{where}: give one of 'output_tokens' and 'max_tokens'")
        output = item[given[0]] if given else default_output_tokens
        if given and (isinstance(output, bool) or not isinstance(output, int) or output < 1):
            raise DatasetError(f"{where}: '{given[0]}' must be an integer >= 1, got {output!r}")
        entries.append(Entry(prompt, output_tokens=output))
    return entries


def _sharegpt_entries(path: Path, text: str) -> list[Entry]:
    entries = []
    for turns in _sharegpt_conversations(path, text):
        if len(turns) >= 2 and turns[0][0] == "human" and turns[1][0] == "gpt":
            entries.append(Entry(turns[0][1], reply=turns[1][1]))
    return entries


def sharegpt_user_turns(path: Path) -> list[tuple[str, ...]]:
    """The human turns of each conversation of a ShareGPT file, in order (conversations
    without one are left out): what a multi-turn replay sends, the replies being the
    server's own. ``DatasetError`` for a malformed file."""
    conversations = _sharegpt_conversations(path, path.read_text())
    user_turns = [tuple(v for who, v in turns if who == "human") for turns in conversations]
    return [turns for turns in user_turns if turns]


def _sharegpt_conversations(path: Path, text: str) -> list[list[tuple[str, str]]]:
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}:{exc.lineno}: not JSON: {exc.msg}") from None
    if not isinstance(items, list):
        raise DatasetError(f"{path}: not a JSON list of conversations")
    return [_turns(item, f"{path}: entry {index}") for index, item in enumerate(items)]


def _turns(item: Any, where: str) -> list[tuple[str, str]]:
    """A ShareGPT entry's turns as (from, value)."""
    conversations = item.get("conversations") if isinstance(item, dict) else None
    if not isinstance(conversations, list):
        raise DatasetError(f"{where}: needs a list 'conversations'")
    turns = []
    for number, turn in enumerate(conversations):
        speaker = turn.get("from") if isinstance(turn, dict) else None
        value = turn.get("value") if isinstance(turn, dict) else None
        if not isinstance(speaker, str) or not isinstance(value, str):
            raise DatasetError(f"{where}: turn {number} needs strings 'from' and 'value'")
        turns.append((speaker, value))
    return turns


def write_sharegpt_file(
    path: Path, tokenizer: Tokenizer, num_conversations: int, seed: int = 0
) -> Path:
    """Write ``num_conversations`` ShareGPT conversations of random regular tokens of
    ``tokenizer`` (as text) to ``path``; the same file for the same seed and tokenizer. Each
    opens with a human turn of 16-200 tokens answered by a gpt reply of 4-64 tokens (text may
    tokenize to a few tokens fewer); about one in five has two more turns, and about one in
    six is one ``sample`` skips: a lone human turn, a gpt turn first, or a prompt or reply
    under 4 tokens. Side effect: creates or overwrites ``path``. Returns it."""
    rng = random.Random(seed)
    vocab = regular_token_ids(tokenizer.backend)

    def text(num_tokens: int) -> str:
        return fit_text(tokenizer, [rng.choice(vocab) for _ in range(num_tokens)])[0]

    conversations = []
    for index in range(num_conversations):
        prompt, reply = text(rng.randint(16, 200)), text(rng.randint(4, 64))
        turns = [("human", prompt), ("gpt", reply)]
        kind = rng.random()
        if kind < 0.2:
            turns += [("human", text(rng.randint(16, 200))), ("gpt", text(rng.randint(4, 64)))]
        elif kind < 0.25:
            turns = turns[:1]
        elif kind < 0.3:
            turns.reverse()
        elif kind < 0.33:
            turns[0] = ("human", text(2))
        elif kind < 0.36:
            turns[1] = ("gpt", text(2))
        conversations.append(
            {
                "id": f"conv-{index}",
                "conversations": [{"from": who, "value": value} for who, value in turns],
            }
        )
    path.write_text(json.dumps(conversations, ensure_ascii=False, indent=1) + "\n")
    return path
