"""What prompt-lookup speculation gains or costs, per workload, against no speculation.

``python -m loadtest.bench.speculation --model smollm2-135m [--settings 0,3:2,3:1,5:2]
[--num-prompts 64] [--output-tokens 128] [--out bench-out/speculation]``

Each setting ``k:n`` is ``--num-speculative-tokens k --prompt-lookup-min n`` (``0``: none; the
first setting is the baseline and must be ``0``). Two greedy workloads, each through a fresh
engine per setting in this process:

- **random-token**: ``bench_engine``'s (the same seeded prompts, ``ignore_eos``). The model's
  continuations of random tokens repeat themselves, so drafts are found and accepted often.
- **docs-chat**: chat requests about windows of this repository's Markdown docs (four
  instructions in turn: summarize, explain, rewrite, list the key points), stopping at EOS:
  natural text, where drafts are found less often.

Reported per run: generation wall and output tok/s, draft and accepted tokens, the acceptance
rate, and how many outputs are identical to the baseline's (all of them in float32; in
bfloat16 a different batch shape can flip a near-tie, as changing ``--max-num-seqs`` does).
Markdown goes to stdout and ``report.md``, the numbers to ``results.json``, under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from loadtest.bench.engine import resolve_model_dir
from loadtest.bench.kv_cache_quality import doc_texts
from loadtest.generator.workloads import random_token_workload

INSTRUCTIONS = (
    "Summarize this text in two sentences:",
    "Explain to a beginner what this text says:",
    "Rewrite this text in plain words:",
    "List the key points of this text:",
)
DOC_WINDOW_TOKENS = 256


@dataclass(frozen=True, slots=True)
class Setting:
    """``num_speculative_tokens`` drafts found by n-grams of at least ``prompt_lookup_min``."""

    num_speculative_tokens: int
    prompt_lookup_min: int

    @classmethod
    def parse(cls, text: str) -> Setting:
        k, _, n = text.partition(":")
        return cls(int(k), int(n or 2))

    def __str__(self) -> str:
        if not self.num_speculative_tokens:
            return "none"
        return f"{self.num_speculative_tokens} drafts, n >= {self.prompt_lookup_min}"


@dataclass(frozen=True, slots=True)
class Run:
    """One workload through one setting."""

    workload: str
    setting: str
    gen_wall_s: float
    output_tokens: int
    draft_tokens: int
    accepted_tokens: int
    identical_outputs: int
    num_prompts: int

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.gen_wall_s


def workloads(args: argparse.Namespace) -> dict[str, tuple[list[list[int]], bool]]:
    """Workload name -> (prompts, ignore_eos)."""
    random_token = random_token_workload(
        args.model_dir, args.num_prompts, 128, 512, args.output_tokens, args.seed
    )
    tokenizer = Tokenizer(args.model_dir)
    docs = [
        tokenizer.backend.decode(w)
        for w in doc_texts(tokenizer.encode, args.num_prompts, DOC_WINDOW_TOKENS)
    ]
    chats = [
        tokenizer.encode_chat(
            [{"role": "user", "content": f"{INSTRUCTIONS[i % len(INSTRUCTIONS)]}\n\n{doc}"}]
        )
        for i, doc in enumerate(docs)
    ]
    return {
        "random-token": ([list(p) for p in random_token.prompt_token_ids], True),
        "docs-chat": (chats, False),
    }


def run_setting(
    args: argparse.Namespace, setting: Setting, prompts: list[list[int]], ignore_eos: bool
) -> tuple[list[list[int]], float, int, int]:
    """Greedy outputs, generation wall, draft and accepted tokens of a fresh engine."""
    llm = LLM(
        str(args.model_dir),
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=64,
        max_num_batched_tokens=4096,
        num_speculative_tokens=setting.num_speculative_tokens,
        prompt_lookup_min=setting.prompt_lookup_min,
    )
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=ignore_eos)
    start_s = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall_s = time.perf_counter() - start_s
    scheduler = llm.engine.scheduler
    return (
        [o.token_ids for o in outputs],
        wall_s,
        scheduler.num_draft_tokens,
        scheduler.num_accepted_tokens,
    )


def report(args: argparse.Namespace, runs: list[Run]) -> str:
    lines = [
        f"## bench_speculation: {args.model} (--dtype {args.dtype}, --kv-cache-dtype "
        f"{args.kv_cache_dtype}), {torch.get_num_threads()} threads",
        "",
        f"- {args.num_prompts} prompts per workload, at most {args.output_tokens} output tokens, "
        f"greedy; docs-chat: {DOC_WINDOW_TOKENS}-token windows of README.md and docs/*.md",
        "",
        "| workload | speculation | gen wall (s) | output tokens | tok/s | vs none | drafts | "
        "accepted | acceptance | outputs identical to none |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base: dict[str, Run] = {}
    for run in runs:
        base.setdefault(run.workload, run)
        ratio = run.tok_per_s / base[run.workload].tok_per_s
        acceptance = run.accepted_tokens / run.draft_tokens if run.draft_tokens else 0.0
        lines.append(
            f"| {run.workload} | {run.setting} | {run.gen_wall_s:.2f} | {run.output_tokens} | "
            f"{run.tok_per_s:.1f} | {ratio:.2f}x | {run.draft_tokens} | {run.accepted_tokens} | "
            f"{acceptance:.0%} | {run.identical_outputs}/{run.num_prompts} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.speculation", description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--settings", default="0,3:2,3:1,5:2", help="comma-separated k[:n]")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench-out/speculation"))
    args = p.parse_args(argv)
    args.settings = [Setting.parse(s) for s in args.settings.split(",") if s.strip()]
    if not args.settings or args.settings[0].num_speculative_tokens != 0:
        p.error("--settings must start with 0 (the baseline without speculation)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    args.model_dir = resolve_model_dir(args.model)
    prompt_sets = workloads(args)
    runs: list[Run] = []
    for name, (prompts, ignore_eos) in prompt_sets.items():
        baseline: list[list[int]] | None = None
        for setting in args.settings:
            outputs, wall_s, drafts, accepted = run_setting(args, setting, prompts, ignore_eos)
            baseline = baseline or outputs
            runs.append(
                Run(
                    workload=name,
                    setting=str(setting),
                    gen_wall_s=wall_s,
                    output_tokens=sum(len(o) for o in outputs),
                    draft_tokens=drafts,
                    accepted_tokens=accepted,
                    identical_outputs=sum(a == b for a, b in zip(outputs, baseline, strict=True)),
                    num_prompts=len(prompts),
                )
            )
            print(f"[bench_speculation] {name}, {setting}: {wall_s:.2f} s", file=sys.stderr)
    text = report(args, runs)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.md").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps([asdict(r) for r in runs], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
