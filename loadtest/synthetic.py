"""Synthetic request mixes for ``splitserve loadtest``, built from the model's tokenizer.

Prompts are token ids drawn from the tokenizer's regular vocabulary (no special tokens), so a
prompt's length is exact whatever the text would tokenize to. Lengths (tokens) per workload,
each clipped so that prompt + output fits ``max_model_len``:

- ``chat``: conversational turns. Prompt ~ lognormal(median 256, sigma 0.6) in [16, 1536];
  output ~ lognormal(median 128, sigma 0.5) in [8, 512] (the shape of ShareGPT-style traces).
- ``shared-prefix``: ``num_prefixes`` system prompts of ``prefix_tokens`` (default 8 x 512),
  each request one of them (uniformly) plus a fresh user part of 32-128 tokens; output 32-96.
  Prefix caching and prefix-aware routing pay off here.
- ``long-mixed``: streaming chats (80%: prompt 64-256, output 128-256) with long documents
  arriving among them (20%: prompt 1024-3072, output 16-32). Long prefills interfere with
  running decodes unless prefill and decode are disaggregated.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from tokenizers import Tokenizer

WORKLOADS = ("chat", "shared-prefix", "long-mixed")


@dataclass(frozen=True, slots=True)
class SyntheticRequest:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    kind: str  # chat | shared-prefix | stream | long


def regular_token_ids(tokenizer: Tokenizer) -> list[int]:
    """The vocabulary minus added/special tokens."""
    special = set(tokenizer.get_added_tokens_decoder())
    return [i for i in range(tokenizer.get_vocab_size()) if i not in special]


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return min(max(round(rng.lognormvariate(math.log(median), sigma)), low), high)


class WorkloadGenerator:
    """Seeded source of requests of one workload."""

    def __init__(
        self,
        workload: str,
        vocab: list[int],
        max_model_len: int,
        seed: int = 0,
        num_prefixes: int = 8,
        prefix_tokens: int = 512,
    ) -> None:
        if workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
        self.workload = workload
        self._vocab = vocab
        self._max_model_len = max_model_len
        self._rng = random.Random(seed)
        self._prefixes = [self._tokens(prefix_tokens) for _ in range(num_prefixes)]

    def _tokens(self, n: int) -> tuple[int, ...]:
        return tuple(self._rng.choice(self._vocab) for _ in range(n))

    def _fit(self, prompt_tokens: int, max_tokens: int) -> tuple[int, int]:
        max_tokens = min(max_tokens, self._max_model_len // 2)
        return min(prompt_tokens, self._max_model_len - max_tokens), max_tokens

    def next(self) -> SyntheticRequest:
        rng = self._rng
        if self.workload == "chat":
            prompt, output = self._fit(
                _lognormal(rng, 256, 0.6, 16, 1536), _lognormal(rng, 128, 0.5, 8, 512)
            )
            return SyntheticRequest(self._tokens(prompt), output, "chat")
        if self.workload == "shared-prefix":
            prefix = rng.choice(self._prefixes)
            user_tokens, output = self._fit(rng.randint(32, 128), rng.randint(32, 96))
            prompt = (prefix + self._tokens(user_tokens))[: self._max_model_len - output]
            return SyntheticRequest(prompt, output, "shared-prefix")
        if rng.random() < 0.2:
            prompt, output = self._fit(rng.randint(1024, 3072), rng.randint(16, 32))
            return SyntheticRequest(self._tokens(prompt), output, "long")
        prompt, output = self._fit(rng.randint(64, 256), rng.randint(128, 256))
        return SyntheticRequest(self._tokens(prompt), output, "stream")


def arrival_times_s(
    num_requests: int, rate_per_s: float, burstiness: float, seed: int
) -> list[float]:
    """Open-loop send times: gaps drawn from a gamma distribution of mean ``1 / rate`` and
    shape ``burstiness`` (1: Poisson; below 1: burstier, clustered arrivals)."""
    rng = random.Random(seed)
    theta = 1.0 / (rate_per_s * burstiness)
    times, now_s = [], 0.0
    for _ in range(num_requests):
        now_s += rng.gammavariate(burstiness, theta)
        times.append(now_s)
    return times
