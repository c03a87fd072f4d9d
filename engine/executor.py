"""The model side of an ``LLMEngine``: its KV cache and what computes a scheduled batch.

``LLMEngine`` owns the requests (scheduler, paged block pool, prefix cache, grammars, outputs);
an executor owns the model. ``NativeExecutor`` runs this repository's model code
(``ModelRunner`` + ``BatchRunner``); ``engine.simulated.SimulatedExecutor`` runs no model math,
takes a profile's time per step and writes deterministic KV (``--engine mock``). Engine thread
only, like the engine.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.batch_runner import BatchRunner
from engine.kv_cache_spec import KVCacheSpec
from engine.model_runner import ModelRunner
from engine.sampler import SamplerOutput
from engine.scheduler import ScheduledRequest


class ModelExecutor(Protocol):
    """Computes scheduled batches over a paged KV cache fixed at load."""

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output, in tokens."""

    @property
    def num_kv_blocks(self) -> int:
        """Blocks in ``kv_cache``: what the engine's block pool hands out."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def kv_cache(self) -> torch.Tensor:
        """``[num_kv_blocks, *kv_cache_spec.block_shape]``; its storage never moves."""

    @property
    def kv_cache_spec(self) -> KVCacheSpec: ...

    @property
    def cpu_isa(self) -> str:
        """The CPU level the kernels were chosen for; "" off CPU or without kernels."""

    def describe(self) -> str:
        """Which implementation computes each part of the model, in a line."""

    def run(self, scheduled: list[ScheduledRequest]) -> tuple[SamplerOutput, dict[str, str]]:
        """Compute ``scheduled`` (writing its tokens' KV into their blocks) and sample; the
        samples of the requests that did not fail, in order, and the error of each that did
        (see ``BatchRunner.run``)."""


class NativeExecutor:
    """This repository's model code: ``runner`` computes, ``batch`` samples and isolates
    failures."""

    def __init__(self, runner: ModelRunner, batch: BatchRunner) -> None:
        self.runner = runner
        self._batch = batch

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_kv_blocks

    @property
    def vocab_size(self) -> int:
        return self.runner.model_config.vocab_size

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.runner.kv_cache

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return self.runner.kv_cache_spec

    @property
    def cpu_isa(self) -> str:
        level = self.runner.kernels.cpu_isa
        return "" if level is None else level.value

    def describe(self) -> str:
        return self.runner.kernels.describe()

    def run(self, scheduled: list[ScheduledRequest]) -> tuple[SamplerOutput, dict[str, str]]:
        return self._batch.run(scheduled)
