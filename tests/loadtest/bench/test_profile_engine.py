"""The engine profiler: its timers see every step and every part, add up, and come off again;
the GPU report's interval arithmetic agrees with a brute-force time grid, and its profiler
pipeline runs on CPU with the host's ops standing in for the kernels."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

from engine.batch_runner import BatchRunner
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.model import attention
from engine.model.packed_linear import PackedLinear
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from loadtest.bench import profile_engine
from loadtest.bench.profile_engine import PARTS, step_timers
from loadtest.bench.step_profile import (
    STEP_RANGE,
    DecodeFloor,
    DeviceOp,
    Interval,
    Step,
    StepShape,
    StepTime,
    busy_table,
    busy_within,
    classify_step,
    decode_context_tokens,
    floor_table,
    gpu_report,
    marked_steps,
    profiled_ranges,
    step_times,
    top_kernels_table,
)


def test_timers_split_steps_and_parts_and_restore_the_engine(tiny_llama_dir):
    originals = (ModelRunner.execute, PackedLinear.forward, attention._decode, attention._sdpa)
    llm = LLM(model=str(tiny_llama_dir), kv_cache_dtype="int8", max_num_batched_tokens=64)
    prompts = [[5 + i, 17, 99, 3] * 10 for i in range(3)]  # 40 tokens each: one chunk per step
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with step_timers() as timers:
        outputs = list(llm.generate_stream(prompts, params))
    assert (
        ModelRunner.execute,
        PackedLinear.forward,
        attention._decode,
        attention._sdpa,
    ) == originals
    finished = [o for o in outputs if o.finished]
    assert len(finished) == 3 and all(len(o.token_ids) == 4 for o in finished)
    assert timers.steps[Step.MIXED] >= 2 and timers.steps[Step.DECODE] >= 1
    for kind in Step:
        parts = sum(timers.seconds[(kind, part)] for part in PARTS)
        assert 0 < parts <= timers.seconds[(kind, "execute")]
    assert timers.seconds[(Step.DECODE, "decode attention")] > 0
    assert timers.seconds[(Step.MIXED, "K/V writes")] > 0
    assert timers.seconds[(Step.DECODE, "prefill SDPA")] == 0


def test_main_prints_one_row_per_kind_of_step(capsys, tiny_llama_dir):
    argv = ["--model", str(tiny_llama_dir), "--num-prompts", "3", "--min-prompt-tokens", "8"]
    argv += ["--max-prompt-tokens", "20", "--output-tokens", "3", "--threads", "1"]
    assert profile_engine.main([*argv, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    # The parts' table and the floors' table (step_floor), each a row per kind of step.
    assert out.count("| decode | 2 |") == 2 and out.count("| mixed | 1 |") == 2
    assert "| all | 3 |" in out and "GB/s" in out
    assert f"{torch.get_num_threads()} threads" in out and " on cpu: " in out
    assert "GPU-busy" not in out  # the profiler's report is CUDA's only


def _grid_busy(window: Interval, intervals: list[Interval], cell: float = 1 / 16) -> float:
    """Brute force: the cells of a fine time grid inside ``window`` whose midpoint any interval
    covers (exact when every endpoint is a multiple of ``cell``)."""
    start, end = window
    covered = 0.0
    for k in range(round((end - start) / cell)):
        mid = start + (k + 0.5) * cell
        if any(s <= mid < e for s, e in intervals):
            covered += cell
    return covered


BUSY_CASES: dict[str, tuple[list[Interval], list[Interval]]] = {
    "overlapping": ([(0, 10)], [(1, 4), (3, 6), (5.5, 7)]),
    "nested": ([(0, 10)], [(1, 9), (2, 3), (4, 8.5), (4, 5)]),
    "crossing both edges": ([(2, 8)], [(0, 3), (7.5, 12), (-5, -1), (9, 11)]),
    "spanning the window": ([(2, 8)], [(0, 20), (3, 4)]),
    "touching": ([(0, 10)], [(1, 2), (2, 3), (3, 4.25)]),
    "no intervals": ([(0, 10), (20, 30)], []),
    "empty and reversed intervals": ([(0, 10)], [(3, 3), (6, 5), (1, 2)]),
    "reversed and empty windows": ([(8, 2), (5, 5)], [(0, 10)]),
    "several windows": (
        [(0, 4), (4, 9), (9.5, 12), (12, 30)],
        [(3, 5), (3.5, 4.5), (8, 10), (11, 13.75), (20, 21), (20.5, 25)],
    ),
    "windows overlapping each other": ([(0, 10), (5, 15), (6, 7)], [(4, 6.5), (9, 12)]),
}


@pytest.mark.parametrize("case", BUSY_CASES)
def test_busy_within_matches_a_time_grid(case):
    windows, intervals = BUSY_CASES[case]
    busy = busy_within(windows, intervals)
    assert busy == pytest.approx([_grid_busy(w, intervals) for w in windows], abs=1e-9)


def test_busy_within_matches_a_time_grid_on_random_intervals():
    rng = random.Random(0)
    intervals = []
    for _ in range(150):
        start = rng.randrange(0, 400) / 4
        intervals.append((start, start + rng.randrange(0, 40) / 4))
    windows = []
    for _ in range(25):
        start = rng.randrange(-20, 420) / 4
        windows.append((start, start + rng.randrange(0, 120) / 4))
    expected = [_grid_busy(w, intervals, cell=1 / 8) for w in windows]
    assert busy_within(windows, intervals) == pytest.approx(expected, abs=1e-9)


def test_steps_are_decode_only_when_every_item_is_a_decode():
    assert classify_step([(True, 1), (True, 3), (True, 1)]) == StepShape(Step.DECODE, 5)
    assert classify_step([(True, 1), (False, 40)]) == StepShape(Step.MIXED, 0)
    assert classify_step([(False, 7)]) == StepShape(Step.MIXED, 0)


def _event(name, device_type, start, end, *, annotation=False, activity_type=None):
    """A stand-in for a profiler ``FunctionEvent`` (the attributes the extraction reads)."""
    return SimpleNamespace(
        name=name,
        device_type=device_type,
        time_range=SimpleNamespace(start=start, end=end),
        is_user_annotation=annotation,
        activity_type=activity_type,
    )


def test_extraction_keeps_step_ranges_and_device_work_only():
    events = [
        _event(f"{STEP_RANGE}0", DeviceType.CPU, 0.0, 100.0, annotation=True),
        # record_function's copy on the GPU timeline, spanning the kernels queued inside it
        _event(f"{STEP_RANGE}0", DeviceType.CUDA, 10.0, 90.0, annotation=True),
        _event("CompiledFunction", DeviceType.CUDA, 10.0, 60.0, annotation=True),
        _event("gemm_kernel", DeviceType.CUDA, 10.0, 40.0, activity_type="kernel"),
        _event("Memcpy DtoH (Device -> Pinned)", DeviceType.CUDA, 85.0, 90.0),
        _event("Stream Sync", DeviceType.CUDA, 40.0, 85.0, activity_type="cuda_sync"),
        _event("aten::mm", DeviceType.CPU, 5.0, 12.0),
        _event("cudaLaunchKernel", DeviceType.CPU, 6.0, 8.0),
        _event(f"{STEP_RANGE}1", DeviceType.CPU, 120.0, 150.0, annotation=True),
    ]
    ranges = profiled_ranges(events)
    assert ranges.steps == {0: (0.0, 100.0), 1: (120.0, 150.0)}
    assert ranges.device_ops == [
        DeviceOp("gemm_kernel", 10.0, 40.0),
        DeviceOp("Memcpy DtoH (Device -> Pinned)", 85.0, 90.0),
    ]


def test_step_times_and_tables_add_up():
    shapes = [
        StepShape(Step.MIXED, 0),
        None,  # ran no batch: left out
        StepShape(Step.DECODE, 3),
        StepShape(Step.DECODE, 4),
        StepShape(Step.DECODE, 4),
        StepShape(Step.DECODE, 4),
    ]
    ranges = {0: (0.0, 1000.0), 1: (1000.0, 1010.0), 2: (1100.0, 1200.0)}
    ranges |= {3: (1200.0, 1300.0), 4: (1300.0, 1400.0), 5: (1400.0, 1600.0)}
    ops = [DeviceOp("a", 100.0, 700.0), DeviceOp("b", 500.0, 800.0), DeviceOp("a", 1005.0, 1008.0)]
    ops += [DeviceOp("b", 1150.0, 1160.0), DeviceOp("a", 1190.0, 1250.0)]
    ops += [DeviceOp("b", 1300.0, 1340.0), DeviceOp("b", 1400.0, 1500.0)]
    steps = step_times(shapes, ranges, ops)
    assert [s.shape for s in steps] == [shapes[0], *shapes[2:]]
    assert [s.wall_us for s in steps] == [1000.0, 100.0, 100.0, 100.0, 200.0]
    expected_busy = busy_within(
        [ranges[i] for i in (0, 2, 3, 4, 5)], [(o.start_us, o.end_us) for o in ops]
    )
    assert [s.busy_us for s in steps] == expected_busy

    table = busy_table(steps)
    decode_wall = 500.0
    decode_busy = sum(expected_busy[1:])
    assert (
        f"| decode | 4 | {decode_wall / 1e6:.3f} | {decode_busy / 1e6:.3f} | "
        f"{(decode_wall - decode_busy) / 1e6:.3f} | {100 * decode_busy / decode_wall:.1f} |"
    ) in table
    assert f"| mixed | 1 | 0.001 | {expected_busy[0] / 1e6:.3f} |" in table
    # batch 4: walls 100, 100, 200 and busy times 50, 40, 100 (steps 3, 4, 5)
    assert f"| decode step at batch 4 | 3 | {100 / 1e3:.3f} | {50 / 1e3:.3f} |" in table

    kernels = top_kernels_table(ops, limit=1)
    assert "| a | 3 | 0.663 |" in kernels and "| b |" not in kernels


def test_kernel_names_are_cut_to_60_characters():
    long_name = "void flash_fwd_kernel<" + "x" * 100 + ">"
    table = top_kernels_table([DeviceOp(long_name, 0.0, 2000.0)])
    assert f"| {long_name[:60]} | 1 | 2.000 |" in table


def test_busy_table_without_steps_has_empty_rows():
    table = busy_table([])
    assert "| decode | 0 | 0.000 | 0.000 | 0.000 | - |" in table and "batch" not in table


def test_marked_steps_range_every_step_under_the_profiler(tiny_llama_dir):
    """The CUDA report's pipeline on CPU: the host's ops stand in for the device's kernels."""
    originals = (LLMEngine.step, BatchRunner.run)
    llm = LLM(model=str(tiny_llama_dir), max_num_batched_tokens=64)
    prompts = [[5 + i, 17, 99, 3] * 10 for i in range(3)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with (
        marked_steps() as shapes,
        torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof,
    ):
        list(llm.generate_stream(prompts, params))
    assert (LLMEngine.step, BatchRunner.run) == originals
    assert all(shape is not None for shape in shapes)
    assert shapes[0] == StepShape(Step.MIXED, 0)
    decodes = [shape for shape in shapes if shape is not None and shape.kind is Step.DECODE]
    assert decodes
    # Every decode row sees at least its 40-token prompt and the token before it.
    assert all(shape.context_tokens >= 41 * shape.decode_rows for shape in decodes)
    events = prof.events()
    ranges = profiled_ranges(events, DeviceType.CPU)
    assert sorted(ranges.steps) == list(range(len(shapes)))
    windows = [ranges.steps[i] for i in range(len(shapes))]
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(windows))
    assert all(op.name != f"{STEP_RANGE}0" for op in ranges.device_ops)
    steps = step_times(shapes, ranges.steps, ranges.device_ops)
    assert len(steps) == len(shapes)
    assert all(0 < s.busy_us <= s.wall_us for s in steps)
    report = gpu_report(events, shapes, DeviceType.CPU)
    num_decodes = sum(shape is not None and shape.kind is Step.DECODE for shape in shapes)
    assert (
        f"| decode | {num_decodes} |" in report
        and f"| mixed | {len(shapes) - num_decodes} |" in report
    )
    assert "| decode step at batch " in report and "| aten::" in report


def test_main_on_cuda_prints_the_gpu_report(capsys, monkeypatch, tiny_llama_dir):
    """``--device cuda``'s wiring (warm-up, profiler, report) run on CPU: the engine is put on
    the CPU and the host's ops stand in for the kernels."""
    monkeypatch.setattr(
        profile_engine, "LLM", lambda model, **kwargs: LLM(model, **{**kwargs, "device": "cpu"})
    )
    monkeypatch.setattr(profile_engine, "GPU_ACTIVITIES", (ProfilerActivity.CPU,))
    monkeypatch.setattr(profile_engine, "GPU_DEVICE", DeviceType.CPU)
    argv = ["--model", str(tiny_llama_dir), "--num-prompts", "3", "--min-prompt-tokens", "8"]
    argv += ["--max-prompt-tokens", "20", "--output-tokens", "3", "--threads", "1"]
    assert profile_engine.main([*argv, "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert out.count("| decode | 2 |") == 3 and out.count("| mixed | 1 |") == 3
    assert "| decode step at batch 3 | 2 |" in out and "| aten::" in out


def test_decode_context_tokens_sum_what_each_row_sees():
    # A plain decode after 10 computed tokens sees 11; one with 2 drafts after 5: 6, 7, 8.
    items = [(10, 1), (5, 3)]
    brute = sum(computed + j + 1 for computed, n in items for j in range(n))
    assert decode_context_tokens(items) == brute == 11 + 21


def test_floor_table_compares_full_batch_steps_with_their_bytes():
    floor = DecodeFloor(weight_bytes=2_000_000, kv_bytes_per_token=1000, bandwidth_bytes_per_s=1e9)
    steps = [
        StepTime(StepShape(Step.MIXED, 0), 9000.0, 100.0),
        StepTime(StepShape(Step.DECODE, 2, 1000), 6000.0, 1000.0),  # floor 3 ms: 2.0x
        StepTime(StepShape(Step.DECODE, 2, 2000), 8000.0, 1000.0),  # floor 4 ms: 2.0x
        StepTime(StepShape(Step.DECODE, 1, 10), 1.0, 1.0),  # not the full batch
    ]
    assert floor.floor_us(1000) == 3000.0
    table = floor_table(steps, floor)
    assert "| decode step at batch 2 | 7.000 | 3.500 | 2.00 |" in table
