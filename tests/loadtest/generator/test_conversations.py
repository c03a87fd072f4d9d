"""Multi-turn replay: every turn sends the whole history, the server's replies included."""

from __future__ import annotations

import asyncio
import json

from engine.tokenizer import Tokenizer
from loadtest.generator.backends import Backend
from loadtest.generator.conversations import (
    Conversation,
    ConversationPlan,
    TurnRecord,
    history_recomputed_tokens,
    run_conversations,
    summarize_turns,
    synthetic_conversations,
)
from loadtest.generator.datasets import sharegpt_user_turns, write_sharegpt_file
from loadtest.generator.metrics import RequestRecord
from loadtest.generator.openai_http import OpenAIClient
from tests.loadtest.generator.fake_openai import CACHED_TOKENS, FakeServer, serving

MAX_TOKENS = 3


def replay(server: FakeServer, conversations: list[Conversation], users: int) -> list[TurnRecord]:
    client = OpenAIClient(Backend.OPENAI_CHAT, server.base_url, "fake-model")
    plan = ConversationPlan(num_users=users, max_tokens=MAX_TOKENS, think_time_s=0.01, seed=1)
    return asyncio.run(run_conversations(client, plan, conversations))


def test_each_turn_sends_the_whole_history_with_the_servers_replies():
    conversations = [
        Conversation(("a1 one", "a2 two words", "a3"), system_prompt="be brief"),
        Conversation(("b1", "b2")),
    ]
    with serving(FakeServer(tokens_per_event=2)) as server:
        records = replay(server, conversations, users=2)
    reply = "x" * MAX_TOKENS  # the fake server's reply, in events of two characters
    for index, conversation in enumerate(conversations):
        bodies = [b for b in server.bodies if conversation.user_turns[0] in str(b["messages"])]
        assert len(bodies) == len(conversation.user_turns)
        expected: list[dict[str, str]] = []
        if conversation.system_prompt:
            expected.append({"role": "system", "content": conversation.system_prompt})
        for turn, (body, text) in enumerate(zip(bodies, conversation.user_turns, strict=True)):
            expected.append({"role": "user", "content": text})
            assert body["messages"] == expected, (index, turn)
            expected.append({"role": "assistant", "content": reply})
        turns = sorted(r.turn for r in records if r.conversation == index)
        assert turns == list(range(1, len(conversation.user_turns) + 1))
    assert all(r.record.ok and r.record.output_tokens == MAX_TOKENS for r in records)


def test_a_failed_turn_ends_its_conversation_and_the_others_go_on():
    conversations = [Conversation(("http-400 refused", "never sent")), Conversation(("c1", "c2"))]
    with serving(FakeServer()) as server:
        records = replay(server, conversations, users=1)
    assert [(r.conversation, r.turn, r.record.error) for r in records] == [
        (0, 1, "HTTP 400"),
        (1, 1, None),
        (1, 2, None),
    ]
    later = summarize_turns(records, 2)
    assert (later.num_turns, later.num_errors) == (1, 0)
    first = summarize_turns(records, 1, 1)
    assert (first.turns, first.num_turns, first.num_errors) == ("1", 2, 1)
    # Tokens count the completed turns only; the fake server reports CACHED_TOKENS each.
    assert first.cached_tokens == CACHED_TOKENS
    assert first.computed_tokens == first.prompt_tokens - CACHED_TOKENS


def test_summaries_aggregate_the_turns_asked_for():
    def record(turn: int, ttft_s: float, prompt: int, cached: int) -> TurnRecord:
        r = RequestRecord(sent_s=0.0, prompt_tokens=prompt, cached_tokens=cached, end_s=1.0)
        r.token_times_s.append(ttft_s)
        r.token_counts.append(1)
        return TurnRecord(0, turn, r)

    records = [record(1, 0.5, 100, 0), record(2, 0.1, 200, 150), record(3, 0.3, 300, 250)]
    later = summarize_turns(records, 2)
    assert later.turns == "2-"
    assert (later.prompt_tokens, later.cached_tokens, later.computed_tokens) == (500, 400, 100)
    assert (later.ttft_p50_ms, later.ttft_p99_ms) == (100.0, 300.0)
    # Turn 2 has 99 new tokens (200 less turn 1's 100 and its one-token reply) and computed
    # 50: none of its history; turn 3 has 99 new ones and computed 50 as well.
    assert history_recomputed_tokens(records) == 0
    # A turn that reused only part of its history: turn 3 computed 120 = 99 new + 21 of it.
    records[2] = record(3, 0.3, 300, 180)
    assert history_recomputed_tokens(records) == 21


def test_synthetic_conversations_share_one_system_prompt_and_repeat_for_a_seed(tiny_llama_dir):
    tokenizer = Tokenizer(tiny_llama_dir)
    conversations = synthetic_conversations(tokenizer, 3, 4, 20, (5, 9), seed=7)
    assert conversations == synthetic_conversations(tokenizer, 3, 4, 20, (5, 9), seed=7)
    assert len({c.system_prompt for c in conversations}) == 1
    assert all(len(c.user_turns) == 4 for c in conversations)
    lengths = [
        len(tokenizer.encode(t, add_special_tokens=False))
        for c in conversations
        for t in c.user_turns
    ]
    assert all(1 <= n <= 9 for n in lengths)  # text of n tokens tokenizes to at most n
    assert synthetic_conversations(tokenizer, 1, 2, 0, (5, 9))[0].system_prompt == ""


def test_sharegpt_user_turns_are_the_human_turns_in_order(tiny_llama_dir, tmp_path):
    path = write_sharegpt_file(tmp_path / "sg.json", Tokenizer(tiny_llama_dir), 40, seed=3)
    raw = json.loads(path.read_text())
    turns = sharegpt_user_turns(path)
    expected = [tuple(t["value"] for t in c["conversations"] if t["from"] == "human") for c in raw]
    assert turns == [t for t in expected if t]
    assert any(len(t) == 2 for t in turns)  # some conversations have a second human turn
