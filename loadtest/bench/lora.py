"""What serving LoRA adapters costs the native engine: the same batch without LoRA, with LoRA on
and no adapter used, with one adapter, and spread over several.

``python -m loadtest.bench.lora --model smollm2-135m [--num-prompts 32] [--prompt-tokens 128]
[--output-tokens 64] [--rank 16] [--num-adapters 4] [--repeats 3] [--out bench-out/lora]``

Random adapters of ``--rank`` on all seven projections are built with PEFT (offline, seeded).
Every arm runs ``bench_engine``'s seeded random-token prompts greedily to ``--output-tokens``
(``ignore_eos``, no speculation, so every arm computes the same number of tokens) through a
fresh engine in this process, after one warm-up batch; the arms take turns ``--repeats``
times, each turn a fresh engine (the best wall counts: a 2-core host's noise and the order of
engines built in one process only ever slow a run); reported: generation wall, output tok/s
and each arm's speed against the engine without LoRA. Markdown goes to stdout and ``report.md``,
the numbers to ``results.json``, under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.cpu_isa import host_isa
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from loadtest.bench.engine import resolve_model_dir
from loadtest.fixtures.tiny_lora import make_tiny_lora
from loadtest.generator.workloads import random_token_workload


@dataclass(frozen=True, slots=True)
class Arm:
    """How a batch's requests use adapters: ``num_adapters`` of them round-robin (0: none),
    on an engine with LoRA on or off."""

    name: str
    enable_lora: bool
    num_adapters: int


@dataclass(frozen=True, slots=True)
class Run:
    arm: str
    gen_wall_s: float
    output_tokens: int

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.gen_wall_s


def run_arm(
    model_dir: Path,
    arm: Arm,
    adapters: list[Path],
    prompts: list[list[int]],
    args: argparse.Namespace,
) -> Run:
    modules = ",".join(f"adapter{i}={path}" for i, path in enumerate(adapters))
    llm = LLM(
        str(model_dir),
        dtype=args.dtype,
        num_speculative_tokens=0,
        max_num_seqs=len(prompts),
        enable_lora=arm.enable_lora,
        lora_modules=modules if arm.enable_lora else "",
        max_loras=max(len(adapters), 1),
        max_lora_rank=args.rank,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    names = [
        f"adapter{i % arm.num_adapters}" if arm.num_adapters else "" for i in range(len(prompts))
    ]
    llm.generate(prompts[:4], params, lora_name=names[:4])  # warm-up
    start_s = time.perf_counter()
    outs = llm.generate(prompts, params, lora_name=names)
    wall_s = time.perf_counter() - start_s
    return Run(arm.name, wall_s, sum(len(out.token_ids) for out in outs))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench-out/lora"))
    args = parser.parse_args(argv)
    model_dir = resolve_model_dir(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    adapters = [
        make_tiny_lora(model_dir, args.out / "adapters" / str(i), rank=args.rank, seed=i)
        for i in range(args.num_adapters)
    ]
    workload = random_token_workload(
        model_dir, args.num_prompts, args.prompt_tokens, args.prompt_tokens, args.output_tokens, 0
    )
    prompts = [list(p) for p in workload.prompt_token_ids]
    arms = [
        Arm("LoRA off", False, 0),
        Arm("LoRA on, no adapter used", True, 0),
        Arm("one adapter", True, 1),
        Arm(f"{args.num_adapters} adapters, round-robin", True, args.num_adapters),
    ]
    turns = [
        [run_arm(model_dir, arm, adapters, prompts, args) for arm in arms]
        for _ in range(args.repeats)
    ]
    runs = [min(arm_runs, key=lambda r: r.gen_wall_s) for arm_runs in zip(*turns, strict=True)]
    base = runs[0].output_tok_s
    lines = [
        f"LoRA cost, {args.model}, --dtype {args.dtype}, CPU level {host_isa().value}: "
        f"{args.num_prompts} prompts x {args.prompt_tokens} tokens, {args.output_tokens} output "
        f"tokens each, rank {args.rank} on all projections, best of {args.repeats}",
        "",
        "| arm | wall (s) | output tok/s | vs LoRA off |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r.arm} | {r.gen_wall_s:.2f} | {r.output_tok_s:.1f} | {r.output_tok_s / base:.2f}x |"
        for r in runs
    ]
    report = "\n".join(lines)
    print(report)
    (args.out / "report.md").write_text(report + "\n")
    results = [asdict(r) | {"output_tok_s": r.output_tok_s} for r in runs]
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
