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

A chat API takes text only: there the prompts are the token ids' text (``as_text``), which
tokenizes to at most as many tokens, and the lengths are clipped to leave room for the chat
template's own tokens.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import tokenizers

from engine.tokenizer import Tokenizer

WORKLOADS = ("chat", "shared-prefix", "long-mixed")


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """One request to send. ``prompt_token_ids`` is the prompt (synthetic workloads) or what
    ``prompt_text`` tokenizes to (datasets, and synthetic prompts made text for a chat API);
    backends send the text when there is one."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    kind: str  # chat | shared-prefix | stream | long | jsonl | sharegpt
    prompt_text: str | None = None


def regular_token_ids(tokenizer: tokenizers.Tokenizer) -> list[int]:
    """The vocabulary minus added/special tokens."""
    special = set(tokenizer.get_added_tokens_decoder())
    return [i for i in range(tokenizer.get_vocab_size()) if i not in special]


def fit_text(tokenizer: Tokenizer, token_ids: Sequence[int]) -> tuple[str, tuple[int, ...]]:
    """Text made of ``token_ids`` that tokenizes (without special tokens) to at most as many
    tokens, usually exactly as many, and those tokens. Random tokens decoded do not tokenize
    back to themselves (merges across their boundaries, characters split between them), so,
    as vLLM's random dataset does, the text is tokenized again and cut back until it fits."""
    retokenized = tokenizer.encode(tokenizer.decode(token_ids), add_special_tokens=False)
    keep = len(token_ids)
    while True:
        text = tokenizer.decode(retokenized[:keep])
        ids = tokenizer.encode(text, add_special_tokens=False)
        excess = len(ids) - len(token_ids)
        if excess <= 0 or keep == 0:
            return text, tuple(ids)
        keep = max(keep - excess, 0)


def as_text(request: LoadRequest, tokenizer: Tokenizer) -> LoadRequest:
    """``request`` with a text prompt (``fit_text`` of its token ids), for a chat API."""
    text, ids = fit_text(tokenizer, request.prompt_token_ids)
    return dataclasses.replace(request, prompt_token_ids=ids, prompt_text=text)


def chat_template_tokens(tokenizer: Tokenizer) -> int:
    """The tokens a chat API's template adds around one user message (0 without a template):
    what a chat prompt must leave free of the context length."""
    if not tokenizer.chat_template:
        return 0
    return len(tokenizer.encode_chat([{"role": "user", "content": ""}]))


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

    def next(self) -> LoadRequest:
        rng = self._rng
        if self.workload == "chat":
            prompt, output = self._fit(
                _lognormal(rng, 256, 0.6, 16, 1536), _lognormal(rng, 128, 0.5, 8, 512)
            )
            return LoadRequest(self._tokens(prompt), output, "chat")
        if self.workload == "shared-prefix":
            prefix = rng.choice(self._prefixes)
            user_tokens, output = self._fit(rng.randint(32, 128), rng.randint(32, 96))
            prompt = (prefix + self._tokens(user_tokens))[: self._max_model_len - output]
            return LoadRequest(prompt, output, "shared-prefix")
        if rng.random() < 0.2:
            prompt, output = self._fit(rng.randint(1024, 3072), rng.randint(16, 32))
            return LoadRequest(self._tokens(prompt), output, "long")
        prompt, output = self._fit(rng.randint(64, 256), rng.randint(128, 256))
        return LoadRequest(self._tokens(prompt), output, "stream")


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
