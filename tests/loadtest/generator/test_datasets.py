"""Loadtest datasets: JSONL and ShareGPT parsing, vLLM's filtering, the seeded order, errors
that name the line or entry, and the generated ShareGPT file."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from engine.tokenizer import Tokenizer
from loadtest.generator.datasets import (
    Dataset,
    DatasetError,
    DatasetKind,
    Entry,
    load_dataset,
    write_sharegpt_file,
)
from loadtest.generator.synthetic import fit_text, regular_token_ids


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer(tiny_llama_dir)


def text_of(tokenizer: Tokenizer, num_tokens: int, seed: int = 0) -> str:
    """Text of exactly ``num_tokens`` tokens."""
    rng = random.Random(seed)
    vocab = regular_token_ids(tokenizer.backend)
    while True:
        text, ids = fit_text(tokenizer, [rng.choice(vocab) for _ in range(num_tokens)])
        if len(ids) == num_tokens and len(tokenizer.encode(text)) == num_tokens:
            return text


def write(path: Path, lines: list[object]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def sharegpt(*turns: tuple[str, str]) -> dict[str, object]:
    return {"id": "c", "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_jsonl_entries_take_their_output_length_or_the_default(tmp_path):
    path = write(
        tmp_path / "d.jsonl",
        [
            {"prompt": "one", "output_tokens": 5},
            "",
            {"prompt": "two", "max_tokens": 7},
            {"prompt": "three", "extra": "ignored"},
        ],
    )
    dataset = load_dataset(DatasetKind.JSONL, path, default_output_tokens=9)
    assert dataset.entries == (Entry("one", 5), Entry("two", 7), Entry("three", 9))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"output_tokens": 3}', "needs a non-empty string 'prompt'"),
        ('{"prompt": ""}', "needs a non-empty string 'prompt'"),
        ('{"prompt": "a", "output_tokens": 0}', "'output_tokens' must be an integer >= 1"),
        ('{"prompt": "a", "max_tokens": "5"}', "'max_tokens' must be an integer >= 1"),
        ('{"prompt": "a", "max_tokens": true}', "'max_tokens' must be an integer >= 1"),
        ('{"prompt": "a", "max_tokens": 2, "output_tokens": 2}', "give one of"),
    ],
)
def test_a_malformed_jsonl_line_is_named(tmp_path, line, message):
    path = write(tmp_path / "d.jsonl", [{"prompt": "fine"}, line])
    with pytest.raises(DatasetError, match=f"^{path}:2: {message}"):
        load_dataset(DatasetKind.JSONL, path, 128)


def test_sharegpt_takes_the_first_human_turn_and_its_reply(tmp_path):
    path = tmp_path / "sharegpt.json"
    conversations = [
        sharegpt(("human", "q1"), ("gpt", "a1")),
        sharegpt(("human", "q2"), ("gpt", "a2"), ("human", "q3"), ("gpt", "a3")),
        sharegpt(("human", "alone")),
        sharegpt(("gpt", "a"), ("human", "q")),
        sharegpt(("system", "s"), ("human", "q"), ("gpt", "a")),
        sharegpt(("human", "q"), ("human", "q")),
        sharegpt(),
    ]
    path.write_text(json.dumps(conversations))
    dataset = load_dataset(DatasetKind.SHAREGPT, path, 128)
    assert dataset.entries == (Entry("q1", reply="a1"), Entry("q2", reply="a2"))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('[{"conversations": []},\n {"conversations": [}]', r":2: not JSON"),
        ('{"conversations": []}', ": not a JSON list of conversations"),
        ('[{"conversations": []}, {"id": 1}]', ": entry 1: needs a list 'conversations'"),
        ('[{"conversations": [{"from": "human"}]}]', ": entry 0: turn 0 needs strings"),
        ('[{"conversations": [{"from": "human", "value": 3}]}]', ": entry 0: turn 0 needs"),
        ("[]", ": no usable sharegpt entry"),
    ],
)
def test_a_malformed_sharegpt_file_names_the_entry(tmp_path, content, message):
    path = tmp_path / "sharegpt.json"
    path.write_text(content)
    with pytest.raises(DatasetError, match="^" + str(path) + message):
        load_dataset(DatasetKind.SHAREGPT, path, 128)


def test_an_unreadable_file_is_an_error(tmp_path):
    with pytest.raises(DatasetError, match="cannot read"):
        load_dataset(DatasetKind.JSONL, tmp_path / "missing.jsonl", 128)
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(DatasetError, match="no usable jsonl entry"):
        load_dataset(DatasetKind.JSONL, tmp_path / "blank.jsonl", 128)


def test_sharegpt_sampling_filters_as_vllm(tokenizer):
    def entry(prompt_tokens: int, reply_tokens: int, seed: int) -> Entry:
        prompt = text_of(tokenizer, prompt_tokens, seed)
        return Entry(prompt, reply=text_of(tokenizer, reply_tokens, seed + 1))

    fits = [entry(10, 8, 0), entry(4, 4, 2), entry(50, 14, 4)]  # 64 = the context: fits
    too_short = [entry(3, 10, 6), entry(10, 3, 8)]
    too_long = [entry(50, 15, 10)]
    dataset = Dataset(DatasetKind.SHAREGPT, Path("x.json"), (*fits, *too_short, *too_long))
    requests = dataset.sample(100, 0, tokenizer, max_model_len=64)
    assert sorted(r.prompt_text for r in requests) == sorted(e.prompt for e in fits)
    for request in requests:
        (entry_,) = (e for e in fits if e.prompt == request.prompt_text)
        assert request.prompt_token_ids == tuple(tokenizer.encode(entry_.prompt))
        assert request.max_tokens == len(tokenizer.encode(entry_.reply, add_special_tokens=False))
        assert request.kind == "sharegpt"


def test_jsonl_sampling_drops_only_what_does_not_fit(tokenizer):
    entries = (Entry(text_of(tokenizer, 2), 1), Entry(text_of(tokenizer, 30, 1), 40))
    dataset = Dataset(DatasetKind.JSONL, Path("x.jsonl"), entries)
    (request,) = dataset.sample(10, 0, tokenizer, max_model_len=64)
    assert (request.prompt_text, request.max_tokens) == (entries[0].prompt, 1)


def test_sampling_order_is_a_seeded_shuffle_cut_at_num_requests(tokenizer):
    entries = tuple(Entry(f"prompt number {i}", 4) for i in range(20))
    dataset = Dataset(DatasetKind.JSONL, Path("x.jsonl"), entries)

    def prompts(num_requests: int, seed: int) -> list[str | None]:
        return [r.prompt_text for r in dataset.sample(num_requests, seed, tokenizer, 256)]

    assert prompts(5, 3) == prompts(5, 3) == prompts(20, 3)[:5]
    assert prompts(20, 3) != prompts(20, 4)
    expected = list(entries)
    random.Random(3).shuffle(expected)
    assert prompts(20, 3) == [e.prompt for e in expected]


def test_write_sharegpt_file_is_deterministic_and_exercises_the_filters(tokenizer, tmp_path):
    first = write_sharegpt_file(tmp_path / "a.json", tokenizer, 200, seed=7)
    again = write_sharegpt_file(tmp_path / "b.json", tokenizer, 200, seed=7)
    other = write_sharegpt_file(tmp_path / "c.json", tokenizer, 200, seed=8)
    assert first.read_bytes() == again.read_bytes() != other.read_bytes()
    conversations = json.loads(first.read_text())
    assert len(conversations) == 200
    assert any(len(c["conversations"]) == 4 for c in conversations)
    dataset = load_dataset(DatasetKind.SHAREGPT, first, 128)
    assert 100 < len(dataset.entries) < 200  # lone turns and gpt-first ones are skipped
    for entry in dataset.entries:
        assert len(tokenizer.encode(entry.prompt)) <= 200
        assert len(tokenizer.encode(entry.reply, add_special_tokens=False)) <= 64
    requests = dataset.sample(1000, 0, tokenizer, max_model_len=10_000)
    assert 0 < len(requests) < len(dataset.entries)  # some prompts or replies are too short
    assert all(r.max_tokens >= 4 and len(r.prompt_token_ids) >= 4 for r in requests)
