"""Prompt-lookup drafts: the O(1) index against a brute-force search of the same rule."""

from __future__ import annotations

import random

import pytest

from engine.ngram_proposer import NgramIndex, NgramProposer
from engine.request import Request
from engine.sampling_params import SamplingParams


def brute_force_draft(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The longest suffix n-gram's latest earlier occurrence, searched position by position."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.parametrize("min_n,max_n", [(1, 4), (2, 4), (3, 3)])
def test_index_matches_brute_force_as_tokens_arrive(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    # A small alphabet and pasted repeats: many matches of every length.
    tokens = [rng.randrange(6) for _ in range(20)]
    index = NgramIndex(min_n, max_n)
    for _ in range(300):
        if rng.random() < 0.2:
            start = rng.randrange(len(tokens) - 3)
            tokens.extend(tokens[start : start + rng.randint(1, 5)])
        else:
            tokens.append(rng.randrange(6))
        index.extend(tokens)
        assert index.draft(tokens, 5) == brute_force_draft(tokens, min_n, max_n, 5)


def test_no_draft_without_a_repeat_and_drafts_capped():
    index = NgramIndex(1, 4)
    tokens = [1, 2, 3, 4]
    index.extend(tokens)
    assert index.draft(tokens, 3) == []
    tokens += [1, 2]
    index.extend(tokens)
    assert index.draft(tokens, 3) == [3, 4, 1]
    assert index.draft(tokens, 1) == [3]


def test_proposer_caps_by_its_length_and_the_callers_and_forgets():
    proposer = NgramProposer(num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=3)
    request = Request(
        req_id="r",
        prompt_token_ids=[5, 6, 7, 8, 5, 6],
        sampling_params=SamplingParams(temperature=0.0),
        eos_token_ids=frozenset(),
        block_size=16,
        arrival_time_s=0.0,
    )
    assert proposer.propose(request, max_tokens=10) == [7, 8]
    assert proposer.propose(request, max_tokens=1) == [7]
    assert proposer.propose(request, max_tokens=0) == []
    request.append_output_token(7)
    assert proposer.propose(request, max_tokens=10) == [8, 5]
    proposer.forget("r")
    proposer.forget("r")
    assert NgramProposer(0, 1, 3).propose(request, max_tokens=10) == []


def test_the_index_holds_each_ngrams_latest_position_however_it_is_extended():
    """Against a direct definition: for every n-gram that ends before position ``pos``
    (``pos >= 1``), the latest such ``pos``; whether the tokens arrive at once or in pieces
    (short pieces take the loop, long ones the bulk path), and for sequences shorter than the
    longest n."""
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
        min_n, max_n = rng.randrange(1, 3), 4
        want = {}
        for pos in range(1, len(tokens)):
            for n in range(min_n, min(max_n, pos) + 1):
                want[tuple(tokens[pos - n : pos])] = pos
        index = NgramIndex(min_n, max_n)
        cut = rng.randrange(0, len(tokens) + 1)
        index.extend(tokens[:cut])
        index.extend(tokens)
        assert index.positions == want
        assert index.num_indexed_tokens == len(tokens)
