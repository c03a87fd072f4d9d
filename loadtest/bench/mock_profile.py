"""Fit ``--engine mock``'s step profile to the native engine's steps.

``python -m loadtest.bench.mock_profile [--model smollm2-135m] [--dtype auto] [--threads 2]``

Runs the native engine in this process over batches of every kind a worker sees: prompts of
64 to 1,024 tokens prefilled alone and together, and 1 to 32 sequences decoding at contexts up
to 1,100 tokens (greedy, ``ignore_eos``, no drafts). Each step's model time (the executor's
``run``: what the simulated executor replaces; the engine's own bookkeeping runs in both) is
recorded with the step's shape as ``StepProfile`` prices it: prompt tokens computed, sequences
decoded, KV blocks attention reads. A non-negative least-squares fit gives the four costs; the
report shows the fit's relative error per kind of step and the ``--mock-*`` flags to pass.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from engine.config import EngineConfig
from engine.kv_cache_manager import cdiv
from engine.llm_engine import LLMEngine
from engine.sampler import SamplerOutput
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledRequest
from engine.simulated import StepProfile
from loadtest.bench.engine import resolve_model_dir

_PROMPT_LENS = (64, 128, 256, 512, 1024)
_BATCHES = (1, 4, 16, 32)
_DECODE_TOKENS = 48


@dataclass(frozen=True, slots=True)
class TimedStep:
    """One step's shape (as ``StepProfile`` prices it) and its model time."""

    prefill_tokens: int
    decode_seqs: int
    blocks_read: int
    seconds: float

    @property
    def kind(self) -> str:
        if self.prefill_tokens and self.decode_seqs:
            return "mixed"
        return "prefill" if self.prefill_tokens else "decode"


def record_steps(engine: LLMEngine, block_size: int) -> list[TimedStep]:
    """Run the workload (see the module) on ``engine``; every step's shape and model time."""
    steps: list[TimedStep] = []
    run = engine.executor.run

    def timed(scheduled: list[ScheduledRequest]) -> tuple[SamplerOutput, dict[str, str]]:
        start_s = time.perf_counter()
        result = run(scheduled)
        steps.append(
            TimedStep(
                sum(s.num_new_tokens for s in scheduled if not s.is_decode),
                sum(s.is_decode for s in scheduled),
                sum(
                    cdiv(s.request.num_computed_tokens + s.num_new_tokens, block_size)
                    for s in scheduled
                ),
                time.perf_counter() - start_s,
            )
        )
        return result

    engine.executor.run = timed  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=_DECODE_TOKENS, ignore_eos=True)
    rng = np.random.default_rng(0)
    num = 0
    for batch in _BATCHES:
        for prompt_len in _PROMPT_LENS:
            for _ in range(batch):
                prompt = rng.integers(10, engine.vocab_size - 10, prompt_len).tolist()
                engine.add_request(f"r{num}", prompt, params)
                num += 1
            while engine.has_unfinished_requests():
                engine.step()
    return steps


def fit(steps: Sequence[TimedStep]) -> StepProfile:
    """The non-negative least-squares profile of ``steps`` (relative errors weigh equally:
    each row is scaled by its step's time)."""
    features = np.array(
        [[1.0, s.prefill_tokens, s.decode_seqs, s.blocks_read] for s in steps], dtype=np.float64
    )
    seconds = np.array([s.seconds for s in steps])
    weights = 1.0 / seconds
    coefficients, _ = nnls(features * weights[:, None], seconds * weights)
    overhead_s, prefill_s, decode_s, kv_s = (float(c) for c in coefficients)
    return StepProfile(overhead_s, prefill_s, decode_s, kv_s)


def _predicted_s(profile: StepProfile, step: TimedStep) -> float:
    return (
        profile.overhead_s
        + step.prefill_tokens * profile.prefill_s_per_token
        + step.decode_seqs * profile.decode_s_per_seq
        + step.blocks_read * profile.kv_read_s_per_block
    )


def report(profile: StepProfile, steps: Sequence[TimedStep], label: str) -> str:
    """The fit, its error per kind of step, and the flags."""
    lines = [
        f"### --engine mock's profile, fitted on {label}",
        "",
        f"{len(steps)} steps. Per step {profile.overhead_s * 1e3:.3f} ms; per prompt token "
        f"{profile.prefill_s_per_token * 1e6:.2f} us; per decoded sequence "
        f"{profile.decode_s_per_seq * 1e6:.1f} us; per KV block read "
        f"{profile.kv_read_s_per_block * 1e6:.2f} us.",
        "",
        "| steps | count | median ms | median relative error | p90 relative error |",
        "|---|---:|---:|---:|---:|",
    ]
    for kind in ("prefill", "decode", "mixed"):
        chosen = [s for s in steps if s.kind == kind]
        if not chosen:
            continue
        errors = [abs(_predicted_s(profile, s) - s.seconds) / s.seconds for s in chosen]
        p90 = statistics.quantiles(errors, n=10)[-1] if len(errors) > 1 else errors[0]
        lines.append(
            f"| {kind} | {len(chosen)} | {statistics.median(s.seconds for s in chosen) * 1e3:.2f} "
            f"| {statistics.median(errors):.1%} | {p90:.1%} |"
        )
    lines += [
        "",
        f"--engine mock --mock-step-ms {profile.overhead_s * 1e3:.3f} "
        f"--mock-prefill-us-per-token {profile.prefill_s_per_token * 1e6:.2f} "
        f"--mock-decode-us-per-seq {profile.decode_s_per_seq * 1e6:.1f} "
        f"--mock-kv-read-us-per-block {profile.kv_read_s_per_block * 1e6:.2f}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench.mock_profile", description=__doc__
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = parser.parse_args(argv)
    config = EngineConfig(
        model=str(resolve_model_dir(args.model)),
        dtype=args.dtype,
        num_threads=args.threads,
        num_speculative_tokens=0,
        num_kv_blocks=4096,
    )
    engine = LLMEngine(config)
    steps = record_steps(engine, config.block_size)
    label = (
        f"{args.model} ({engine.dtype}, {engine.info.kernels}, CPU level "
        f"{engine.info.cpu_isa or 'n/a'})"
    )
    print(report(fit(steps), steps, label))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
