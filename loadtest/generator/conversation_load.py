"""``splitserve loadtest --users N``: multi-turn conversations against a running router.

The flags of a conversation workload (declared here once, for ``splitserve loadtest`` and
``python -m loadtest.bench.multi_turn``), the conversations they describe (synthetic, or a
ShareGPT file's human turns), and the report of one replay: per-turn TTFT, prompt tokens
computed and reused, and the history's tokens that no cache saved
(``conversations.history_recomputed_tokens``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from engine.tokenizer import Tokenizer
from loadtest.generator.conversations import (
    Conversation,
    TurnRecord,
    history_recomputed_tokens,
    summarize_turns,
    synthetic_conversations,
)
from loadtest.generator.datasets import sharegpt_user_turns


def add_conversation_flags(parser: argparse.ArgumentParser) -> None:
    """The shape of the conversations and of the users replaying them."""
    parser.add_argument("--turns", type=int, default=6, help="user turns per conversation")
    parser.add_argument(
        "--think-time-s",
        type=float,
        default=1.0,
        help="mean seconds a user waits between a reply and its next turn (exponential)",
    )
    parser.add_argument(
        "--system-prompt-tokens",
        type=int,
        default=64,
        help="synthetic conversations: tokens of the system prompt they all share (0: none)",
    )
    parser.add_argument(
        "--user-turn-tokens",
        default="32,96",
        help="synthetic conversations: min,max tokens of a user turn",
    )
    parser.add_argument(
        "--reply-tokens", type=int, default=32, help="max_tokens of each turn's reply"
    )


def conversations_of(
    args: argparse.Namespace, tokenizer: Tokenizer, num: int, sharegpt: Path | None
) -> list[Conversation]:
    """``num`` conversations of ``args.turns`` turns at most: a ShareGPT file's human turns,
    else synthetic ones. ``ValueError`` naming the flag for a bad value."""
    if args.turns < 1:
        raise ValueError(f"--turns must be >= 1, got {args.turns}")
    if args.reply_tokens < 1:
        raise ValueError(f"--reply-tokens must be >= 1, got {args.reply_tokens}")
    if args.think_time_s < 0:
        raise ValueError(f"--think-time-s must be >= 0, got {args.think_time_s}")
    if sharegpt is not None:
        return [Conversation(t[: args.turns]) for t in sharegpt_user_turns(sharegpt)[:num]]
    try:
        low, high = (int(n) for n in args.user_turn_tokens.split(","))
    except ValueError:
        raise ValueError(
            f"--user-turn-tokens must be MIN,MAX, got {args.user_turn_tokens!r}"
        ) from None
    if not 1 <= low <= high:
        raise ValueError(f"--user-turn-tokens needs 1 <= MIN <= MAX, got {low},{high}")
    return synthetic_conversations(
        tokenizer, num, args.turns, args.system_prompt_tokens, (low, high), args.seed
    )


def conversation_report(records: list[TurnRecord], num_turns: int) -> dict[str, Any]:
    """The replay's figures: turn 1, turns 2 and later, each turn, the history recomputed."""
    later = summarize_turns(records, 2)
    return {
        "first_turn": dataclasses.asdict(summarize_turns(records, 1, 1)),
        "later_turns": dataclasses.asdict(later),
        "later_turns_computed_tokens": later.computed_tokens,
        "later_turns_history_recomputed_tokens": history_recomputed_tokens(records),
        "per_turn": [
            dataclasses.asdict(summarize_turns(records, t, t)) for t in range(1, num_turns + 1)
        ],
    }


def write_conversation_report(
    out: Path, config: dict[str, Any], report: dict[str, Any]
) -> list[str]:
    """Write ``conversations.json`` under ``out``; return the lines to print (a table)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "conversations.json"
    path.write_text(json.dumps({"config": config, **report}, indent=2))
    lines = ["| turn | turns | failed | TTFT p50 / p99 ms | prompt tokens | reused |"]
    lines.append("|---|---:|---:|---:|---:|---:|")
    for t in report["per_turn"]:
        lines.append(
            f"| {t['turns']} | {t['num_turns']} | {t['num_errors']} | "
            f"{t['ttft_p50_ms']:.0f} / {t['ttft_p99_ms']:.0f} | {t['prompt_tokens']:,} | "
            f"{t['cached_tokens']:,} |"
        )
    lines.append(
        "turns 2+: history tokens recomputed "
        f"{report['later_turns_history_recomputed_tokens']:,} "
        f"of {report['later_turns_computed_tokens']:,} computed"
    )
    lines.append(f"wrote {path}")
    return lines
