"""Sampler against straightforward per-row references (sort-based truncation, Python penalties)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from engine.sampler import Sampler, SamplingInput, _apply_penalties, argmax_rows
from engine.sampling_params import SamplingParams


def _row(
    generator: torch.Generator | None = None,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    **params: float | int | None,
) -> SamplingInput:
    return SamplingInput(SamplingParams(**params), generator, prompt or [], output or [])


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a row samples from: temperature → min-p → top-k → top-p, by full sort."""
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    probs[probs < params.min_p * probs.max()] = 0.0
    order = torch.argsort(probs, descending=True, stable=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    num_kept = params.top_k if params.top_k_enabled else len(probs)
    sorted_probs = probs[order][:num_kept]
    sorted_probs = sorted_probs / sorted_probs.sum()
    mass_before = torch.cumsum(sorted_probs, 0) - sorted_probs
    num_kept = int((mass_before < params.top_p).sum())
    keep[order[:num_kept]] = True
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum()


def _chi2_critical(df: int, z: float = 4.0) -> float:
    """Wilson-Hilferty upper quantile of chi-square (z = 4: a false alarm ~3e-5 per test)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def _assert_matches_distribution(samples: list[int], probs: torch.Tensor) -> None:
    """Chi-square goodness of fit, pooling tokens with small expected counts into one bin."""
    counts = Counter(samples)
    assert all(probs[t] > 0 for t in counts), "sampled a token outside the allowed set"
    expected = probs * len(samples)
    big = (expected >= 5).nonzero().flatten().tolist()
    small = (expected < 5).nonzero().flatten().tolist()
    observed = [counts.get(t, 0) for t in big]
    exp = [float(expected[t]) for t in big]
    if small and float(expected[small].sum()) > 0:
        observed.append(sum(counts.get(t, 0) for t in small))
        exp.append(float(expected[small].sum()))
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, exp, strict=True) if e > 0)
    assert chi2 < _chi2_critical(max(1, len(exp) - 1)), (chi2, len(exp))


@pytest.mark.parametrize("vocab", [49152, 1000, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_equals_torch_argmax(vocab: int, dtype: torch.dtype) -> None:
    gen = _seeded(0)
    x = torch.randn(9, vocab, generator=gen).to(dtype)
    x[1] = 0.0  # all tied: first index
    x[2, vocab // 2] = x[2, vocab - 1] = 100.0  # tie across blocks
    x[3] = float("-inf")
    x[4, vocab // 3] = float("nan")
    assert torch.equal(argmax_rows(x), x.float().argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax_and_leaves_logits_alone(dtype: torch.dtype) -> None:
    """An all-greedy batch of bfloat16 logits (the LM head's output as is) takes the argmax
    the widened float32 logits would give."""
    logits = torch.randn(33, 49152, generator=_seeded(1)).to(dtype)
    logits[5, 100] = logits[5, 40000] = 50.0  # a tie: the first index
    before = logits.clone()
    out = Sampler(seed=0)(logits, [_row(temperature=0.0) for _ in range(33)])
    assert out.sampled_token_ids == before.float().argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 33
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "params",
    [
        {"top_k": 1},
        {"top_p": 1e-6},
        {"min_p": 1.0},
        {"top_k": 1, "top_p": 0.5, "min_p": 0.5},
        {"top_p": 1e-6, "temperature": 5.0},
    ],
)
def test_degenerate_truncation_equals_greedy(params: dict[str, float]) -> None:
    logits = torch.randn(16, 5000, generator=_seeded(2)) * 2
    expected = logits.argmax(dim=-1).tolist()
    sampler = Sampler(seed=0)
    for _ in range(5):
        out = sampler(logits.clone(), [_row(**params) for _ in range(16)])
        assert out.sampled_token_ids == expected


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0},
        {"temperature": 0.6},
        {"temperature": 1.7},
        {"temperature": 0.8, "top_k": 5},
        {"temperature": 1.0, "top_p": 0.7},
        {"temperature": 1.3, "top_p": 0.9, "top_k": 8},
        {"temperature": 1.0, "min_p": 0.08},
        {"temperature": 0.9, "min_p": 0.02, "top_p": 0.8},
    ],
)
def test_empirical_distribution_matches_reference(params: dict[str, float]) -> None:
    vocab, rows, steps = 40, 128, 100
    logits = torch.randn(vocab, generator=_seeded(3)) * 1.5
    reference = _reference_probs(logits, SamplingParams(**params))
    sampler = Sampler(seed=4)
    samples: list[int] = []
    for _ in range(steps):
        batch = logits.expand(rows, vocab).clone()
        samples += sampler(batch, [_row(**params) for _ in range(rows)]).sampled_token_ids
    _assert_matches_distribution(samples, reference)


def test_seeded_rows_follow_the_same_distribution() -> None:
    logits = torch.randn(30, generator=_seeded(5))
    params = {"temperature": 1.1, "top_p": 0.85}
    reference = _reference_probs(logits, SamplingParams(**params))
    sampler = Sampler(seed=0)
    samples: list[int] = []
    for seed in range(4000):
        out = sampler(logits.clone().unsqueeze(0), [_row(_seeded(seed), **params)])
        samples += out.sampled_token_ids
    _assert_matches_distribution(samples, reference)


def test_truncation_never_samples_outside_the_allowed_set() -> None:
    rng = random.Random(6)
    sampler = Sampler(seed=6)
    vocab = 3000
    for step in range(40):
        logits = torch.randn(32, vocab, generator=_seeded(step)) * rng.choice([0.5, 2.0, 6.0])
        rows = [
            _row(
                temperature=rng.choice([0.3, 1.0, 2.5]),
                top_k=rng.choice([-1, 0, 1, 2, 20, 500, vocab, vocab + 5]),
                top_p=rng.choice([1.0, 0.95, 0.5, 0.1]),
                min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
            )
            for _ in range(32)
        ]
        out = sampler(logits.clone(), rows)
        for i, token in enumerate(out.sampled_token_ids):
            assert _reference_probs(logits[i], rows[i].params)[token] > 0, rows[i].params


def _reference_penalties(logits: torch.Tensor, row: SamplingInput) -> torch.Tensor:
    out = logits.clone()
    p = row.params
    for token in set(row.prompt_token_ids) | set(row.output_token_ids):
        value = float(out[token])
        out[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
    for token, count in Counter(row.output_token_ids).items():
        out[token] -= count * p.frequency_penalty + p.presence_penalty
    return out


def _random_penalty_rows(rng: random.Random, num_rows: int, vocab: int) -> list[SamplingInput]:
    rows = []
    for _ in range(num_rows):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        params = {
            "repetition_penalty": rng.choice([1.0, 1.3, 0.7, 2.0]),
            "frequency_penalty": rng.choice([0.0, 0.4, -0.5, 2.0]),
            "presence_penalty": rng.choice([0.0, 1.0, -1.5]),
        }
        rows.append(_row(None, prompt, output, temperature=0.0, **params))
    return rows


def test_penalties_match_per_row_reference() -> None:
    rng = random.Random(7)
    vocab = 64
    for _ in range(20):
        rows = _random_penalty_rows(rng, 12, vocab)
        logits = torch.randn(12, vocab, generator=_seeded(rng.randrange(10**6))) * 3
        penalized = logits.clone()
        _apply_penalties(penalized, rows)
        expected = torch.stack([_reference_penalties(logits[i], r) for i, r in enumerate(rows)])
        torch.testing.assert_close(penalized, expected)
        # End to end: greedy rows pick the argmax of the penalized logits.
        mixed = [*rows, _row(temperature=0.0)]
        batch = torch.cat([logits, torch.randn(1, vocab)])
        out = Sampler(seed=0)(batch, mixed)
        assert out.sampled_token_ids[:12] == expected.argmax(dim=-1).tolist()


def _other_row(rng: random.Random) -> SamplingInput:
    return _row(
        rng.choice([None, _seeded(rng.randrange(1000))]),
        [rng.randrange(500) for _ in range(5)],
        [rng.randrange(500) for _ in range(5)],
        temperature=rng.choice([0.0, 0.7, 1.5]),
        top_k=rng.choice([-1, 3, 400]),
        top_p=rng.choice([1.0, 0.6]),
        min_p=rng.choice([0.0, 0.1]),
        frequency_penalty=rng.choice([0.0, 0.5]),
        logprobs=rng.choice([None, 2]),
    )


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0},
        {"temperature": 0.8, "top_p": 0.9},
        {"temperature": 1.2, "top_k": 50},
        {"temperature": 1.0, "top_k": 40, "top_p": 0.8, "min_p": 0.01},
        {"temperature": 0.7, "min_p": 0.05, "repetition_penalty": 1.2, "presence_penalty": 0.3},
    ],
)
def test_seeded_row_is_independent_of_the_batch(params: dict[str, float]) -> None:
    rng = random.Random(8)
    vocab, steps = 5000, 12
    step_logits = [torch.randn(vocab, generator=_seeded(100 + s)) * 2 for s in range(steps)]
    prompt, output = [1, 2, 3], [4, 4, 5]

    def run(batch_size: int) -> list[int]:
        gen = _seeded(1234)
        sampler = Sampler(seed=rng.randrange(1000))
        tokens = []
        for logits in step_logits:
            others = [_other_row(rng) for _ in range(batch_size - 1)]
            position = rng.randrange(batch_size)
            rows = [*others[:position], _row(gen, prompt, output, **params), *others[position:]]
            batch = torch.randn(batch_size, vocab) * 3
            batch[position] = logits
            tokens.append(sampler(batch, rows).sampled_token_ids[position])
        return tokens

    alone = run(1)
    assert len(set(alone)) > 1
    for batch_size in (2, 7, 33):
        assert run(batch_size) == alone


def test_logprobs_are_raw_log_softmax_with_correct_top_and_rank() -> None:
    vocab = 2000
    logits = torch.randn(6, vocab, generator=_seeded(9)) * 2
    logits[5, :3] = 20.0  # ties at the top
    rows = [
        _row(temperature=0.0, logprobs=5),
        _row(temperature=1.5, top_k=30, logprobs=0, repetition_penalty=1.5, output=[1, 2]),
        _row(temperature=0.5, top_p=0.5, logprobs=20, presence_penalty=2.0, output=[7]),
        _row(temperature=0.0),
        _row(temperature=2.0, logprobs=1, min_p=0.01),
        _row(temperature=0.0, logprobs=3),
    ]
    raw = torch.log_softmax(logits, dim=-1)
    out = Sampler(seed=0)(logits.clone(), rows)
    assert out.logprobs[3] is None
    for i, row in enumerate(rows):
        lp = out.logprobs[i]
        if row.params.logprobs is None:
            continue
        assert lp is not None
        token = out.sampled_token_ids[i]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(float(raw[i, token]), abs=1e-5)
        assert lp.rank == 1 + int((raw[i] > raw[i, token]).sum())
        assert len(lp.top) == row.params.logprobs
        top_values = [v for _, v in lp.top]
        assert top_values == sorted(top_values, reverse=True)
        expected_values = torch.sort(raw[i], descending=True).values[: len(lp.top)]
        torch.testing.assert_close(torch.tensor(top_values), expected_values)
        for token_id, value in lp.top:
            assert value == pytest.approx(float(raw[i, token_id]), abs=1e-5)
    assert out.logprobs[5] is not None
    assert out.logprobs[5].rank == 1
    assert {t for t, _ in out.logprobs[5].top} == {0, 1, 2}


def test_shared_generator_seed_is_reproducible() -> None:
    logits = torch.randn(8, 4000, generator=_seeded(10))
    rows = [_row(temperature=1.0, top_p=0.9) for _ in range(8)]
    first = Sampler(seed=11)(logits.clone(), rows).sampled_token_ids
    assert Sampler(seed=11)(logits.clone(), rows).sampled_token_ids == first


def test_accepts_inference_mode_logits_from_any_float_dtype() -> None:
    with torch.inference_mode():
        logits = torch.randn(4, 1000, generator=_seeded(12)) * 3
    rows = [
        _row(temperature=0.0, repetition_penalty=1.2, output=[1]),
        _row(temperature=0.7, top_p=0.9),
        _row(temperature=0.7, top_k=10),
        _row(temperature=0.0),
    ]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = Sampler(seed=0)(logits.to(dtype), rows)
        assert out.sampled_token_ids[3] == int(logits.to(dtype).float()[3].argmax())


def test_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 10), [_row()])
