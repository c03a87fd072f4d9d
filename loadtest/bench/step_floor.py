"""How far each kind of engine step is from what the host allows: the step's floor.

A step must at least read every weight once (the input embedding table excepted: a step reads
only its rows) and the KV its decode rows attend to, at the read bandwidth this host measures
now, and compute its linears (every new token through the decoder's, each sampled row through
the LM head) at the rate the engine's own largest linear runs at now. Its floor is the larger of
the two; ``floor_table`` sets the run's step time against it, per kind of step, so that "how
far from the limit" is one number per kind of step and host. Measured rates, not datasheets:
compare runs on one host only.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.batch_runner import BatchRunner
from engine.llm_engine import LLMEngine
from engine.model.packed_linear import PackedLinear
from engine.outputs import RequestOutput
from engine.sampler import SamplerOutput
from engine.scheduler_output import ScheduledRequest
from loadtest.bench.step_profile import Step, patched, shape_of

# Rows of the GEMM that measures the linears' rate: a typical prefill chunk.
GEMM_ROWS = 512
_REPEATS = 5


@dataclass(frozen=True, slots=True)
class StepWork:
    """What one step computed: its kind, its new tokens (drafts included), its sampled rows,
    and the cached tokens its decode rows read (0 for a mixed step)."""

    kind: Step
    num_tokens: int
    num_sample_rows: int
    context_tokens: int


@dataclass(frozen=True, slots=True)
class HostRates:
    """What bounds a step on this host: bytes it must read per step and per context token, the
    FLOPs per token of the decoder's linears and per sampled row of the LM head, and the read
    bandwidth and linear FLOP rate measured now."""

    weight_bytes: int
    kv_bytes_per_token: int
    decoder_flops_per_token: int
    lm_head_flops_per_row: int
    read_bytes_per_s: float
    linear_flops_per_s: float

    def read_floor_s(self, work: StepWork) -> float:
        return (self.weight_bytes + work.context_tokens * self.kv_bytes_per_token) / (
            self.read_bytes_per_s
        )

    def compute_floor_s(self, work: StepWork) -> float:
        flops = (
            work.num_tokens * self.decoder_flops_per_token
            + work.num_sample_rows * self.lm_head_flops_per_row
        )
        return flops / self.linear_flops_per_s

    def floor_s(self, work: StepWork) -> float:
        return max(self.read_floor_s(work), self.compute_floor_s(work))


def floor_table(steps: Sequence[tuple[StepWork, float]], rates: HostRates) -> str:
    """Markdown: per kind of step (and all), the steps' wall seconds (``steps``: each step's
    work and wall seconds) against their read, compute and overall floors."""
    lines = [
        f"weights {rates.weight_bytes / 1e9:.3f} GB read per step, KV "
        f"{rates.kv_bytes_per_token} B per context token; measured: read "
        f"{rates.read_bytes_per_s / 1e9:.1f} GB/s, linears "
        f"{rates.linear_flops_per_s / 1e12:.2f} TFLOP/s",
        "",
        "| steps | count | wall (s) | read floor (s) | compute floor (s) | floor (s) "
        "| wall / floor |",
        "|---|---|---|---|---|---|---|",
    ]
    kinds: list[tuple[str, list[tuple[StepWork, float]]]] = [
        (kind.value, [s for s in steps if s[0].kind is kind]) for kind in Step
    ]
    for name, chosen in [*kinds, ("all", list(steps))]:
        if not chosen:
            continue
        wall = sum(w for _, w in chosen)
        read = sum(rates.read_floor_s(work) for work, _ in chosen)
        compute = sum(rates.compute_floor_s(work) for work, _ in chosen)
        floor = sum(rates.floor_s(work) for work, _ in chosen)
        lines.append(
            f"| {name} | {len(chosen)} | {wall:.3f} | {read:.3f} | {compute:.3f} | {floor:.3f} "
            f"| {wall / floor:.2f} |"
        )
    return "\n".join(lines)


@contextlib.contextmanager
def worked_steps() -> Iterator[list[tuple[StepWork, float]]]:
    """Time each ``LLMEngine.step`` that runs a batch and note its work, for the duration of
    the block; restores the engine. Yields ``(work, wall seconds)`` per such step, in order."""
    steps: list[tuple[StepWork, float]] = []
    pending: list[StepWork] = []
    step = LLMEngine.step
    run = BatchRunner.run

    def timed_step(engine: LLMEngine) -> list[RequestOutput]:
        start_s = time.perf_counter()
        outputs = step(engine)
        if pending:
            steps.append((pending.pop(), time.perf_counter() - start_s))
        return outputs

    def noted_run(
        runner: BatchRunner, scheduled: list[ScheduledRequest]
    ) -> tuple[SamplerOutput, dict[str, str]]:
        shape = shape_of(scheduled)
        num_tokens = sum(s.num_new_tokens for s in scheduled)
        num_sample_rows = sum(s.num_sample_rows for s in scheduled)
        pending.append(StepWork(shape.kind, num_tokens, num_sample_rows, shape.context_tokens))
        return run(runner, scheduled)

    with patched([(LLMEngine, "step", timed_step), (BatchRunner, "run", noted_run)]):
        yield steps


def measure_rates(engine: LLMEngine) -> HostRates:
    """``engine``'s ``HostRates``, its read bandwidth and linear rate measured now on its device
    with the threads it runs on (seconds: a 256 MiB read, ``GEMM_ROWS`` rows through its
    largest decoder linear)."""
    runner = engine.runner
    assert runner is not None, "the native engine's model runs in this process"
    model = runner.model
    dtype = getattr(torch, engine.dtype)
    linears = [m for m in model.model.layers.modules() if isinstance(m, (nn.Linear, PackedLinear))]
    decoder_params = sum(m.in_features * m.out_features for m in linears)
    lm_head_params = model.lm_head.weight.numel()
    spec = engine.kv_cache_spec
    largest = max(linears, key=lambda m: m.in_features * m.out_features)
    x = torch.randn(GEMM_ROWS, largest.in_features, dtype=dtype, device=engine.device)
    gemm_s = _best_of(lambda: largest(x), engine.device)
    data = torch.ones(2**26, dtype=torch.float32, device=engine.device)
    read_s = _best_of(data.sum, engine.device)
    return HostRates(
        weight_bytes=(decoder_params + lm_head_params) * dtype.itemsize,
        kv_bytes_per_token=spec.block_bytes // spec.block_size,
        decoder_flops_per_token=2 * decoder_params,
        lm_head_flops_per_row=2 * lm_head_params,
        read_bytes_per_s=data.numel() * data.element_size() / read_s,
        linear_flops_per_s=2 * GEMM_ROWS * largest.in_features * largest.out_features / gemm_s,
    )


def _best_of(fn: Callable[[], object], device: torch.device) -> float:
    """The fastest of a few timed calls of ``fn`` (after one untimed), in seconds."""
    best_s = float("inf")
    with torch.inference_mode():
        fn()
        for _ in range(_REPEATS):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start_s = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best_s = min(best_s, time.perf_counter() - start_s)
    return best_s
