"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step's launches (hundreds: every layer's matmuls, norms and kernels) cost the host
more than the GPU spends on them. A graph captured once per bucket replays the whole forward
pass in one call. Its inputs live in static buffers sized for the largest bucket; a step of
``n`` rows fills the first ``n`` and pads up to the bucket's size with rows that write no KV
(slot -1) and attend to nothing (context 0). The bucket sizes follow vLLM's (1, 2, 4, then
multiples of 8). Graphs are captured largest first into one memory pool; their outputs alias
it, so a step's output is read before the next replay.

``capture`` is a ``GraphCapture``: ``CudaGraphCapture`` on a GPU; on CPU the tests pass
``capture_eagerly``, which runs the forward pass at each replay into the same static output,
so that every piece of bookkeeping here runs without a GPU.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

logger = logging.getLogger(__name__)

# The largest bucket vLLM captures by default (max_cudagraph_capture_size).
MAX_CAPTURE_SIZE = 512


@dataclass(frozen=True, slots=True)
class CapturedStep:
    """``replay()`` recomputes ``output`` from the static input buffers."""

    replay: Callable[[], object]
    output: torch.Tensor


class GraphCapture(Protocol):
    """Turns a forward pass over static buffers into a replayable step."""

    def __call__(self, forward: Callable[[], torch.Tensor]) -> CapturedStep: ...


def capture_sizes(max_rows: int) -> list[int]:
    """Bucket sizes up to ``max_rows`` (capped at ``MAX_CAPTURE_SIZE``), ascending: 1, 2, 4,
    then multiples of 8, and ``max_rows`` itself when it falls between."""
    limit = min(max_rows, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s <= limit] + list(range(8, limit + 1, 8))
    if sizes[-1] != limit:
        sizes.append(limit)
    return sizes


def capture_eagerly(forward: Callable[[], torch.Tensor]) -> CapturedStep:
    """A stand-in for capture: each replay reruns ``forward`` into one static output."""
    output = forward()

    def replay() -> None:
        output.copy_(forward())

    return CapturedStep(replay, output)


class CudaGraphCapture:
    """Captures on the current CUDA device, every graph into one shared memory pool."""

    def __init__(self) -> None:
        self._pool = torch.cuda.graph_pool_handle()

    def __call__(self, forward: Callable[[], torch.Tensor]) -> CapturedStep:
        # Warm-up runs settle the allocator and the libraries' lazily made handles (and compile
        # any kernel variant not compiled yet) outside capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = forward()
        return CapturedStep(graph.replay, output)


@dataclass(slots=True)
class DecodeBuffers:
    """Static inputs of a captured decode step (device) and their host staging arrays.

    Row ``r`` is one decode token: its id, position, layer-0 key slot row per KV head (-1:
    write nothing), context length (0: attend to nothing) and block table (int32, padded
    past the context with whatever was there: the kernels read only the context's entries).
    """

    input_ids: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long
    slot_rows: torch.Tensor  # [N, KVH] long
    context_lens: torch.Tensor  # [N] int32
    block_tables: torch.Tensor  # [N, max_blocks] int32
    host_tensors: dict[str, torch.Tensor]  # the same, on the host (pinned on a GPU)
    host: dict[str, np.ndarray]  # numpy views of ``host_tensors``, which the step fills

    @classmethod
    def allocate(
        cls, max_rows: int, num_kv_heads: int, max_blocks: int, device: torch.device
    ) -> DecodeBuffers:
        """Zeroed buffers for ``max_rows`` rows; host arrays pinned on a GPU."""
        pin = device.type == "cuda"
        shapes = {
            "input_ids": ((max_rows,), torch.long),
            "positions": ((max_rows,), torch.long),
            "slot_rows": ((max_rows, num_kv_heads), torch.long),
            "context_lens": ((max_rows,), torch.int32),
            "block_tables": ((max_rows, max_blocks), torch.int32),
        }
        device_buffers = {
            name: torch.zeros(shape, dtype=dtype, device=device)
            for name, (shape, dtype) in shapes.items()
        }
        host = {
            name: torch.zeros(shape, dtype=dtype, pin_memory=pin)
            for name, (shape, dtype) in shapes.items()
        }
        views = {name: tensor.numpy() for name, tensor in host.items()}
        return cls(**device_buffers, host_tensors=host, host=views)

    def pad(self, num_rows: int, bucket: int) -> None:
        """Make host rows ``[num_rows, bucket)`` padding: no KV write, no context."""
        host = self.host
        host["input_ids"][num_rows:bucket] = 0
        host["positions"][num_rows:bucket] = 0
        host["slot_rows"][num_rows:bucket] = -1
        host["context_lens"][num_rows:bucket] = 0

    def upload(self, bucket: int) -> None:
        """Copy host rows ``[0, bucket)`` into the device buffers (asynchronously on a GPU:
        the host arrays are pinned and not written again before the step's output is read)."""
        for name, source in self.host_tensors.items():
            target: torch.Tensor = getattr(self, name)
            target[:bucket].copy_(source[:bucket], non_blocking=True)


class DecodeGraphs:
    """One captured decode step per bucket size; ``run`` replays the smallest that fits."""

    def __init__(
        self,
        buffers: DecodeBuffers,
        sizes: Sequence[int],
        forward: Callable[[int], torch.Tensor],
        capture: GraphCapture,
    ) -> None:
        """Capture ``forward(size)`` (the forward pass over the first ``size`` rows of
        ``buffers``) for every size, largest first; logs the time it took."""
        self.buffers = buffers
        self.sizes = sorted(sizes)
        start = time.perf_counter()
        buffers.pad(0, self.sizes[-1])
        buffers.upload(self.sizes[-1])
        self._steps = {
            size: capture(functools.partial(forward, size)) for size in reversed(self.sizes)
        }
        self.capture_time_s = time.perf_counter() - start
        self.num_replays = 0
        logger.info(
            "captured %d decode graphs (batch sizes %d-%d) in %.1f s",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            self.capture_time_s,
        )

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    def bucket(self, num_rows: int) -> int | None:
        """The smallest captured size holding ``num_rows`` rows, or None (run eagerly)."""
        for size in self.sizes:
            if size >= num_rows:
                return size
        return None

    def run(self, num_rows: int) -> torch.Tensor:
        """Replay the step for the first ``num_rows`` host rows (already filled); returns the
        output's first ``num_rows`` rows, valid until the next ``run``."""
        bucket = self.bucket(num_rows)
        assert bucket is not None, f"{num_rows} rows exceed the largest graph ({self.max_rows})"
        self.buffers.pad(num_rows, bucket)
        self.buffers.upload(bucket)
        step = self._steps[bucket]
        step.replay()
        self.num_replays += 1
        return step.output[:num_rows]
