"""The scheduler's policy without a model: a real ``Scheduler`` over a small ``KVCacheManager``,
driven the way ``LLMEngine.step`` drives it (schedule, fake sampled tokens, update).

Every table row is a script of requests to add and steps to run; the tables cover the order of a
step's batch, preemption, remote-KV admission, the token budget and chunked prefill, stop
conditions and aborts. Every step also checks the pool's and the batch's invariants.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from engine.block_pool import BlockStored
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import KVLoad, Scheduler, SchedulerConfig, SchedulerOutput

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

    def build(self) -> Request:
        return Request(
            req_id=self.req_id,
            prompt_token_ids=list(self.prompt),
            sampling_params=SamplingParams(
                max_tokens=self.max_tokens,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
            ),
            eos_token_ids=frozenset({EOS}),
            block_size=BLOCK_SIZE,
            arrival_time_s=0.0,
            num_external_tokens=self.num_external_tokens,
            hold_kv=self.hold_kv,
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
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
    )
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching))


def check_batch(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """Invariants of any step's output, checked before the update."""
    sizes = [s.num_new_tokens for s in out.scheduled]
    assert all(n >= 1 for n in sizes), sizes
    assert sizes == sorted(sizes, key=lambda n: n > 1), f"a longer item precedes a decode: {sizes}"
    assert out.total_num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
    assert len(scheduler.running) <= scheduler.config.max_num_seqs
    scheduled_ids = [s.request.req_id for s in out.scheduled]
    assert len(set(scheduled_ids)) == len(scheduled_ids)
    assert not set(scheduled_ids) & set(out.preempted_req_ids)
    for item in out.scheduled:
        request = item.request
        assert request.status is RequestStatus.RUNNING
        assert item.num_new_tokens <= scheduler.config.max_chunk_tokens
        assert request.num_computed_tokens + item.num_new_tokens <= request.num_tokens
        # The blocks handed to the model cover every position it writes this step.
        needed = cdiv(request.num_computed_tokens + item.num_new_tokens, BLOCK_SIZE)
        assert len(item.block_ids) >= needed, (request.req_id, item.block_ids)


def step(scheduler: Scheduler, sampled_token: int = SAMPLED) -> Step:
    """``LLMEngine.step`` with a fake model: one sampled token per request that samples."""
    out = scheduler.schedule()
    check_batch(scheduler, out)
    sampling = [item.request.req_id for item in out.scheduled if item.samples]
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


# --------------------------------------------------------------------------------- batch order
@pytest.mark.parametrize(
    ("config", "script", "want_scheduled", "want_running"),
    [
        pytest.param(
            {},
            [req("A", 6), STEP, req("B", 5), STEP],
            [("A", 1), ("B", 5)],
            ["A", "B"],
            id="running-decode-before-waiting-prefill",
        ),
        pytest.param(
            # C is admitted first and still prefilling in chunks when A decodes.
            {"long_prefill_token_threshold": 8},
            [req("C", 20), req("A", 3), STEP, STEP],
            [("A", 1), ("C", 8)],
            ["C", "A"],
            id="decode-before-an-older-running-chunk",
        ),
        pytest.param(
            # B's first 8 tokens are X's cached blocks: only its last token is left, so it is
            # batched with the decodes, ahead of W admitted before it.
            {},
            [
                req("X", tokens(1, 9)),
                STEP,
                req("W", 6),
                req("B", (*tokens(1, 8), 5)),
                STEP,
            ],
            [("X", 1), ("B", 1), ("W", 6)],
            ["X", "W", "B"],
            id="one-token-prefix-hit-admission-counts-as-a-decode",
        ),
    ],
)
def test_decodes_come_before_prefills_in_a_step(
    config: dict[str, int],
    script: Script,
    want_scheduled: list[tuple[str, int]],
    want_running: list[str],
) -> None:
    scheduler = make_scheduler(**config)
    last = run(scheduler, script)[-1]
    assert last.scheduled == want_scheduled
    assert ids(scheduler.running) == want_running
    assert not scheduler.waiting


# --------------------------------------------------------------------------------- preemption
@pytest.mark.parametrize(
    ("config", "script", "want_preempted", "want_scheduled", "want_running", "want_waiting"),
    [
        pytest.param(
            # 4 blocks: A and B hold 2 each; A's decode needs a third one.
            {"num_blocks": 4},
            [req("A", 8), req("B", 8), STEP, req("C", 3), STEP],
            ["B"],
            [("A", 1)],
            ["A"],
            ["B", "C"],
            id="a-decode-preempts-the-newest-running-request",
        ),
        pytest.param(
            # A's second chunk needs 2 more blocks: C, then B are preempted for it and go back
            # to the front of the queue in admission order.
            {"num_blocks": 4, "long_prefill_token_threshold": 8},
            [req("A", 16), req("B", 3), req("C", 3), STEP, req("D", 3), STEP],
            ["C", "B"],
            [("A", 8)],
            ["A"],
            ["B", "C", "D"],
            id="a-chunk-preempts-the-two-newest-in-turn",
        ),
        pytest.param(
            {"num_blocks": 4},
            [req("A", 8), req("P", 8), STEP, Pause("P"), STEP],
            ["P"],
            [("A", 1)],
            ["A"],
            ["P"],
            id="a-paused-request-is-still-a-victim",
        ),
        pytest.param(
            # The older P is paused and keeps its blocks: the newest (A) preempts itself.
            {"num_blocks": 4},
            [req("P", 8), req("A", 8), STEP, Pause("P"), STEP],
            ["A"],
            [],
            ["P"],
            ["A"],
            id="the-newest-preempts-itself-behind-a-paused-older-one",
        ),
        pytest.param(
            # L finished but holds its 2 blocks for a KV pull: A, alone, preempts itself and W
            # is not admitted into the freed blocks.
            {"num_blocks": 4},
            [req("L", 8, max_tokens=1, hold_kv=True), req("A", 8), STEP, req("W", 3), STEP],
            ["A"],
            [],
            [],
            ["A", "W"],
            id="the-only-running-request-preempts-itself-while-a-lease-holds-blocks",
        ),
        pytest.param(
            # Without prefix caching B's first 4-token chunk would fit in the 3 blocks it freed
            # by preempting itself: it still waits for the next step, and W behind it too.
            {"num_blocks": 6, "long_prefill_token_threshold": 4, "enable_prefix_caching": False},
            [req("A", 8), req("B", 16), STEP, STEP, STEP, req("W", 3), STEP],
            ["B"],
            [("A", 1)],
            ["A"],
            ["B", "W"],
            id="a-victim-that-would-fit-again-waits-for-the-next-step",
        ),
    ],
)
def test_preemption_frees_the_newest_and_admits_nothing(
    config: dict[str, Any],
    script: Script,
    want_preempted: list[str],
    want_scheduled: list[tuple[str, int]],
    want_running: list[str],
    want_waiting: list[str],
) -> None:
    scheduler = make_scheduler(**config)
    *_, before, last = run(scheduler, script)
    assert not before.out.preempted_req_ids
    assert last.out.preempted_req_ids == want_preempted
    assert last.scheduled == want_scheduled
    assert ids(scheduler.running) == want_running
    assert ids(scheduler.waiting) == want_waiting  # nothing admitted in the preempting step
    assert scheduler.num_preemptions == len(want_preempted)
    manager = scheduler.kv_cache_manager
    for req_id in want_preempted:
        victim = scheduler.requests[req_id]
        assert victim.status is RequestStatus.PREEMPTED
        assert victim.num_computed_tokens == 0
        assert victim.num_preemptions == 1
        assert req_id not in manager.req_to_blocks
        # Sampled tokens are kept: the recompute covers the prompt and them.
        assert victim.all_token_ids == [*victim.prompt_token_ids, *victim.output_token_ids]
    for req_id in want_waiting:
        if req_id not in want_preempted:
            assert scheduler.requests[req_id].status is RequestStatus.WAITING
            assert req_id not in manager.req_to_blocks
    # Only running requests and leases hold blocks; the victims' are free (or cached) again.
    pool = manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks - num_blocks_held(scheduler)


def test_a_preempted_request_is_recomputed_with_its_outputs_from_its_cached_blocks() -> None:
    scheduler = make_scheduler(num_blocks=4)
    run(scheduler, [req("A", 8, max_tokens=3), req("B", 8), STEP])
    preempting = step(scheduler)
    assert preempting.out.preempted_req_ids == ["B"]
    b = scheduler.requests["B"]
    assert b.output_token_ids == [SAMPLED]
    # While A runs, B's one surviving cached block would leave no room for the rest: it waits.
    # A finishes (max_tokens=3) in this step.
    waiting = step(scheduler)
    assert waiting.scheduled == [("A", 1)] and ids(waiting.finished) == ["A"]
    assert b.status is RequestStatus.PREEMPTED
    # B then re-enters from its first block, still cached, and recomputes the rest of its
    # prompt plus the token it had sampled, sampling its next one.
    readmitted = step(scheduler)
    assert readmitted.scheduled == [("B", 9 - BLOCK_SIZE)]
    assert b.status is RequestStatus.RUNNING and b.num_computed_tokens == 9
    assert b.output_token_ids == [SAMPLED, SAMPLED]
    assert b.num_cached_tokens == 0  # what the client is told: the hits of its first admission


# --------------------------------------------------------------------------------- remote KV
@dataclass(frozen=True, slots=True)
class RemoteCase:
    cached_tokens: int  # the prompt's leading tokens already in the local prefix cache
    prompt_len: int
    num_external_tokens: int
    want_local_hit_tokens: int
    want_new_blocks: int
    enable_prefix_caching: bool = True


SHARED = tokens(9, 16)


def admit_remote(case: RemoteCase, num_blocks: int = 16) -> tuple[Scheduler, Request, Step]:
    """Warm the local cache with ``cached_tokens`` of SHARED, then admit a remote-KV request."""
    scheduler = make_scheduler(num_blocks, enable_prefix_caching=case.enable_prefix_caching)
    if case.cached_tokens:
        warm = req("warm", (*SHARED[: case.cached_tokens], 1), max_tokens=1)
        (warmed,) = run(scheduler, [warm, STEP])
        assert ids(warmed.finished) == ["warm"]
    scheduler.kv_cache_manager.take_events()
    remote = req("R", SHARED[: case.prompt_len], num_external_tokens=case.num_external_tokens)
    admitting = run(scheduler, [remote, STEP])[-1]
    return scheduler, scheduler.requests["R"], admitting


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(RemoteCase(0, 10, 8, 0, 2), id="nothing-cached-pulls-every-block"),
        pytest.param(RemoteCase(4, 10, 8, 4, 1), id="a-cached-block-is-not-pulled"),
        pytest.param(RemoteCase(8, 10, 8, 8, 0), id="every-external-block-cached-pulls-none"),
        pytest.param(RemoteCase(0, 10, 6, 0, 2), id="a-partial-last-external-block"),
        pytest.param(RemoteCase(4, 10, 6, 4, 1), id="a-cached-block-then-a-partial-one"),
        pytest.param(RemoteCase(8, 10, 8, 0, 2, False), id="prefix-caching-off-pulls-all"),
    ],
)
def test_remote_kv_admission_allocates_only_what_the_local_cache_lacks(case: RemoteCase) -> None:
    scheduler, remote, admitting = admit_remote(case)
    manager = scheduler.kv_cache_manager
    block_ids = manager.get_block_ids("R")
    hit_blocks = case.want_local_hit_tokens // BLOCK_SIZE
    assert admitting.out.kv_loads == [
        KVLoad("R", block_ids, case.want_local_hit_tokens, case.num_external_tokens)
    ]
    assert admitting.scheduled == []  # nothing to compute until the KV arrives
    assert len(block_ids) == cdiv(case.num_external_tokens, BLOCK_SIZE)
    assert len(block_ids) - hit_blocks == case.want_new_blocks
    cached_ids = [
        block.block_id
        for h in remote.block_hashes[:hit_blocks]
        if (block := manager.block_pool.get_cached_block(h)) is not None
    ]
    assert block_ids[:hit_blocks] == cached_ids
    assert manager.block_pool.num_free_blocks == manager.block_pool.num_blocks - len(block_ids)
    # The blocks still to be filled are not published for prefix hits before they are.
    assert not [e for e in manager.take_events() if isinstance(e, BlockStored)]
    assert remote.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert remote.num_computed_tokens == case.want_local_hit_tokens
    assert list(scheduler.waiting_for_remote_kv) == ["R"]
    assert not scheduler.waiting and not scheduler.running


@pytest.mark.parametrize(
    ("case", "success", "want_computed", "want_published"),
    [
        pytest.param(RemoteCase(0, 10, 8, 0, 2), True, 8, 2, id="arrived"),
        pytest.param(RemoteCase(0, 10, 8, 0, 2), False, 0, 0, id="failed-recomputes-all"),
        pytest.param(RemoteCase(4, 10, 8, 4, 1), True, 8, 1, id="arrived-after-a-local-hit"),
        pytest.param(RemoteCase(4, 10, 8, 4, 1), False, 4, 0, id="failed-keeps-the-local-hit"),
    ],
)
def test_finished_remote_kv_requeues_the_request_at_the_front(
    case: RemoteCase, success: bool, want_computed: int, want_published: int
) -> None:
    scheduler, remote, _ = admit_remote(case)
    manager = scheduler.kv_cache_manager
    scheduler.add_request(req("N", 3).build())  # queued behind it
    scheduler.finish_remote_kv("R", success)
    assert remote.status is RequestStatus.WAITING
    assert ids(scheduler.waiting) == ["R", "N"] and not scheduler.waiting_for_remote_kv
    assert remote.num_computed_tokens == remote.num_cached_tokens == want_computed
    assert remote.num_external_tokens == 0
    published = [
        h for e in manager.take_events() if isinstance(e, BlockStored) for h in e.block_hashes
    ]
    assert (
        published
        == remote.block_hashes[case.want_local_hit_tokens // BLOCK_SIZE :][:want_published]
    )
    computing = step(scheduler)
    assert computing.scheduled == [("R", case.prompt_len - want_computed), ("N", 3)]
    assert remote.output_token_ids == [SAMPLED]
    scheduler.finish_remote_kv("R", success)  # a second report is ignored
    assert remote.status is RequestStatus.RUNNING


@pytest.mark.parametrize(
    ("num_blocks", "want_scheduled", "want_loads", "want_waiting"),
    [
        pytest.param(16, [("B", 5)], ["R"], [], id="waiting-for-kv-does-not-block-the-queue"),
        # R needs 2 blocks, 1 is free: B (which would fit) waits behind it.
        pytest.param(3, [], [], ["R", "B"], id="a-remote-request-without-blocks-blocks-the-queue"),
    ],
)
def test_remote_kv_admission_and_the_queue_behind_it(
    num_blocks: int,
    want_scheduled: list[tuple[str, int]],
    want_loads: list[str],
    want_waiting: list[str],
) -> None:
    scheduler = make_scheduler(num_blocks)
    run(scheduler, [req("X", 7, max_tokens=16), STEP])  # holds 2 blocks
    admitting = run(scheduler, [req("R", 10, num_external_tokens=8), req("B", 5), STEP])[-1]
    assert admitting.scheduled == [("X", 1), *want_scheduled]
    assert [load.req_id for load in admitting.out.kv_loads] == want_loads
    assert ids(scheduler.waiting) == want_waiting


def test_requests_waiting_for_kv_do_not_count_against_max_num_seqs() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    remotes = [req(f"R{i}", tokens(i, 6), num_external_tokens=4) for i in range(3)]
    admitting = run(scheduler, [*remotes, req("B", 3), STEP])[-1]
    assert [load.req_id for load in admitting.out.kv_loads] == ["R0", "R1", "R2"]
    assert admitting.scheduled == [("B", 3)]
    for load in admitting.out.kv_loads:
        scheduler.finish_remote_kv(load.req_id, True)
    # Back in the queue they wait for a running slot like any request.
    assert step(scheduler).scheduled == [("B", 1)]
    assert sorted(ids(scheduler.waiting)) == ["R0", "R1", "R2"]


# --------------------------------------------------------------------------------- budget
@pytest.mark.parametrize(
    ("config", "script", "want_steps"),
    [
        pytest.param(
            {"max_num_batched_tokens": 8},
            [req("A", 20), STEP, STEP, STEP, STEP],
            [[("A", 8)], [("A", 8)], [("A", 4)], [("A", 1)]],
            id="the-step-budget-chunks-a-long-prompt",
        ),
        pytest.param(
            {"max_num_batched_tokens": 32, "long_prefill_token_threshold": 4},
            [req("A", 10), req("B", 6), STEP, STEP, STEP],
            [[("A", 4), ("B", 4)], [("A", 4), ("B", 2)], [("B", 1), ("A", 2)]],
            id="the-long-prefill-threshold-caps-each-request",
        ),
        pytest.param(
            {"max_num_batched_tokens": 10},
            [req("A", 6), req("B", 6), STEP, STEP],
            [[("A", 6), ("B", 4)], [("A", 1), ("B", 2)]],
            id="admission-takes-what-the-budget-leaves",
        ),
        pytest.param(
            {"max_num_batched_tokens": 6},
            [req("A", 6), req("B", 3), STEP, STEP],
            [[("A", 6)], [("A", 1), ("B", 3)]],
            id="a-spent-budget-admits-nothing",
        ),
        pytest.param(
            {"max_num_seqs": 2},
            [req("A", 3), req("B", 3), req("C", 3), STEP, STEP],
            [[("A", 3), ("B", 3)], [("A", 1), ("B", 1)]],
            id="max-num-seqs-caps-the-running-batch",
        ),
        pytest.param(
            # W caches 2 blocks; B shares them and only its 4 own tokens count.
            {"max_num_batched_tokens": 4},
            [
                req("W", (*tokens(1, 8), 1), max_tokens=1),
                STEP,
                STEP,
                STEP,
                req("B", (*tokens(1, 8), *tokens(2, 4))),
                STEP,
            ],
            [[("W", 4)], [("W", 4)], [("W", 1)], [("B", 4)]],
            id="prefix-hits-cost-no-budget",
        ),
    ],
)
def test_token_budget_and_chunked_prefill(
    config: dict[str, int], script: Script, want_steps: list[list[tuple[str, int]]]
) -> None:
    scheduler = make_scheduler(**config)
    steps = run(scheduler, script)
    assert [s.scheduled for s in steps] == want_steps


def test_chunks_sample_only_at_the_end_of_the_prompt() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    run(scheduler, [req("A", 20)])
    a = scheduler.requests["A"]
    computed = []
    for _ in range(3):
        step(scheduler)
        computed.append((a.num_computed_tokens, a.num_output_tokens))
    assert computed == [(8, 0), (16, 0), (20, 1)]


# --------------------------------------------------------------------------------- stops
@pytest.mark.parametrize(
    ("request_kwargs", "sampled", "want_status", "want_stop_reason"),
    [
        pytest.param({}, EOS, RequestStatus.FINISHED_STOPPED, EOS, id="eos"),
        pytest.param({"ignore_eos": True}, EOS, RequestStatus.RUNNING, None, id="ignored-eos"),
        pytest.param(
            {"stop_token_ids": (9,)}, 9, RequestStatus.FINISHED_STOPPED, 9, id="stop-token-id"
        ),
        pytest.param(
            {"ignore_eos": True, "stop_token_ids": (EOS,)},
            EOS,
            RequestStatus.FINISHED_STOPPED,
            EOS,
            id="stop-id-despite-ignore-eos",
        ),
        pytest.param({"max_tokens": 1}, SAMPLED, RequestStatus.FINISHED_LENGTH_CAPPED, None,
                     id="max-tokens"),
        pytest.param({}, SAMPLED, RequestStatus.RUNNING, None, id="goes-on"),
    ],
)  # fmt: skip
def test_stop_conditions(
    request_kwargs: dict[str, object],
    sampled: int,
    want_status: RequestStatus,
    want_stop_reason: int | None,
) -> None:
    scheduler = make_scheduler()
    scheduler.add_request(req("A", 5, **request_kwargs).build())
    done = step(scheduler, sampled_token=sampled)
    a = done.updated[0]
    assert (a.status, a.stop_reason, a.output_token_ids) == (
        want_status,
        want_stop_reason,
        [sampled],
    )
    finished = want_status.is_finished
    assert ids(done.finished) == (["A"] if finished else [])
    assert ("A" in scheduler.requests) is not finished
    assert ("A" in scheduler.kv_cache_manager.req_to_blocks) is not finished


def test_max_model_len_caps_the_length() -> None:
    scheduler = make_scheduler(max_model_len=8)
    scheduler.add_request(req("A", 6).build())
    first, second = step(scheduler), step(scheduler)
    assert first.finished == [] and ids(second.finished) == ["A"]
    assert second.finished[0].status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert second.finished[0].num_tokens == 8


def test_hold_kv_keeps_the_blocks_until_released() -> None:
    scheduler = make_scheduler(num_blocks=8)
    (done,) = run(scheduler, [req("L", 9, max_tokens=1, hold_kv=True), STEP])
    assert ids(done.finished) == ["L"] and list(scheduler.held_kv) == ["L"]
    pool = scheduler.kv_cache_manager.block_pool
    held = scheduler.kv_cache_manager.get_block_ids("L")
    assert len(held) == 3 and pool.num_free_blocks == 8 - 3
    assert scheduler.release_held_kv("L") and pool.num_free_blocks == 8
    assert not scheduler.release_held_kv("L")


# --------------------------------------------------------------------------------- aborts
@pytest.mark.parametrize(
    ("script", "state"),
    [
        pytest.param([req("A", 6)], RequestStatus.WAITING, id="waiting"),
        pytest.param([req("A", 6), STEP], RequestStatus.RUNNING, id="running"),
        pytest.param(
            [req("A", 10, num_external_tokens=8), STEP],
            RequestStatus.WAITING_FOR_REMOTE_KV,
            id="waiting-for-kv",
        ),
        pytest.param(
            [req("B", 8), req("A", 8), STEP, STEP], RequestStatus.PREEMPTED, id="preempted"
        ),
        pytest.param(
            [req("A", 6, hold_kv=True), STEP], RequestStatus.RUNNING, id="running-with-hold-kv"
        ),
    ],
)
def test_abort_in_any_state_frees_every_block(script: Script, state: RequestStatus) -> None:
    scheduler = make_scheduler(num_blocks=4)
    run(scheduler, script)
    a = scheduler.requests["A"]
    assert a.status is state
    (aborted,) = scheduler.finish_requests(["A", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert aborted is a and a.status is RequestStatus.FINISHED_ABORTED
    assert "A" not in scheduler.requests and "A" not in scheduler.held_kv
    assert a not in scheduler.running and a not in scheduler.waiting
    assert "A" not in scheduler.waiting_for_remote_kv
    assert "A" not in scheduler.kv_cache_manager.req_to_blocks
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks - num_blocks_held(scheduler)
    assert scheduler.finish_requests(["A"], RequestStatus.FINISHED_ABORTED) == []
    scheduler.kv_cache_manager.check_integrity()


@pytest.mark.parametrize(
    ("status", "want_still_cached"),
    [
        pytest.param(RequestStatus.FINISHED_ABORTED, True, id="abort-keeps-the-prefix"),
        pytest.param(RequestStatus.FINISHED_ERROR, False, id="error-withdraws-the-prefix"),
    ],
)
def test_a_failed_request_withdraws_the_blocks_it_computed(
    status: RequestStatus, want_still_cached: bool
) -> None:
    scheduler = make_scheduler()
    run(scheduler, [req("W", (*tokens(1, 4), 1), max_tokens=1), STEP])  # caches tokens(1, 4)
    run(scheduler, [req("A", (*tokens(1, 8), 1)), STEP])  # hits 1 block, computes 1 more
    a = scheduler.requests["A"]
    assert a.num_cached_tokens == BLOCK_SIZE
    first, second = a.block_hashes[:2]
    scheduler.finish_requests(["A"], status)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_cached_block(first) is not None  # W's block is not A's to withdraw
    assert (pool.get_cached_block(second) is not None) is want_still_cached


# --------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("prompt_len", "num_external_tokens"),
    [
        pytest.param(4, 4, id="external-covers-the-whole-prompt"),
        pytest.param(4, -1, id="negative-external"),
    ],
)
def test_add_request_needs_a_token_to_compute(prompt_len: int, num_external_tokens: int) -> None:
    scheduler = make_scheduler()
    with pytest.raises(ValueError, match="num_external_tokens"):
        scheduler.add_request(req("A", prompt_len, num_external_tokens=num_external_tokens).build())


def test_add_request_rejects_a_duplicate_id() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(req("A", 3).build())
    with pytest.raises(ValueError, match="duplicate"):
        scheduler.add_request(req("A", 3).build())
