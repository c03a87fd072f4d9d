"""A generation request as the scheduler sees it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.block_hash import ROOT_PARENT_HASH, BlockHash, hash_block_tokens
from engine.sampling_params import SamplingParams
from engine.structured_output import GuidedMatcher

_MASK_63 = (1 << 63) - 1


def _mix_seed(seed: int, position: int) -> int:
    """splitmix64 finalizer of (seed, position): nearby inputs give unrelated seeds."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK_63


class RequestStatus(enum.Enum):
    """Lifecycle of a request inside one engine.

    WAITING ──▶ RUNNING ──▶ FINISHED_*
       ▲  │        │
       │  ▼        ▼ (out of KV blocks: recompute later)
       │ WAITING_FOR_REMOTE_KV     PREEMPTED ──▶ (back to the front of the waiting queue)
       └──┘ (transfer done or failed)

    FINISHED_ERROR: the request's own computation failed (non-finite logits, an exception
    isolated to it); the engine goes on with the others.
    """

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True, eq=False)
class Request:
    """Token state of one request.

    Invariant: ``0 <= num_computed_tokens <= num_tokens``; the KV of the first
    ``num_computed_tokens`` tokens is in the request's blocks. The request samples a new token in
    the step that brings ``num_computed_tokens`` up to ``num_tokens``.

    ``num_external_tokens`` > 0 means the KV of the first that many tokens is produced elsewhere
    (a prefill worker) and arrives by transfer instead of being computed here. ``hold_kv``
    keeps the blocks allocated after the request finishes (a prefill worker's lease) until the
    scheduler is told to release them.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    block_size: int
    arrival_time_s: float
    extra_key: str = ""
    # The LoRA adapter its tokens run with ("": the base model); also part of ``extra_key``.
    lora_name: str = ""
    # Lower runs first under --scheduling-policy priority (vLLM's ``priority``).
    priority: int = 0
    num_external_tokens: int = 0
    hold_kv: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    # Of num_cached_tokens, those loaded back from the second tier.
    num_tier_tokens: int = 0
    num_preemptions: int = 0
    # Prompt positions whose next token's logprobs were computed (prompt_logprobs): a
    # recompute after preemption does not compute them again.
    num_prompt_logprob_positions: int = 0
    # When the scheduler first gave it blocks (``time.perf_counter()``); None while queued.
    scheduled_time_s: float | None = None
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    # Why the request finished with FINISHED_ERROR (None otherwise).
    error: str | None = None
    generator: torch.Generator | None = None
    # The request's position in its output constraint (None: unconstrained); see
    # engine.structured_output. Kept across preemption: the tokens it has consumed stay.
    matcher: GuidedMatcher | None = None
    _block_hashes: list[BlockHash] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        if self.sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    def mark_scheduled(self) -> None:
        """Record the end of the queue wait: the first time the scheduler gives it blocks (a
        preempted request that is readmitted keeps its first time)."""
        if self.scheduled_time_s is None:
            self.scheduled_time_s = time.perf_counter()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def block_hashes(self) -> list[BlockHash]:
        """Chained hashes of every full block of the request's tokens, extended lazily."""
        num_hashed = len(self._block_hashes)
        if (num_hashed + 1) * self.block_size <= self.num_tokens:
            parent = self._block_hashes[-1] if self._block_hashes else ROOT_PARENT_HASH
            start = num_hashed * self.block_size
            self._block_hashes.extend(
                hash_block_tokens(
                    self.all_token_ids[start:], self.block_size, self.extra_key, parent
                )
            )
        return self._block_hashes

    def next_token_generator(self) -> torch.Generator | None:
        """The request's generator, reseeded for the token it samples next (None if unseeded).

        Seeding from (seed, output position) makes each token's draws a function of the seed
        and its position only: the same whichever engine samples it (a prefill worker samples
        the first token, a decode worker the rest) and after a preemption.
        """
        if self.generator is None:
            return None
        seed = self.sampling_params.seed
        assert seed is not None
        return self.generator.manual_seed(_mix_seed(seed, self.num_output_tokens))

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
