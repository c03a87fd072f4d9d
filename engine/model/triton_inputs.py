"""What the Triton attention path reads for one step, besides the new tokens' slots.

Device tensors only (int32), so that the kernels launch without reading anything back: a
captured decode step (``captured_decode``) keeps them in static buffers, an eager step builds
them here (``triton_inputs``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TritonPrefill:
    """A step's prefill chunks: chunk ``s`` is rows ``[q_starts[s], + q_lens[s])`` of the step,
    the last ``q_lens[s]`` of its ``context_lens[s]`` tokens (int32 device tensors)."""

    block_tables: torch.Tensor  # [S, max_blocks]
    q_starts: torch.Tensor  # [S]
    q_lens: torch.Tensor  # [S]
    context_lens: torch.Tensor  # [S]
    max_q_len: int


@dataclass(frozen=True, slots=True)
class TritonInputs:
    """What the Triton path reads besides ``AttentionMetadata.slot_rows``.

    Decode row ``b`` attends to the first ``decode_lens[b]`` tokens of ``decode_tables[b]``
    (a padding row of a captured batch has length 0); ``max_decode_context`` is a host bound on
    those lengths that sizes the kernel's grid (fixed for a captured graph).
    """

    decode_tables: torch.Tensor  # [B, max_blocks] int32
    decode_lens: torch.Tensor  # [B] int32
    max_decode_context: int
    prefill: TritonPrefill | None
    sliding_window: int | None


def triton_inputs(
    decode_tables: list[list[int]],
    decode_lens: list[int],
    chunks: list[tuple[list[int], int, int, int]],
    sliding_window: int | None,
    device: torch.device,
) -> TritonInputs:
    """The Triton path's inputs of an eager step: decode rows' block tables and context
    lengths, and each prefill chunk's ``(blocks, q_start, q_len, context_len)``."""

    def table(rows: list[list[int]]) -> torch.Tensor:
        width = max((len(r) for r in rows), default=0)
        padded = [r + [0] * (width - len(r)) for r in rows]
        return torch.tensor(padded, dtype=torch.int32).view(len(rows), width).to(device)

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).to(device)

    prefill = None
    if chunks:
        prefill = TritonPrefill(
            block_tables=table([blocks for blocks, _, _, _ in chunks]),
            q_starts=ints([start for _, start, _, _ in chunks]),
            q_lens=ints([n for _, _, n, _ in chunks]),
            context_lens=ints([end for _, _, _, end in chunks]),
            max_q_len=max(n for _, _, n, _ in chunks),
        )
    return TritonInputs(
        decode_tables=table(decode_tables),
        decode_lens=ints(decode_lens),
        max_decode_context=max(decode_lens, default=0),
        prefill=prefill,
        sliding_window=sliding_window,
    )
