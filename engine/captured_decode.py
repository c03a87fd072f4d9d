"""The model runner's decode steps replayed from CUDA graphs (``model.cuda_graphs``).

``CapturedDecode`` captures one forward pass per batch-size bucket over static input rows,
attention through the Triton kernels, and serves every later step of decodes alone that fits a
bucket: it writes the step's rows (a decode's drafts are rows after its real token, each seeing
up to itself) into the host staging arrays, and ``DecodeGraphs.run`` pads, uploads and replays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.model.attention import AttentionMetadata
from engine.model.cuda_graphs import DecodeBuffers, DecodeGraphs, GraphCapture, capture_sizes
from engine.model.triton_inputs import TritonInputs
from engine.scheduler_output import ScheduledRequest

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner


class CapturedDecode:
    """One runner's captured decode steps (its attention must be the Triton path)."""

    def __init__(self, runner: ModelRunner, capture: GraphCapture, max_decode_rows: int) -> None:
        """Capture the step for every bucket up to ``max_decode_rows`` rows (``capture`` is
        ``CudaGraphCapture`` on a GPU, ``capture_eagerly`` in tests)."""
        self.runner = runner
        config = runner.model_config
        self.block_size = runner.block_size
        # A token's layer-0 key rows per KV head: block * rows_per_block + offset + head_rows
        # (PagedKVCache.slot_rows).
        self.rows_per_block = config.num_layers * 2 * config.num_kv_heads * runner.block_size
        self.head_rows = np.arange(config.num_kv_heads) * runner.block_size
        sizes = capture_sizes(max_decode_rows)
        # Every row's table is as wide as the longest sequence's.
        max_blocks = -(-runner.max_model_len // runner.block_size)
        self.buffers = DecodeBuffers.allocate(
            sizes[-1], config.num_kv_heads, max_blocks, runner.device
        )
        self.graphs = DecodeGraphs(self.buffers, sizes, self._forward, capture)

    def num_rows(self, scheduled: Sequence[ScheduledRequest]) -> int | None:
        """The step's decode rows if a captured graph can run it (decodes alone, few enough
        rows), else None."""
        if not all(item.is_decode for item in scheduled):
            return None
        num_rows = sum(item.num_new_tokens for item in scheduled)
        return num_rows if self.graphs.bucket(num_rows) is not None else None

    def run(self, scheduled: Sequence[ScheduledRequest], num_rows: int) -> torch.Tensor:
        """Final hidden states ``[num_rows, hidden]`` of the step (valid until the next run).
        Side effect: the tokens' K/V are written into the cache."""
        self._fill(scheduled)
        return self.graphs.run(num_rows)

    def _fill(self, scheduled: Sequence[ScheduledRequest]) -> None:
        bs = self.block_size
        host = self.buffers.host
        row = 0
        for item in scheduled:
            start = item.request.num_computed_tokens
            blocks = item.block_ids
            host["block_tables"][row : row + item.num_new_tokens, : len(blocks)] = blocks
            for offset, token_id in enumerate(item.token_ids):
                position = start + offset
                slot = blocks[position // bs] * self.rows_per_block + position % bs
                host["input_ids"][row] = token_id
                host["positions"][row] = position
                host["slot_rows"][row] = slot + self.head_rows
                host["context_lens"][row] = position + 1
                row += 1

    def _forward(self, size: int) -> torch.Tensor:
        """The forward pass over the first ``size`` rows of the buffers (what is captured)."""
        runner, buffers = self.runner, self.buffers
        cos, sin = runner.rope.cos_sin(buffers.positions[:size])
        triton = TritonInputs(
            decode_tables=buffers.block_tables[:size],
            decode_lens=buffers.context_lens[:size],
            max_decode_context=runner.max_model_len,
            prefill=None,
            sliding_window=runner.model_config.sliding_window,
        )
        meta = AttentionMetadata.for_triton(buffers.slot_rows[:size], size, cos, sin, triton)
        return runner.model(buffers.input_ids[:size], meta, runner.cache)
