"""Fixed offline prompt sets for ``bench_engine``.

Prompts are random token ids, not tokenized text: every system receives the exact same
``prompt_token_ids``, so no tokenizer round trip can change prompt lengths between systems.
Ids are drawn uniformly from the tokenizer's vocabulary minus its added/special tokens and
minus ids the model cannot embed; lengths are uniform in ``[min_prompt_tokens,
max_prompt_tokens]``. Everything derives from ``seed``.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

PROMPT_METHOD = "random-token-ids"


@dataclass(frozen=True, slots=True)
class Workload:
    """A prompt set plus its generation length; prompts are pairwise distinct."""

    prompt_token_ids: tuple[tuple[int, ...], ...]
    output_tokens: int
    seed: int
    method: str = PROMPT_METHOD

    @property
    def num_prompts(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompt_token_ids)

    @property
    def max_prompt_tokens(self) -> int:
        return max(len(p) for p in self.prompt_token_ids)


def sampleable_token_ids(model_dir: Path) -> list[int]:
    """Ids a prompt may use: tokenizer vocabulary without added tokens, below the model vocab."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    added = set(tokenizer.get_added_tokens_decoder())
    model_vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    vocab_ids = tokenizer.get_vocab(with_added_tokens=False).values()
    ids = sorted(i for i in vocab_ids if i not in added and i < model_vocab_size)
    if not ids:
        raise ValueError(f"{model_dir}: tokenizer has no sampleable (non-special) tokens")
    return ids


def random_token_workload(
    model_dir: Path,
    num_prompts: int,
    min_prompt_tokens: int,
    max_prompt_tokens: int,
    output_tokens: int,
    seed: int,
) -> Workload:
    """Build the seeded random-token prompt set described in the module docstring."""
    if num_prompts < 1 or output_tokens < 1:
        raise ValueError("num_prompts and output_tokens must be >= 1")
    if not 1 <= min_prompt_tokens <= max_prompt_tokens:
        raise ValueError("need 1 <= min_prompt_tokens <= max_prompt_tokens")
    token_ids = sampleable_token_ids(model_dir)
    rng = random.Random(seed)
    prompts: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()
    for _ in range(100 * num_prompts):
        if len(prompts) == num_prompts:
            break
        length = rng.randint(min_prompt_tokens, max_prompt_tokens)
        prompt = tuple(rng.choices(token_ids, k=length))
        # Distinct prompts let arms map streamed outputs back by prompt_token_ids.
        if prompt not in seen:
            seen.add(prompt)
            prompts.append(prompt)
    if len(prompts) < num_prompts:
        raise ValueError("cannot draw enough distinct prompts; widen the length range")
    return Workload(prompt_token_ids=tuple(prompts), output_tokens=output_tokens, seed=seed)


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of ``random_token_workload`` (``workload_from_args`` reads them); the defaults
    are the standard offline workload: 64 prompts of 128-512 tokens, 128 output tokens."""
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-prompt-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)


def workload_from_args(model_dir: Path, args: argparse.Namespace) -> Workload:
    """``random_token_workload`` of ``model_dir`` with the flags of ``add_workload_flags``."""
    return random_token_workload(
        model_dir,
        args.num_prompts,
        args.min_prompt_tokens,
        args.max_prompt_tokens,
        args.output_tokens,
        args.seed,
    )
