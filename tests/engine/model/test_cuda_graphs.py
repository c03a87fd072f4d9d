"""The bookkeeping of captured decode steps (``cuda_graphs``), on CPU with the eager stand-in
for capture: bucket sizes, padding rows, one static buffer set reused by every bucket."""

from __future__ import annotations

import torch

from engine.model.cuda_graphs import (
    MAX_CAPTURE_SIZE,
    DecodeBuffers,
    DecodeGraphs,
    capture_eagerly,
    capture_sizes,
)


def test_capture_sizes_follow_vllm_and_end_at_the_limit():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(10_000)
    assert sizes[-1] == MAX_CAPTURE_SIZE and sizes == sorted(set(sizes))
    assert all(s % 8 == 0 for s in sizes[3:])


class RecordingForward:
    """A forward pass over the buffers: each row's output is a function of its inputs, and
    every call records the rows it saw."""

    def __init__(self, buffers: DecodeBuffers) -> None:
        self.buffers = buffers
        self.calls: list[int] = []

    def __call__(self, size: int) -> torch.Tensor:
        self.calls.append(size)
        b = self.buffers
        return torch.stack(
            [
                b.input_ids[:size].float(),
                b.positions[:size].float(),
                b.slot_rows[:size, 0].float(),
                b.context_lens[:size].float(),
                b.block_tables[:size, 0].float(),
            ],
            dim=1,
        )


def make_graphs(max_rows: int = 16) -> tuple[DecodeGraphs, RecordingForward]:
    buffers = DecodeBuffers.allocate(
        max_rows, num_kv_heads=2, max_blocks=4, device=torch.device("cpu")
    )
    forward = RecordingForward(buffers)
    return DecodeGraphs(buffers, capture_sizes(max_rows), forward, capture_eagerly), forward


def fill(buffers: DecodeBuffers, num_rows: int, base: int) -> None:
    host = buffers.host
    for row in range(num_rows):
        host["input_ids"][row] = base + row
        host["positions"][row] = 10 + row
        host["slot_rows"][row] = [100 + row, 116 + row]
        host["context_lens"][row] = 11 + row
        host["block_tables"][row, :2] = [7, row]


def test_capture_runs_every_bucket_largest_first():
    graphs, forward = make_graphs(16)
    assert forward.calls == [16, 8, 4, 2, 1]
    assert graphs.bucket(1) == 1 and graphs.bucket(3) == 4 and graphs.bucket(9) == 16
    assert graphs.bucket(17) is None


def test_a_step_replays_the_smallest_bucket_and_pads_it():
    graphs, forward = make_graphs(16)
    forward.calls.clear()
    fill(graphs.buffers, 5, base=40)
    out = graphs.run(5)
    assert forward.calls == [8]
    assert out.shape == (5, 5)
    assert out[:, 0].tolist() == [40, 41, 42, 43, 44]
    assert out[:, 3].tolist() == [11, 12, 13, 14, 15]
    # Rows 5-7 of the replayed bucket are padding: no KV slot, no context.
    buffers = graphs.buffers
    assert (buffers.slot_rows[5:8] == -1).all()
    assert (buffers.context_lens[5:8] == 0).all()


def test_smaller_steps_after_larger_ones_see_no_stale_rows():
    graphs, _ = make_graphs(16)
    fill(graphs.buffers, 12, base=0)
    graphs.run(12)
    fill(graphs.buffers, 3, base=200)
    out = graphs.run(3)
    assert out[:, 0].tolist() == [200, 201, 202]
    assert (graphs.buffers.context_lens[3:4] == 0).all()  # the bucket of 4's padding row
