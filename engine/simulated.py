"""A simulated executor (``--engine mock``): the engine without model math.

Everything but the model is the native engine's own (``LLMEngine``: scheduler, paged block
pool, prefix caching and eviction, held and remote KV, preemption, grammars), so routing,
leases, KV events and preemption behave as they do on a real worker. The executor:

- takes the time ``StepProfile`` says a step of that shape takes (per prefilled token, per
  decoded sequence, per KV block read, plus a fixed cost), sleeping what its own work left;
- samples token ids that are a function of the prompt and the output position only
  (``simulated_token_id``), so a request gives the same ids on any worker: migration and
  output checks still hold; it never samples an eos id (requests run to their limits);
- writes each computed token's KV as real bytes (``kv_value`` of its id and position, in every
  layer and head of the model's KV layout), which the KV backends move like any other; a
  request that arrives with computed tokens (pulled from a peer, or prefix hits) is checked
  against them (``kv_matches``) and fails alone if a byte is wrong.

Many fit on one machine: nothing is loaded but the model's ``config.json`` and tokenizer, and
the KV cache is as large as ``--num-kv-blocks`` or ``--kv-cache-memory-gb`` make it (0.5 GiB
without either).
Logprobs and prompt logprobs, when asked for, are the chosen (or prompt) token's alone, at 0.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.kv_cache_manager import cdiv
from engine.kv_cache_spec import QUANTIZED_KV_DTYPES, KVCacheSpec
from engine.lora.adapter import load_lora_adapter
from engine.model.config import ModelConfig
from engine.request import Request
from engine.sampler import SamplerOutput, TokenLogprobs
from engine.scheduler_output import ScheduledRequest

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Without --num-kv-blocks or --kv-cache-memory-gb: a quarter of the native engine's 2 GiB, so
# that a dozen simulated workers of a small model fit on one machine.
_DEFAULT_KV_CACHE_GB = 0.5
# kv_value's range: small integers, exact in every cache dtype (uint8 codes included).
_KV_VALUES = 251


@dataclass(frozen=True, slots=True)
class StepProfile:
    """How long a simulated step takes, in seconds: ``overhead_s``, plus
    ``prefill_s_per_token`` per prompt token computed, ``decode_s_per_seq`` per sequence
    decoding one token, and ``kv_read_s_per_block`` per KV block the step's attention reads."""

    overhead_s: float
    prefill_s_per_token: float
    decode_s_per_seq: float
    kv_read_s_per_block: float

    def step_s(self, scheduled: Sequence[ScheduledRequest], block_size: int) -> float:
        """The time a step computing ``scheduled`` takes."""
        prefill_tokens = sum(s.num_new_tokens for s in scheduled if not s.is_decode)
        decode_seqs = sum(s.is_decode for s in scheduled)
        blocks_read = sum(
            cdiv(s.request.num_computed_tokens + s.num_new_tokens, block_size) for s in scheduled
        )
        return (
            self.overhead_s
            + prefill_tokens * self.prefill_s_per_token
            + decode_seqs * self.decode_s_per_seq
            + blocks_read * self.kv_read_s_per_block
        )


def prompt_digest(prompt_token_ids: Sequence[int]) -> bytes:
    """What ``simulated_token_id`` keys a request's ids on."""
    return hashlib.blake2b(array("q", prompt_token_ids).tobytes(), digest_size=16).digest()


def simulated_token_id(
    digest: bytes, output_index: int, vocab_size: int, avoid: frozenset[int]
) -> int:
    """The id a request whose prompt has ``digest`` samples at ``output_index`` (0: its first
    output token): uniform over the vocabulary without ``avoid``."""
    salt = output_index.to_bytes(8, "little")
    token_id = int.from_bytes(hashlib.blake2b(digest + salt, digest_size=8).digest(), "little")
    token_id %= vocab_size
    while token_id in avoid:
        token_id = (token_id + 1) % vocab_size
    return token_id


def kv_value(token_id: int, position: int) -> int:
    """The value every K and V element of token ``token_id`` at ``position`` holds."""
    return (token_id * 31 + position) % _KV_VALUES


def kv_matches(
    kv_cache: torch.Tensor, block_ids: Sequence[int], token_ids: Sequence[int], block_size: int
) -> bool:
    """Whether the blocks ``block_ids`` hold the simulated KV of ``token_ids`` (positions from
    0): what a decode worker finds after a transfer that moved every byte."""
    if not token_ids:
        return True
    blocks, slots, want = _kv_rows(block_ids, 0, token_ids, block_size, kv_cache.dtype)
    return bool((kv_cache[blocks, :, :, :, slots] == want).all())


def _kv_rows(
    block_ids: Sequence[int],
    start: int,
    token_ids: Sequence[int],
    block_size: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the KV of ``token_ids`` at positions ``start``... lies (block and slot indices of
    the cache) and its simulated value there, shaped to broadcast over layers and heads."""
    positions = range(start, start + len(token_ids))
    blocks = torch.tensor([block_ids[p // block_size] for p in positions])
    slots = torch.tensor([p % block_size for p in positions])
    values = torch.tensor(
        [kv_value(t, p) for t, p in zip(token_ids, positions, strict=True)], dtype=dtype
    )
    return blocks, slots, values.view(-1, 1, 1, 1, 1)


class SimulatedExecutor:
    """A ``ModelExecutor`` without model math; see the module. Engine thread only."""

    def __init__(
        self,
        model_dir: Path,
        kv_cache_dtype: str,
        block_size: int,
        profile: StepProfile,
        eos_token_ids: frozenset[int],
        *,
        max_model_len: int | None,
        max_lora_rank: int = 16,
        num_kv_blocks: int | None,
        kv_cache_memory_gb: float | None,
    ) -> None:
        config = self._config = ModelConfig.from_dir(model_dir)
        self._max_lora_rank = max_lora_rank
        if kv_cache_dtype not in _TORCH_DTYPES and kv_cache_dtype not in QUANTIZED_KV_DTYPES:
            raise ValueError(f"--kv-cache-dtype {kv_cache_dtype}: not a KV cache dtype")
        self.profile = profile
        self._block_size = block_size
        self._eos_token_ids = eos_token_ids
        self._vocab_size = config.vocab_size
        self._max_model_len = max_model_len or config.max_position_embeddings
        self._spec = KVCacheSpec(
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            block_size=block_size,
            dtype=kv_cache_dtype,
        )
        memory_gb = _DEFAULT_KV_CACHE_GB if kv_cache_memory_gb is None else kv_cache_memory_gb
        memory_bytes = memory_gb * 2**30
        self._num_kv_blocks = num_kv_blocks or max(int(memory_bytes) // self._spec.block_bytes, 1)
        dtype = torch.uint8 if self._spec.quantized else _TORCH_DTYPES[kv_cache_dtype]
        self._kv_cache = torch.zeros((self._num_kv_blocks, *self._spec.block_shape), dtype=dtype)
        # Keyed by the request object's identity, which the entry keeps alive: the digests of
        # the last step's sampling requests, and every request of the last step (checked).
        self._digests: dict[int, tuple[Request, bytes]] = {}
        self._seen: dict[int, Request] = {}

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def num_kv_blocks(self) -> int:
        return self._num_kv_blocks

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def kv_cache(self) -> torch.Tensor:
        return self._kv_cache

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return self._spec

    @property
    def cpu_isa(self) -> str:
        return ""

    def describe(self) -> str:
        p = self.profile
        return (
            f"simulated: {p.overhead_s * 1e3:g} ms a step + {p.prefill_s_per_token * 1e6:g} us "
            f"a prefilled token + {p.decode_s_per_seq * 1e6:g} us a decoded sequence + "
            f"{p.kv_read_s_per_block * 1e6:g} us a KV block read"
        )

    def load_lora_adapter(self, name: str, path: str) -> str:
        """Read and check the adapter as the native engine does; its weights change nothing
        here (an adapter's request samples the ids the base model's would)."""
        return load_lora_adapter(
            name, path, self._config, torch.float32, self._max_lora_rank
        ).block_key

    def unload_lora_adapter(self, name: str) -> None:
        """Nothing to free: no weights were installed."""

    def run(self, scheduled: list[ScheduledRequest]) -> tuple[SamplerOutput, dict[str, str]]:
        """Write the scheduled tokens' KV, sample their simulated ids, and take the profile's
        time. A request that arrives with computed tokens (a prefix hit, KV pulled from a peer)
        fails alone when their blocks do not hold their simulated KV: the bytes moved wrong."""
        start_s = time.perf_counter()
        digests: dict[int, tuple[Request, bytes]] = {}
        seen: dict[int, Request] = {}
        errors: dict[str, str] = {}
        tokens: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        for item in scheduled:
            request = item.request
            seen[id(request)] = request
            if id(request) not in self._seen and not self._computed_kv_holds(item):
                errors[request.req_id] = (
                    f"the KV of its {request.num_computed_tokens} computed tokens is not the "
                    "simulated KV of their ids (a KV transfer or prefix hit moved wrong bytes)"
                )
                continue
            self._write_kv(item)
            if item.prompt_logprob_positions:
                prompt_logprobs[request.req_id] = [
                    _chosen_at_zero(request.prompt_token_ids[position + 1])
                    for position in item.prompt_logprob_positions
                ]
            if not item.num_sample_rows:
                continue
            known = self._digests.get(id(request))
            digest = known[1] if known is not None else prompt_digest(request.prompt_token_ids)
            digests[id(request)] = (request, digest)
            first_index = len(request.output_token_ids)
            for row in range(item.num_sample_rows):
                token_id = simulated_token_id(
                    digest, first_index + row, self._vocab_size, self._eos_token_ids
                )
                tokens.append(token_id)
                wants_logprobs = request.sampling_params.logprobs is not None
                logprobs.append(_chosen_at_zero(token_id) if wants_logprobs else None)
        # Only the requests of this step are kept: neither map can outgrow a batch.
        self._digests = digests
        self._seen = seen
        left_s = self.profile.step_s(scheduled, self._block_size) - (time.perf_counter() - start_s)
        if left_s > 0:
            time.sleep(left_s)
        return SamplerOutput(tokens, logprobs, prompt_logprobs), errors

    def _computed_kv_holds(self, item: ScheduledRequest) -> bool:
        """Whether the blocks of ``item``'s already computed tokens hold their simulated KV."""
        request = item.request
        computed = request.all_token_ids[: request.num_computed_tokens]
        return kv_matches(self._kv_cache, item.block_ids, computed, self._block_size)

    def _write_kv(self, item: ScheduledRequest) -> None:
        """Every computed token's rows, in all layers and heads, hold ``kv_value``."""
        start = item.request.num_computed_tokens
        blocks, slots, values = _kv_rows(
            item.block_ids, start, item.token_ids, self._block_size, self._kv_cache.dtype
        )
        self._kv_cache[blocks, :, :, :, slots] = values


def _chosen_at_zero(token_id: int) -> TokenLogprobs:
    """A simulated logprob entry: ``token_id`` alone, certain."""
    return TokenLogprobs(token_id, 0.0, 1, ((token_id, 0.0),))
