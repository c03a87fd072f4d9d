"""The model side of an ``LLMEngine``: its KV cache and what computes a scheduled batch.

``LLMEngine`` owns the requests (scheduler, paged block pool, prefix cache, grammars, outputs);
an executor owns the model. ``NativeExecutor`` runs this repository's model code
(``ModelRunner`` + ``BatchRunner``); ``engine.simulated.SimulatedExecutor`` runs no model math,
takes a profile's time per step and writes deterministic KV (``--engine mock``). Engine thread
only, like the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from engine.batch_runner import BatchRunner
from engine.config import EngineConfig, EngineKind
from engine.cpu_isa import CpuIsa
from engine.kv_cache_spec import KVCacheSpec
from engine.model_runner import ModelRunner
from engine.sampler import Sampler, SamplerOutput
from engine.scheduler_output import ScheduledRequest
from engine.simulated import SimulatedExecutor, StepProfile


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

    def load_lora_adapter(self, name: str, path: str) -> str:
        """Read the PEFT adapter at ``path`` and serve it as ``name`` from the next step; its
        block key (``LoraAdapter.block_key``). ``ValueError`` saying why it cannot be served."""

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving a loaded adapter (no request of the next step may use it)."""

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

    def load_lora_adapter(self, name: str, path: str) -> str:
        return self.runner.load_lora_adapter(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        self.runner.unload_lora_adapter(name)

    def run(self, scheduled: list[ScheduledRequest]) -> tuple[SamplerOutput, dict[str, str]]:
        return self._batch.run(scheduled)


def build_executor(
    config: EngineConfig,
    model_dir: Path,
    dtype: str,
    kv_cache_dtype: str,
    device: torch.device,
    cpu_isa: CpuIsa,
    sampler: Sampler,
    eos_token_ids: frozenset[int],
) -> ModelExecutor:
    """The model side of an engine of ``config``: this repository's model code (loads the
    weights, allocates the KV cache), or the simulated one (``--engine mock``)."""
    if config.engine is EngineKind.MOCK:
        return SimulatedExecutor(
            model_dir,
            kv_cache_dtype,
            config.block_size,
            StepProfile(
                overhead_s=config.mock_step_ms / 1e3,
                prefill_s_per_token=config.mock_prefill_us_per_token / 1e6,
                decode_s_per_seq=config.mock_decode_us_per_seq / 1e6,
                kv_read_s_per_block=config.mock_kv_read_us_per_block / 1e6,
            ),
            eos_token_ids,
            max_model_len=config.max_model_len,
            max_lora_rank=config.max_lora_rank,
            num_kv_blocks=config.num_kv_blocks,
            kv_cache_memory_gb=config.kv_cache_memory_gb,
        )
    runner = ModelRunner(
        model_dir,
        dtype,
        kv_cache_dtype,
        device,
        config.block_size,
        config.max_model_len,
        config.num_kv_blocks,
        config.kv_cache_memory_gb,
        config.kernel_backend,
        cpu_isa,
        enforce_eager=config.enforce_eager,
        load_format=config.load_format,
        max_loras=config.max_loras if config.enable_lora else 0,
        max_lora_rank=config.max_lora_rank,
        max_decode_rows=min(
            config.max_num_seqs * (1 + config.num_speculative_tokens),
            config.max_num_batched_tokens,
        ),
    )
    return NativeExecutor(runner, BatchRunner(runner, sampler))
