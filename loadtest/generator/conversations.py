"""Multi-turn conversations replayed turn by turn through the chat API.

Each turn's prompt is the whole conversation so far (system prompt, every user turn, every
reply the server gave), as a chat application or an agent sends it, so the prefix cache decides
what a turn costs. ``num_users`` users run at once; each takes the next conversation, sends
its turns one after another with a think time between them (exponential, mean
``think_time_s``), and then takes the next conversation. Conversations come from
``synthetic_conversations`` (one shared system prompt, random-token user turns) or from a
ShareGPT file's human turns (``datasets.sharegpt_user_turns``).

The report is per turn: TTFT, prompt tokens, and how many of them the server reused
(``usage.prompt_tokens_details.cached_tokens``) rather than computed.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.tokenizer import Tokenizer
from loadtest.generator.metrics import RequestRecord, percentile
from loadtest.generator.openai_http import OpenAIClient
from loadtest.generator.synthetic import fit_text, regular_token_ids


@dataclass(frozen=True, slots=True)
class Conversation:
    """What a user says, turn by turn (the replies are the server's)."""

    user_turns: tuple[str, ...]
    system_prompt: str = ""


def synthetic_conversations(
    tokenizer: Tokenizer,
    num_conversations: int,
    num_turns: int,
    system_prompt_tokens: int,
    user_turn_tokens: tuple[int, int],
    seed: int = 0,
) -> list[Conversation]:
    """Conversations of ``num_turns`` user turns of random regular tokens (as text), their
    lengths uniform in ``user_turn_tokens``, behind one system prompt of
    ``system_prompt_tokens`` that every conversation shares (none for 0). The same list for
    the same arguments."""
    rng = random.Random(seed)
    vocab = regular_token_ids(tokenizer.backend)

    def text(num_tokens: int) -> str:
        return fit_text(tokenizer, [rng.choice(vocab) for _ in range(num_tokens)])[0]

    system_prompt = text(system_prompt_tokens) if system_prompt_tokens else ""
    return [
        Conversation(
            tuple(text(rng.randint(*user_turn_tokens)) for _ in range(num_turns)), system_prompt
        )
        for _ in range(num_conversations)
    ]


@dataclass(frozen=True, slots=True)
class ConversationPlan:
    """How users replay conversations."""

    num_users: int
    max_tokens: int
    think_time_s: float = 0.0
    timeout_s: float = 300.0
    seed: int = 0


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """One turn as the client saw it: its conversation's index and its number (from 1)."""

    conversation: int
    turn: int
    record: RequestRecord


async def run_conversations(
    client: OpenAIClient, plan: ConversationPlan, conversations: Sequence[Conversation]
) -> list[TurnRecord]:
    """Replay every conversation as ``plan`` says; one record per turn sent. A turn that
    fails ends its conversation (its later turns would not have that history)."""
    rng = random.Random(plan.seed)
    pending = iter(enumerate(conversations))
    records: list[TurnRecord] = []

    def think_s() -> float:
        return rng.expovariate(1 / plan.think_time_s) if plan.think_time_s else 0.0

    async def converse(index: int, conversation: Conversation) -> None:
        messages: list[dict[str, Any]] = []
        if conversation.system_prompt:
            messages.append({"role": "system", "content": conversation.system_prompt})
        for turn, text in enumerate(conversation.user_turns, start=1):
            if turn > 1:
                await asyncio.sleep(think_s())
            messages.append({"role": "user", "content": text})
            record, reply = await client.send_messages(messages, plan.max_tokens, plan.timeout_s)
            records.append(TurnRecord(index, turn, record))
            if not record.ok:
                return
            messages.append({"role": "assistant", "content": reply})

    async def user() -> None:
        await asyncio.sleep(rng.uniform(0, plan.think_time_s))  # users do not start in step
        while (item := next(pending, None)) is not None:
            await converse(*item)

    async with client:
        await asyncio.gather(*(user() for _ in range(plan.num_users)))
    return records


@dataclass(frozen=True, slots=True)
class TurnSummary:
    """Aggregates of the turns numbered ``turns`` (latencies in milliseconds)."""

    turns: str
    num_turns: int
    num_errors: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    prompt_tokens: int
    cached_tokens: int

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens the server computed (not reused)."""
        return self.prompt_tokens - self.cached_tokens


def summarize_turns(
    records: Sequence[TurnRecord], first: int, last: int | None = None
) -> TurnSummary:
    """Aggregate the turns numbered ``first`` to ``last`` (inclusive; None: every later one).
    Failed turns are counted, and left out of the latencies and token counts."""
    chosen = [r for r in records if r.turn >= first and (last is None or r.turn <= last)]
    done = [r.record for r in chosen if r.record.ok]
    ttfts_s = [t for r in done if (t := r.ttft_s) is not None]
    return TurnSummary(
        turns=f"{first}" if last == first else f"{first}-{'' if last is None else last}",
        num_turns=len(chosen),
        num_errors=len(chosen) - len(done),
        ttft_p50_ms=percentile(ttfts_s, 50) * 1000,
        ttft_p99_ms=percentile(ttfts_s, 99) * 1000,
        prompt_tokens=sum(r.prompt_tokens for r in done),
        cached_tokens=sum(r.cached_tokens for r in done),
    )


def history_recomputed_tokens(records: Sequence[TurnRecord]) -> int:
    """Of the prompt tokens computed for turns 2 and later, those of the conversation's
    history: a turn's computed tokens past its new ones (what neither the previous turn's
    prompt nor its reply held: the user's text and the template's tokens around the turns).
    What any cache could have saved; 0 when every turn reused its whole history."""
    by_turn = {(r.conversation, r.turn): r.record for r in records}
    total = 0
    for r in records:
        previous = by_turn.get((r.conversation, r.turn - 1))
        if previous is None or not r.record.ok:
            continue
        new_tokens = r.record.prompt_tokens - previous.prompt_tokens - previous.output_tokens
        computed = r.record.prompt_tokens - r.record.cached_tokens
        total += max(computed - new_tokens, 0)
    return total
