"""Scripting a real ``Scheduler`` without a model, for the scheduler's table-driven tests: requests
to add, steps to run (schedule, fake sampled tokens, update), and the invariants every step
checks (the pool's and the batch's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.ngram_proposer import NgramProposer
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.scheduler_output import SchedulerOutput

BLOCK_SIZE = 4
EOS = 2
SAMPLED = 7  # what the fake model samples unless a test says otherwise: not eos, not a stop id


def tokens(tag: int, n: int) -> tuple[int, ...]:
    """``n`` prompt tokens that share no block with another ``tag``'s."""
    return tuple(1000 * tag + i for i in range(n))


@dataclass(frozen=True, slots=True)
class Req:
    """A request to add at this point of a script."""

    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int = 16
    num_external_tokens: int = 0
    hold_kv: bool = False
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    temperature: float = 1.0
    priority: int = 0

    def build(self) -> Request:
        return Request(
            req_id=self.req_id,
            prompt_token_ids=list(self.prompt),
            sampling_params=SamplingParams(
                max_tokens=self.max_tokens,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                temperature=self.temperature,
            ),
            eos_token_ids=frozenset({EOS}),
            block_size=BLOCK_SIZE,
            arrival_time_s=0.0,
            num_external_tokens=self.num_external_tokens,
            hold_kv=self.hold_kv,
            priority=self.priority,
        )


def req(req_id: str, prompt: int | tuple[int, ...], **kwargs: object) -> Req:
    """A request whose prompt is ``prompt`` tokens of its own (an int) or the given tokens."""
    if isinstance(prompt, int):
        prompt = tokens(ord(req_id[0]), prompt)
    return Req(req_id, prompt, **kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Pause:
    req_id: str


@dataclass(frozen=True, slots=True)
class Release:
    """Release a finished ``hold_kv`` request's blocks (the lease was pulled)."""

    req_id: str


STEP = "step"
Script = Sequence[Req | Pause | Release | str]


@dataclass(slots=True)
class Step:
    """What one engine step did."""

    out: SchedulerOutput
    sampling: list[str] = field(default_factory=list)  # ids whose step ends in a sample
    updated: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)

    @property
    def scheduled(self) -> list[tuple[str, int]]:
        return [(s.request.req_id, s.num_new_tokens) for s in self.out.scheduled]


def make_scheduler(
    num_blocks: int = 32,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    long_prefill_token_threshold: int = 0,
    enable_prefix_caching: bool = True,
    proposer: NgramProposer | None = None,
    by_priority: bool = False,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
        by_priority=by_priority,
    )
    kv_cache_manager = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching)
    return Scheduler(config, kv_cache_manager, proposer)


def check_batch(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """Invariants of any step's output, checked before the update."""
    sizes = [s.num_new_tokens for s in out.scheduled]
    assert all(n >= 1 for n in sizes), sizes
    decodes = [s.is_decode for s in out.scheduled]
    assert decodes == sorted(decodes, reverse=True), f"a prefill precedes a decode: {sizes}"
    assert out.total_num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
    assert len(scheduler.running) <= scheduler.config.max_num_seqs
    scheduled_ids = [s.request.req_id for s in out.scheduled]
    assert len(set(scheduled_ids)) == len(scheduled_ids)
    assert not set(scheduled_ids) & set(out.preempted_req_ids)
    for item in out.scheduled:
        request = item.request
        assert request.status is RequestStatus.RUNNING
        assert item.num_new_tokens <= scheduler.config.max_chunk_tokens
        num_real_tokens = item.num_new_tokens - len(item.spec_token_ids)
        assert request.num_computed_tokens + num_real_tokens <= request.num_tokens
        # The blocks handed to the model cover every position it writes this step.
        needed = cdiv(request.num_computed_tokens + item.num_new_tokens, BLOCK_SIZE)
        assert len(item.block_ids) >= needed, (request.req_id, item.block_ids)


def step(scheduler: Scheduler, sampled_token: int = SAMPLED) -> Step:
    """``LLMEngine.step`` with a fake model: one sampled token per request that samples."""
    out = scheduler.schedule()
    check_batch(scheduler, out)
    sampling = [item.request.req_id for item in out.scheduled if item.num_sample_rows]
    updated, finished = scheduler.update_from_output(out, [sampled_token] * len(sampling))
    scheduler.kv_cache_manager.check_integrity()
    return Step(out, sampling, updated, finished)


def run(scheduler: Scheduler, script: Script) -> list[Step]:
    """Play ``script``; return every step's result."""
    steps = []
    for item in script:
        if item == STEP:
            steps.append(step(scheduler))
        elif isinstance(item, Req):
            scheduler.add_request(item.build())
        elif isinstance(item, Pause):
            scheduler.set_paused(item.req_id, True)
        elif isinstance(item, Release):
            assert scheduler.release_held_kv(item.req_id)
        else:
            raise AssertionError(f"unknown script item {item!r}")
    return steps


def ids(requests: Sequence[Request]) -> list[str]:
    return [r.req_id for r in requests]


def num_blocks_held(scheduler: Scheduler) -> int:
    manager = scheduler.kv_cache_manager
    return len({b.block_id for blocks in manager.req_to_blocks.values() for b in blocks})
