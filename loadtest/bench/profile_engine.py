"""Where an offline engine run spends its time, per kind of step and per part of the model.

``python -m loadtest.bench.profile_engine [--model smollm2-135m] [--device cpu]
[--kv-cache-dtype auto] [--cpu-isa auto] [--threads 2]``, or on a GPU
``python -m loadtest.bench.profile_engine --device cuda``

Runs ``bench_engine``'s workload (the same seeded random-token prompts, greedy, ``ignore_eos``)
through ``engine.LLM`` in this process, with ``perf_counter`` timers wrapped around each step's
``ModelRunner.execute`` and, inside it, around the parts that dominate on CPU: the linear
layers (oneDNN-packed, the LM head included), decode attention, the prefill chunks' SDPA, the
8-bit cache's gathers and every K/V write. Steps are split into decode steps (one new token per
request) and mixed steps (any prefill chunk). "Other" is the rest of ``execute``: the fused
elementwise ops, embedding, the step's metadata and Python. Timers add a few microseconds per
call, so compare runs of this tool with each other, and ``bench_engine`` for throughput.

A third table sets each kind of step's wall time against its floor, what the host allows: every
weight read once and the decode rows' KV at the read bandwidth measured on this host, and the
step's linears at the rate the engine's largest linear runs at here (``step_floor``).

Parts are only counted where they run through the wrapped functions: unpacked linears
(``F.linear``) count as "other", and at levels where prefill runs the compiled kernel its
attention is "other" too.

With ``--device cuda`` the kernels run asynchronously, so those timers measure the host's side
of each part only, and a second report (``step_profile``) answers what bounds a step: the run
goes under ``torch.profiler``, and each step splits into GPU-busy and host time; decode steps at
the largest batch seen (rows: drafts count) get their own medians and are set against the time
to read their weights and KV once; the kernels that took the most device time are listed. A
short warm-up on other prompts runs first, so that nothing compiles inside the profile. The
profiler adds its own host overhead to every op, so the host share is an upper bound.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

from engine.cpu_isa import ISA_CHOICES
from engine.llm import LLM
from engine.model import attention
from engine.model.packed_linear import PackedLinear
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledRequest
from loadtest.bench.engine import resolve_model_dir
from loadtest.bench.step_floor import floor_table, measure_rates, worked_steps
from loadtest.bench.step_profile import Step, decode_floor, gpu_report, marked_steps, patched
from loadtest.generator.workloads import (
    add_workload_flags,
    random_token_workload,
    workload_from_args,
)

PARTS = ("linears", "decode attention", "prefill SDPA", "8-bit gathers", "K/V writes")


class StepTimers:
    """Seconds per (step kind, part), and steps and ``execute`` seconds per step kind."""

    def __init__(self) -> None:
        self.seconds: defaultdict[tuple[Step, str], float] = defaultdict(float)
        self.steps: defaultdict[Step, int] = defaultdict(int)
        self.current = Step.MIXED

    def timed(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with its wall time added to ``part`` of the current step kind."""

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start_s = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[(self.current, part)] += time.perf_counter() - start_s

        return wrapper

    def table(self) -> str:
        """Markdown: one row per step kind, its parts and "other" in seconds."""
        lines = [
            "| steps | count | execute (s) | " + " | ".join(PARTS) + " | other |",
            "|---|---|---|" + "---|" * (len(PARTS) + 1),
        ]
        for kind in Step:
            total = self.seconds[(kind, "execute")]
            parts = [self.seconds[(kind, part)] for part in PARTS]
            cells = " | ".join(f"{s:.2f}" for s in [*parts, total - sum(parts)])
            lines.append(f"| {kind.value} | {self.steps[kind]} | {total:.2f} | {cells} |")
        return "\n".join(lines)


@contextlib.contextmanager
def step_timers() -> Iterator[StepTimers]:
    """Wrap the engine's parts with timers for the duration of the block; restores them."""
    timers = StepTimers()
    execute = ModelRunner.execute

    def timed_execute(runner: ModelRunner, scheduled: Sequence[ScheduledRequest]) -> Any:
        decode = all(s.is_decode for s in scheduled)
        timers.current = Step.DECODE if decode else Step.MIXED
        timers.steps[timers.current] += 1
        return timers.timed("execute", execute)(runner, scheduled)

    patches: list[tuple[object, str, Any]] = [
        (ModelRunner, "execute", timed_execute),
        (PackedLinear, "forward", timers.timed("linears", PackedLinear.forward)),
        (attention, "_decode", timers.timed("decode attention", attention._decode)),
        (attention, "_sdpa", timers.timed("prefill SDPA", attention._sdpa)),
        (
            attention.PagedKVCache,
            "_gather_compiled",
            timers.timed("8-bit gathers", attention.PagedKVCache._gather_compiled),
        ),
        (
            attention.PagedKVCache,
            "write",
            timers.timed("K/V writes", attention.PagedKVCache.write),
        ),
    ]
    with patched(patches):
        yield timers


# What --device cuda profiles and counts as device work (module-level: a CPU test stands the
# host's ops in for the kernels).
GPU_ACTIVITIES = (ProfilerActivity.CPU, ProfilerActivity.CUDA)
GPU_DEVICE = DeviceType.CUDA
WARMUP_PROMPTS = 8
WARMUP_TOKENS = 4


def warm_up(llm: LLM, model_dir: Path, args: argparse.Namespace) -> None:
    """Generate a few tokens for ``WARMUP_PROMPTS`` prompts drawn like the workload's, so that
    kernels compiled at first use (Triton's prefill on a GPU) compile outside the profile.

    The prompts come from the next seed: the prefix cache then holds none of the profiled ones.
    """
    warmup = random_token_workload(
        model_dir,
        min(WARMUP_PROMPTS, args.num_prompts),
        args.min_prompt_tokens,
        args.max_prompt_tokens,
        WARMUP_TOKENS,
        args.seed + 1,
    )
    params = SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate(warmup.prompt_token_ids, params)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.profile_engine", description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the engine runs; cuda adds the profiler's GPU-busy/host report",
    )
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--cpu-isa", choices=ISA_CHOICES, default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument(
        "--num-speculative-tokens", type=int, help="draft tokens per step (default: the engine's)"
    )
    p.add_argument(
        "--load-format",
        choices=("auto", "dummy"),
        default="auto",
        help="the engine's --load-format (dummy: random weights from config.json alone)",
    )
    add_workload_flags(p)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    workload = workload_from_args(model_dir, args)
    speculative = {}
    if args.num_speculative_tokens is not None:
        speculative["num_speculative_tokens"] = args.num_speculative_tokens
    llm = LLM(
        model=str(model_dir),
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        cpu_isa=args.cpu_isa,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        load_format=args.load_format,
        **speculative,
    )
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    profiler = None
    if args.device == "cuda":
        warm_up(llm, model_dir, args)
        profiler = torch.profiler.profile(activities=list(GPU_ACTIVITIES))
    with (
        step_timers() as timers,
        marked_steps() as shapes,
        worked_steps() as worked,
        profiler or contextlib.nullcontext(),
    ):
        start_s = time.perf_counter()
        for _ in llm.generate_stream(workload.prompt_token_ids, params):
            pass
        wall_s = time.perf_counter() - start_s
    engine = llm.engine
    print(
        f"{args.model} on {engine.device}: {engine.kernels.describe()}, KV cache "
        f"{engine.kv_cache_spec.dtype}, {torch.get_num_threads()} threads; "
        f"{workload.num_prompts} prompts, {args.output_tokens} output tokens each; "
        f"generation wall {wall_s:.2f} s\n"
    )
    if profiler is not None:
        print("Host-side time of each part (the kernels run asynchronously):\n")
    print(timers.table())
    print("\nEach kind of step against its floor (``step_floor``):\n")
    print(floor_table(worked, measure_rates(engine)))
    if profiler is not None:
        print("\nGPU-busy and host time per step (torch.profiler):\n")
        floor = decode_floor(llm) if engine.device.type == "cuda" else None
        print(gpu_report(profiler.events(), shapes, GPU_DEVICE, floor))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
