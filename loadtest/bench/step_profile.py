"""GPU-busy and host time of each engine step, from a ``torch.profiler`` trace.

``marked_steps`` runs each ``LLMEngine.step`` inside a ``record_function`` range and notes its
batch's shape; ``gpu_report`` takes the trace's events: a step's wall time is its range, its
GPU-busy time the length of the union of the kernels and copies on the GPU timeline inside it
(a step ends by copying its sampled ids back, so its work finishes inside it), host time the
rest, when the GPU waited for the host. Decode steps at the largest batch seen get their own
medians and, with a ``DecodeFloor``, are set against the time to read their weights and KV
once. The pure functions take plain intervals, so the tests check them without a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import itertools
import statistics
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import DeviceType

from engine.batch_runner import BatchRunner
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampler import SamplerOutput
from engine.scheduler_output import ScheduledRequest


class Step(enum.Enum):
    """A step's kind: decode (one new token per request) or mixed (any prefill chunk)."""

    DECODE = "decode"
    MIXED = "mixed"


# A step's record_function range is this prefix and the step's index in the run.
STEP_RANGE = "splitserve.step#"
TOP_KERNELS = 10
_KERNEL_NAME_CHARS = 60
# Device-timeline events that are not work: record_function ranges (also caught by
# ``is_user_annotation``) and the waits traced when CUDA sync events are switched on.
_NOT_DEVICE_WORK = frozenset({"gpu_user_annotation", "cuda_sync"})

Interval = tuple[float, float]


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step's batch held: its kind and, for a decode step, its rows (new tokens of
    its requests, drafts included; 0 for a mixed step)."""

    kind: Step
    decode_rows: int
    # A decode step's cached tokens that its rows read, summed over rows (0 for a mixed step).
    context_tokens: int = 0


@dataclass(frozen=True, slots=True)
class DeviceOp:
    """One kernel, copy or memset on the device timeline (microseconds since the trace began)."""

    name: str
    start_us: float
    end_us: float


@dataclass(frozen=True, slots=True)
class ProfiledRanges:
    """What a profile holds for the GPU report: each marked step's wall range by step index,
    and the device ops."""

    steps: dict[int, Interval]
    device_ops: list[DeviceOp]


@dataclass(frozen=True, slots=True)
class StepTime:
    """One step's wall time and the part of it the device was busy (microseconds)."""

    shape: StepShape
    wall_us: float
    busy_us: float


def classify_step(items: Sequence[tuple[bool, int]]) -> StepShape:
    """The shape of a batch given each scheduled item's ``(is_decode, num_new_tokens)``: a
    decode step when every item is a decode, else mixed."""
    if all(is_decode for is_decode, _ in items):
        return StepShape(Step.DECODE, sum(num_new_tokens for _, num_new_tokens in items))
    return StepShape(Step.MIXED, 0)


def decode_context_tokens(items: Sequence[tuple[int, int]]) -> int:
    """The context tokens a decode step's rows attend to, given each item's
    ``(num_computed_tokens, num_new_tokens)``: row ``j`` of an item sees ``computed + j + 1``."""
    return sum(n * computed + n * (n + 1) // 2 for computed, n in items)


@dataclass(frozen=True, slots=True)
class DecodeFloor:
    """What a decode step must read at least: every weight once (the input embedding table
    excepted: a step reads only its rows) and each row's context from the KV cache, at the
    device's measured copy bandwidth."""

    weight_bytes: int
    kv_bytes_per_token: int
    bandwidth_bytes_per_s: float

    def floor_us(self, context_tokens: int) -> float:
        total = self.weight_bytes + context_tokens * self.kv_bytes_per_token
        return 1e6 * total / self.bandwidth_bytes_per_s


def floor_table(steps: Sequence[StepTime], floor: DecodeFloor) -> str:
    """Markdown: decode steps at the largest batch seen against the time to read what they
    must read once (``DecodeFloor``): medians of wall time, floor and their ratio."""
    decodes = [s for s in steps if s.shape.kind is Step.DECODE]
    if not decodes:
        return "no decode steps"
    rows = max(s.shape.decode_rows for s in decodes)
    full = [s for s in decodes if s.shape.decode_rows == rows]
    floors = [floor.floor_us(s.shape.context_tokens) for s in full]
    wall_us = [s.wall_us for s in full]
    ratios = [w / f for w, f in zip(wall_us, floors, strict=True)]
    gb = floor.weight_bytes / 1e9
    return "\n".join(
        [
            f"weights read per step {gb:.3f} GB, KV {floor.kv_bytes_per_token} B per context "
            f"token, measured bandwidth {floor.bandwidth_bytes_per_s / 1e12:.2f} TB/s",
            "",
            "| decode step at batch N | median wall (ms) | median floor (ms) | wall / floor |",
            "|---|---|---|---|",
            f"| decode step at batch {rows} | {statistics.median(wall_us) / 1e3:.3f} "
            f"| {statistics.median(floors) / 1e3:.3f} | {statistics.median(ratios):.2f} |",
        ]
    )


def decode_floor(llm: LLM) -> DecodeFloor:
    """The engine's ``DecodeFloor``, with the bandwidth measured now by copying 1 GiB on the
    engine's GPU (read and write counted)."""
    engine = llm.engine
    model = engine.runner.model
    params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    embedding = model.model.embed_tokens.weight
    if model.lm_head is not model.model.embed_tokens:
        params.pop(embedding.data_ptr())
    spec = engine.kv_cache_spec
    src = torch.empty(2**30, dtype=torch.uint8, device=engine.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    bandwidth = 10 * 2 * src.numel() / (start.elapsed_time(end) / 1e3)
    return DecodeFloor(sum(params.values()), spec.block_bytes // spec.block_size, bandwidth)


def busy_within(windows: Sequence[Interval], intervals: Iterable[Interval]) -> list[float]:
    """For each ``(start, end)`` window, the length of the union of ``intervals`` clipped to it.

    Intervals may overlap, nest or cross a window's edge; empty or reversed ones count for
    nothing, and so does a reversed window. O((n + m) log n) for n intervals and m windows:
    the intervals are merged into disjoint runs once, then each window is two binary searches
    on the runs' running length.
    """
    starts: list[float] = []
    ends: list[float] = []
    for start, end in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if ends and start <= ends[-1]:
            ends[-1] = max(ends[-1], end)
        else:
            starts.append(start)
            ends.append(end)
    # length_before[k]: the length of the first k runs.
    length_before = list(
        itertools.accumulate((e - s for s, e in zip(starts, ends, strict=True)), initial=0.0)
    )

    def covered_until(t: float) -> float:
        k = bisect_right(starts, t)
        if k == 0:
            return 0.0
        return length_before[k - 1] + min(ends[k - 1], t) - starts[k - 1]

    return [max(0.0, covered_until(end) - covered_until(start)) for start, end in windows]


def profiled_ranges(events: Iterable[Any], device: DeviceType = DeviceType.CUDA) -> ProfiledRanges:
    """The step ranges and device ops of ``torch.profiler`` ``FunctionEvent``s.

    Steps are the host-side ``record_function`` ranges named ``STEP_RANGE`` + index. Device ops
    are the events of ``device`` that are not user annotations or syncs: a ``record_function``
    range also shows on the GPU timeline, spanning the work queued inside it, and would count it
    twice.
    (``device=DeviceType.CPU`` takes the host's ops as stand-ins: for tests without a GPU.)
    """
    steps: dict[int, Interval] = {}
    ops: list[DeviceOp] = []
    for event in events:
        name = event.name
        span = event.time_range
        if event.device_type == DeviceType.CPU and name.startswith(STEP_RANGE):
            steps[int(name.removeprefix(STEP_RANGE))] = (span.start, span.end)
        elif (
            event.device_type == device
            and not getattr(event, "is_user_annotation", False)
            and str(getattr(event, "activity_type", "")).lower() not in _NOT_DEVICE_WORK
            and not name.startswith(STEP_RANGE)
        ):
            ops.append(DeviceOp(name, span.start, span.end))
    return ProfiledRanges(steps, ops)


def step_times(
    shapes: Sequence[StepShape | None],
    ranges: Mapping[int, Interval],
    device_ops: Sequence[DeviceOp],
) -> list[StepTime]:
    """Each step that ran a batch (its shape is known) and has a range, with its busy time."""
    picked = [
        (shape, ranges[i]) for i, shape in enumerate(shapes) if shape is not None and i in ranges
    ]
    busy = busy_within(
        [window for _, window in picked], [(o.start_us, o.end_us) for o in device_ops]
    )
    return [
        StepTime(shape, end - start, busy_us)
        for (shape, (start, end)), busy_us in zip(picked, busy, strict=True)
    ]


def busy_table(steps: Sequence[StepTime]) -> str:
    """Markdown: per step kind its count, wall, GPU-busy and host seconds and busy share; then
    the median decode step at the largest batch seen."""
    lines = [
        "| steps | count | wall (s) | GPU-busy (s) | host (s) | GPU-busy % |",
        "|---|---|---|---|---|---|",
    ]
    for kind in Step:
        of_kind = [s for s in steps if s.shape.kind is kind]
        wall_us = sum(s.wall_us for s in of_kind)
        busy_us = sum(s.busy_us for s in of_kind)
        share = f"{100 * busy_us / wall_us:.1f}" if wall_us > 0 else "-"
        lines.append(
            f"| {kind.value} | {len(of_kind)} | {wall_us / 1e6:.3f} | {busy_us / 1e6:.3f} | "
            f"{(wall_us - busy_us) / 1e6:.3f} | {share} |"
        )
    decodes = [s for s in steps if s.shape.kind is Step.DECODE]
    if decodes:
        rows = max(s.shape.decode_rows for s in decodes)
        full = [s for s in decodes if s.shape.decode_rows == rows]
        lines += [
            "",
            "| decode step at batch N | steps | median wall (ms) | median GPU-busy (ms) |",
            "|---|---|---|---|",
            f"| decode step at batch {rows} | {len(full)} | "
            f"{statistics.median(s.wall_us for s in full) / 1e3:.3f} | "
            f"{statistics.median(s.busy_us for s in full) / 1e3:.3f} |",
        ]
    return "\n".join(lines)


def top_kernels_table(device_ops: Sequence[DeviceOp], limit: int = TOP_KERNELS) -> str:
    """Markdown: the ``limit`` kernels / copies with the most device time, summed by name."""
    total_us: defaultdict[str, float] = defaultdict(float)
    count: defaultdict[str, int] = defaultdict(int)
    for op in device_ops:
        total_us[op.name] += op.end_us - op.start_us
        count[op.name] += 1
    lines = ["| kernel | count | total (ms) |", "|---|---|---|"]
    for name in sorted(total_us, key=lambda n: -total_us[n])[:limit]:
        shown = name[:_KERNEL_NAME_CHARS].replace("|", "/")
        lines.append(f"| {shown} | {count[name]} | {total_us[name] / 1e3:.3f} |")
    return "\n".join(lines)


def gpu_report(
    events: Iterable[Any],
    shapes: Sequence[StepShape | None],
    device: DeviceType = DeviceType.CUDA,
    floor: DecodeFloor | None = None,
) -> str:
    """The GPU-busy/host report of a profiled run whose steps ``marked_steps`` recorded, and
    with ``floor`` its decode steps against the time to read their bytes once."""
    ranges = profiled_ranges(events, device)
    spans = [(op.start_us, op.end_us) for op in ranges.device_ops]
    steps = step_times(shapes, ranges.steps, ranges.device_ops)
    if spans:
        everything = (min(s for s, _ in spans), max(e for _, e in spans))
        busy_s = busy_within([everything], spans)[0] / 1e6
    else:
        busy_s = 0.0
    in_steps_s = sum(s.busy_us for s in steps) / 1e6
    return "\n".join(
        [
            f"{len(ranges.device_ops)} device ops (kernels, copies) busy {busy_s:.3f} s, "
            f"{in_steps_s:.3f} s of it inside the {len(steps)} steps that ran a batch",
            "",
            busy_table(steps),
            "",
            f"Top {TOP_KERNELS} kernels by device time:",
            "",
            top_kernels_table(ranges.device_ops),
            *(["", floor_table(steps, floor)] if floor is not None else []),
        ]
    )


@contextlib.contextmanager
def marked_steps() -> Iterator[list[StepShape | None]]:
    """Run each ``LLMEngine.step`` inside a ``record_function`` range named ``STEP_RANGE`` + its
    index, for the duration of the block; restores the engine.

    Yields the shapes by step index, filled in as steps run (None: the step ran no batch).
    """
    shapes: list[StepShape | None] = []
    step = LLMEngine.step
    run = BatchRunner.run

    def marked_step(engine: LLMEngine) -> list[RequestOutput]:
        index = len(shapes)
        shapes.append(None)
        with torch.profiler.record_function(f"{STEP_RANGE}{index}"):
            return step(engine)

    def noted_run(
        runner: BatchRunner, scheduled: list[ScheduledRequest]
    ) -> tuple[SamplerOutput, dict[str, str]]:
        shapes[-1] = shape_of(scheduled)
        return run(runner, scheduled)

    with patched([(LLMEngine, "step", marked_step), (BatchRunner, "run", noted_run)]):
        yield shapes


def shape_of(scheduled: Sequence[ScheduledRequest]) -> StepShape:
    """The ``StepShape`` of a scheduled batch, before it runs."""
    shape = classify_step([(s.is_decode, s.num_new_tokens) for s in scheduled])
    if shape.kind is Step.DECODE:
        items = [(s.request.num_computed_tokens, s.num_new_tokens) for s in scheduled]
        shape = dataclasses.replace(shape, context_tokens=decode_context_tokens(items))
    return shape


@contextlib.contextmanager
def patched(patches: Sequence[tuple[object, str, Any]]) -> Iterator[None]:
    """Set each ``(owner, name, replacement)`` for the duration of the block; restores the
    originals in reverse order (nested patches of one name unwind correctly)."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
