"""Owns the model and the paged KV cache tensor; turns a scheduled step into logits."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

from engine.captured_decode import CapturedDecode
from engine.cpu_isa import CpuIsa
from engine.cpu_tuning import advise_huge_pages
from engine.kv_cache_spec import KVCacheSpec
from engine.loader.hf import load_model
from engine.lora.adapter import load_lora_adapter
from engine.lora.layers import LoraStack
from engine.model.attention import (
    AttentionMetadata,
    DecodeInputs,
    PagedKVCache,
    PrefillBatch,
    PrefillSeq,
    causal_mask,
    decode_bias,
)
from engine.model.cpu_kernels import PAGED_DECODE_SHAPES, load_cpu_kernels
from engine.model.cuda_graphs import CudaGraphCapture, capture_eagerly
from engine.model.kernel_plan import KernelImpl, KernelPlan
from engine.model.kv_quant import kv_quant_for
from engine.model.ops import FusedCpuOps
from engine.model.packed_linear import pack_linears, pack_lm_head
from engine.model.rotary import RotaryEmbedding
from engine.model.triton_inputs import triton_inputs
from engine.model.triton_kernels import triton_available
from engine.scheduler_output import ScheduledRequest

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FUSED_OPS_DTYPES = (torch.float32, torch.bfloat16)


class ModelRunner:
    """Runs forward passes of one model over its KV cache.

    The cache is one tensor ``[num_blocks, num_layers, 2, num_kv_heads, block_size, row]``
    (a block is contiguous across layers, for transfer; a row is ``head_dim`` values, or codes
    and a scale in an 8-bit cache); see ``PagedKVCache`` and ``KVCacheSpec``. On CPU every
    kernel is chosen for ``cpu_isa`` (never above the host's level); ``kernels`` says which.
    """

    def __init__(
        self,
        model_dir: Path,
        dtype: str,
        kv_cache_dtype: str,
        device: torch.device,
        block_size: int,
        max_model_len: int | None,
        num_kv_blocks: int | None,
        kv_cache_memory_gb: float | None,
        kernel_backend: str,
        cpu_isa: CpuIsa,
        enforce_eager: bool = False,
        max_decode_rows: int = 0,
        load_format: str = "auto",
        max_loras: int = 0,
        max_lora_rank: int = 16,
    ) -> None:
        """``max_decode_rows``: the most decode rows a step can hold (sequences times one plus
        their drafts), which bounds the captured graphs' sizes on a GPU; ``enforce_eager``
        captures none. ``max_loras`` > 0 gives the projections that many LoRA adapter slots of
        rank up to ``max_lora_rank`` (``lora``); steps then run eagerly."""
        self.device = device
        self.dtype_name = dtype
        self.dtype = TORCH_DTYPES[dtype]
        self.block_size = block_size
        self.cpu_isa = cpu_isa if device.type == "cpu" else None
        self.model, self.model_config = load_model(model_dir, self.dtype, device, load_format)
        self.lora = (
            LoraStack.install(self.model, self.model_config, max_loras, max_lora_rank)
            if max_loras
            else None
        )
        packed = self._pack_linears(kernel_backend)
        config = self.model_config
        self.max_model_len = max_model_len or config.max_position_embeddings
        self.kv_cache_spec = KVCacheSpec(
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            block_size=block_size,
            dtype=kv_cache_dtype,
        )
        self.num_kv_blocks = num_kv_blocks or self._blocks_for_memory(kv_cache_memory_gb)
        quant = kv_quant_for(kv_cache_dtype)
        # Zeroed, not empty: padded block-table entries are read (then masked), and NaN * 0 = NaN
        # (an 8-bit row of zeros is zero codes at scale 0).
        self.kv_cache = torch.empty(
            (self.num_kv_blocks, *self.kv_cache_spec.block_shape),
            dtype=self.dtype if quant is None else torch.uint8,
            device=device,
        )
        if device.type == "cpu":
            advise_huge_pages(self.kv_cache.data_ptr(), self.kv_cache.nbytes)
        self.kv_cache.zero_()
        self.rope = RotaryEmbedding(config, self.max_model_len, self.dtype, device)
        self.use_triton = self._use_triton(kernel_backend)
        self.cpu_kernels = self._load_cpu_kernels(kernel_backend)
        self.cache = PagedKVCache(self.kv_cache, quant, self.dtype, self.cpu_kernels)
        self.decode_kernel = self._select_decode_kernel()
        self.prefill_kernel = self._select_prefill_kernel()
        fused_ops = self.cpu_kernels is not None and self.dtype in FUSED_OPS_DTYPES
        if self.cpu_kernels is not None and fused_ops:
            self.model.use_ops(FusedCpuOps(self.cpu_kernels))
        self.kernels = KernelPlan(
            cpu_isa=self.cpu_isa,
            linear=KernelImpl.ONEDNN_PACKED if packed else KernelImpl.TORCH,
            decode_attention=KernelImpl.TORCH if self.decode_kernel is None else KernelImpl.CPP,
            prefill_attention=KernelImpl.SDPA if self.prefill_kernel is None else KernelImpl.CPP,
            elementwise_ops=KernelImpl.CPP if fused_ops else KernelImpl.TORCH,
        )
        if self.use_triton:
            from engine.model.triton_kernels.elementwise import TritonOps

            self.model.use_ops(TritonOps())
            self.kernels = dataclasses.replace(
                self.kernels,
                decode_attention=KernelImpl.TRITON,
                prefill_attention=KernelImpl.TRITON,
                elementwise_ops=KernelImpl.TRITON,
            )
        self.captured_decode: CapturedDecode | None = None
        logger.info(
            "KV cache: %d blocks x %d tokens (%.2f GiB)",
            self.num_kv_blocks,
            block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**30,
        )
        if self.use_triton and device.type == "cuda":
            self._compile_triton_kernels()
        if self.use_triton and not enforce_eager and max_decode_rows and self.lora is None:
            # On CPU (the interpreter: tests) the stand-in runs the same bookkeeping eagerly.
            capture = CudaGraphCapture() if device.type == "cuda" else capture_eagerly
            with torch.inference_mode():
                self.captured_decode = CapturedDecode(self, capture, max_decode_rows)
            self.kernels = dataclasses.replace(
                self.kernels, decode_graphs=len(self.captured_decode.graphs.sizes)
            )

    def _use_triton(self, backend: str) -> bool:
        """Whether attention runs the Triton kernels: ``auto`` on a GPU with triton installed,
        or ``triton`` (on CPU only under the interpreter, ``TRITON_INTERPRET=1``: tests)."""
        if backend == "auto":
            return self.device.type == "cuda" and triton_available()
        if backend != "triton":
            return False
        if not triton_available():
            raise RuntimeError("kernel_backend=triton: the triton package is not installed")
        if self.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "kernel_backend=triton on CPU runs only under Triton's interpreter "
                "(TRITON_INTERPRET=1, for tests); use cpp or torch"
            )
        return True

    @torch.inference_mode()
    def _compile_triton_kernels(self) -> None:
        from engine.model.triton_attention import compile_kernels

        start_s = time.perf_counter()
        config = self.model_config
        compile_kernels(
            self.kv_cache,
            self.cache.quant,
            config.num_heads,
            config.head_dim,
            self.dtype,
            config.sliding_window,
        )
        torch.cuda.synchronize(self.device)
        logger.info("Triton attention kernels ready in %.1f s", time.perf_counter() - start_s)

    def _pack_linears(self, backend: str) -> bool:
        """Pack the linears and the LM head for oneDNN where the level allows (CPU only; not
        with the ``torch`` reference backend); returns whether any was packed."""
        if backend in ("torch", "triton") or self.cpu_isa is None:
            return False
        num_packed = pack_linears(self.model.model, self.cpu_isa)
        self.model.logits_proj = pack_lm_head(self.model.lm_head.weight, self.cpu_isa)
        return num_packed > 0

    def _load_cpu_kernels(self, backend: str) -> ModuleType | None:
        if backend in ("torch", "triton") or self.cpu_isa is None:
            return None
        kernels = load_cpu_kernels(self.cpu_isa)
        if kernels is None and backend == "cpp":
            raise RuntimeError("kernel_backend=cpp: the CPU kernels do not build here")
        return kernels

    def _select_decode_kernel(self) -> ModuleType | None:
        shape = (self.model_config.head_dim, self.block_size)
        if self.cpu_kernels is None or shape not in PAGED_DECODE_SHAPES:
            return None
        return self.cpu_kernels

    def _select_prefill_kernel(self) -> ModuleType | None:
        config = self.model_config
        # At amx, torch's SDPA runs bfloat16 attention on oneDNN's AMX matmuls: 1.4x the
        # compiled kernel's speed at 128 prompt tokens, 3.4x at 1024 (BENCHMARKS.md).
        if self.cpu_isa is CpuIsa.AMX and self.dtype == torch.bfloat16:
            return None
        if self.cpu_kernels is None or not self.cpu_kernels.paged_prefill_supported(
            self.dtype_name,
            config.head_dim,
            self.block_size,
            config.num_heads // config.num_kv_heads,
        ):
            return None
        return self.cpu_kernels

    def load_lora_adapter(self, name: str, path: str) -> str:
        """Read the PEFT adapter at ``path`` and install it in a free slot as ``name``; its
        block key. ``ValueError`` saying why it cannot be served (also when LoRA is off)."""
        if self.lora is None:
            raise ValueError("LoRA adapters need --enable-lora")
        adapter = load_lora_adapter(name, path, self.model_config, self.dtype, self.lora.max_rank)
        with torch.inference_mode():
            self.lora.add(adapter)
        return adapter.block_key

    def unload_lora_adapter(self, name: str) -> None:
        """Free ``name``'s slot (``KeyError`` if it is not loaded)."""
        if self.lora is None:
            raise KeyError(name)
        with torch.inference_mode():
            self.lora.remove(name)

    def _blocks_for_memory(self, memory_gb: float | None) -> int:
        if memory_gb is None:
            if self.device.type == "cuda":
                free_bytes, _ = torch.cuda.mem_get_info(self.device)
                memory_gb = 0.8 * free_bytes / 2**30
            else:
                memory_gb = 2.0
        return max(int(memory_gb * 2**30) // self.kv_cache_spec.block_bytes, 1)

    @torch.inference_mode()
    def execute(self, scheduled: Sequence[ScheduledRequest]) -> torch.Tensor:
        """Compute the scheduled tokens; return logits [num_sampling, vocab] in the model's dtype.

        Rows follow ``scheduled`` order: ``num_sample_rows`` per item (one per request whose
        step ends at its last token, one more per draft token); then, in the same order, one
        row per item's ``prompt_logprob_positions``.
        Side effect: the tokens' K/V are written into the cache.
        """
        captured = self.captured_decode
        num_rows = captured.num_rows(scheduled) if captured is not None else None
        if captured is not None and num_rows is not None:
            # Every decode row samples (a decode step ends at its request's last token).
            return self.model.compute_logits(captured.run(scheduled, num_rows))
        input_ids, meta, sample_idx = self._prepare(scheduled)
        hidden = self.model(input_ids, meta, self.cache)
        return self.model.compute_logits(hidden[sample_idx])

    def _prepare(
        self, scheduled: Sequence[ScheduledRequest]
    ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flatten the step into token ids, positions, cache indices and attention masks.

        Built on the CPU with a handful of tensor ops per request, then moved to the device.
        """
        bs = self.block_size
        window = self.model_config.sliding_window
        token_ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        sample_idx: list[int] = []
        prompt_idx: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSeq] = []
        prefill_chunks: list[tuple[list[int], int, int, int]] = []  # kernel: blocks, start, n, end
        lora_slots: list[int] = []
        for item in scheduled:
            request = item.request
            start, n = request.num_computed_tokens, item.num_new_tokens
            if self.lora is not None:
                slot = self.lora.slot(request.lora_name) if request.lora_name else -1
                lora_slots.extend([slot] * n)
            end = start + n
            q_start = len(token_ids)
            token_ids.extend(item.token_ids)
            positions.extend(range(start, end))
            blocks = item.block_ids
            slot_blocks.extend(blocks[p // bs] for p in range(start, end))
            sample_idx.extend(range(q_start + n - item.num_sample_rows, q_start + n))
            prompt_idx.extend(q_start + p - start for p in item.prompt_logprob_positions)
            if item.is_decode:
                assert not prefills and not prefill_chunks, "decodes must precede prefill chunks"
                # A decode with drafts is one decode row per token, each seeing the tokens
                # up to itself.
                decode_tables.extend([blocks] * n)
                decode_lens.extend(range(start + 1, end + 1))
                continue
            if self.prefill_kernel is not None or self.use_triton:
                prefill_chunks.append((blocks[: -(-end // bs)], q_start, n, end))
                continue
            table = torch.tensor(blocks[: -(-end // bs)], dtype=torch.long)
            prefills.append(
                PrefillSeq(
                    q_start=q_start,
                    q_len=n,
                    num_context_tokens=end,
                    tile_rows=self.cache.tile_rows(table[None, :]).to(self.device),
                    mask=causal_mask(n, end, window, self.device),
                )
            )
        if self.lora is not None:
            self.lora.select(lora_slots, self.device)
        pos = torch.tensor(positions, dtype=torch.long)
        cos, sin = self.rope.cos_sin(pos.to(self.device))
        slot_rows = self.cache.slot_rows(torch.tensor(slot_blocks), pos % bs).to(self.device)
        if self.use_triton:
            window = self.model_config.sliding_window
            triton = triton_inputs(decode_tables, decode_lens, prefill_chunks, window, self.device)
            meta = AttentionMetadata.for_triton(slot_rows, len(decode_tables), cos, sin, triton)
        else:
            meta = AttentionMetadata(
                slot_rows=slot_rows,
                num_decode_tokens=len(decode_tables),
                decode=self._decode_inputs(decode_tables, decode_lens),
                prefills=tuple(prefills),
                prefill_batch=self._prefill_batch(prefill_chunks),
                cos=cos,
                sin=sin,
            )
        return (
            torch.tensor(token_ids, dtype=torch.long, device=self.device),
            meta,
            torch.tensor(sample_idx + prompt_idx, dtype=torch.long, device=self.device),
        )

    def _prefill_batch(self, chunks: list[tuple[list[int], int, int, int]]) -> PrefillBatch | None:
        if not chunks:
            return None
        assert self.prefill_kernel is not None
        max_blocks = max(len(blocks) for blocks, _, _, _ in chunks)
        tables = torch.tensor(
            [blocks + [0] * (max_blocks - len(blocks)) for blocks, _, _, _ in chunks],
            dtype=torch.long,
        )
        context_blocks = None
        if self.cache.quant is not None:
            context_blocks, tables = torch.unique(tables, return_inverse=True)
        return PrefillBatch(
            block_tables=tables,
            q_starts=torch.tensor([start for _, start, _, _ in chunks], dtype=torch.long),
            q_lens=torch.tensor([n for _, _, n, _ in chunks], dtype=torch.long),
            context_lens=torch.tensor([end for _, _, _, end in chunks], dtype=torch.long),
            kernel=self.prefill_kernel,
            sliding_window=self.model_config.sliding_window,
            context_blocks=context_blocks,
        )

    def _decode_inputs(self, tables: list[list[int]], context_lens: list[int]) -> DecodeInputs:
        max_blocks = max((len(t) for t in tables), default=0)
        padded = torch.tensor(
            [t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long
        ).view(len(tables), max_blocks)
        lens = torch.tensor(context_lens, dtype=torch.long)
        window = self.model_config.sliding_window
        if self.decode_kernel is not None:
            return DecodeInputs(padded, lens, None, None, self.decode_kernel, window)
        lens = lens.to(self.device)
        return DecodeInputs(
            block_tables=padded.to(self.device),
            context_lens=lens,
            tile_rows=self.cache.tile_rows(padded).to(self.device),
            bias=decode_bias(lens, max_blocks * self.block_size, window, self.dtype),
            kernel=None,
            sliding_window=window,
        )
