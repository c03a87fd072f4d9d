"""The scheduler's policy without a model: a real ``Scheduler`` over a small ``KVCacheManager``,
driven the way ``LLMEngine.step`` drives it (``scheduler_script``).

Every table row is a script of requests to add and steps to run; the tables cover the order of a
step's batch, preemption, the token budget and chunked prefill, stop conditions and aborts
(remote-KV admission: ``test_scheduler_remote_kv``). Every step also checks the pool's and the
batch's invariants.
"""

from __future__ import annotations

from typing import Any

import pytest

from engine.request import RequestStatus
from engine.scheduler import DuplicateRequestError
from tests.engine.scheduler_script import (
    BLOCK_SIZE,
    EOS,
    SAMPLED,
    STEP,
    Pause,
    Script,
    ids,
    make_scheduler,
    num_blocks_held,
    req,
    run,
    step,
    tokens,
)


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
            # The older P is paused: it makes no progress, so it is the victim, not A.
            {"num_blocks": 4},
            [req("P", 8), req("A", 8), STEP, Pause("P"), STEP],
            ["P"],
            [("A", 1)],
            ["A"],
            ["P"],
            id="a-paused-older-request-is-preempted-before-the-newest",
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


@pytest.mark.parametrize(
    ("script", "want_message"),
    [
        pytest.param([req("A", 3)], "in flight", id="waiting"),
        pytest.param([req("A", 3), STEP], "in flight", id="running"),
        pytest.param([req("A", 9, max_tokens=1, hold_kv=True), STEP], "lease", id="held-kv"),
    ],
)
def test_add_request_refuses_an_id_that_is_live_or_holds_kv(
    script: Script, want_message: str
) -> None:
    scheduler = make_scheduler(num_blocks=8)
    run(scheduler, script)
    manager = scheduler.kv_cache_manager
    first = scheduler.requests.get("A") or scheduler.held_kv["A"]
    block_ids = manager.get_block_ids("A")
    with pytest.raises(DuplicateRequestError, match=want_message):
        scheduler.add_request(req("A", (*tokens(2, 8), 1)).build())
    # The refused request took nothing: the first one's place and blocks are intact.
    run(scheduler, [STEP])
    assert (scheduler.requests.get("A") or scheduler.held_kv["A"]) is first
    assert [*scheduler.running, *scheduler.waiting] in ([], [first])
    assert manager.get_block_ids("A")[: len(block_ids)] == block_ids
    # Once the first one is gone (aborted, or its lease released), the id is free again.
    scheduler.finish_requests(["A"], RequestStatus.FINISHED_ABORTED)
    scheduler.release_held_kv("A")
    scheduler.add_request(req("A", 5).build())
    assert ids(scheduler.waiting) == ["A"]


# --------------------------------------------------------------------------------- paused
def test_a_paused_request_gives_its_blocks_to_the_requests_behind_it() -> None:
    # 8 blocks: paused P holds 3, A grows past the 5 left; C arrives later and needs 2.
    scheduler = make_scheduler(num_blocks=8)
    run(scheduler, [req("P", 12), req("A", 16), STEP, Pause("P"), req("C", 5, max_tokens=2)])
    p = scheduler.requests["P"]
    finished: list[str] = []
    for _ in range(200):
        done = step(scheduler)
        assert "P" not in done.sampling
        finished += ids(done.finished)
        if {"A", "C"} <= set(finished):
            break
    assert {"A", "C"} <= set(finished)
    assert p.num_output_tokens == 1 and p.num_preemptions == 1
    assert p.status is RequestStatus.PREEMPTED and ids(scheduler.waiting) == ["P"]
    scheduler.set_paused("P", False)
    while "P" not in ids(step(scheduler).finished):
        pass
    assert p.num_output_tokens == p.sampling_params.max_tokens


def test_a_preempted_paused_request_waits_until_resumed_without_blocking_the_queue() -> None:
    scheduler = make_scheduler(num_blocks=4)
    *_, preempting = run(
        scheduler, [req("A", 8, max_tokens=3), req("P", 8), STEP, Pause("P"), STEP]
    )
    assert preempting.out.preempted_req_ids == ["P"]
    p = scheduler.requests["P"]
    run(scheduler, [req("W", 3, max_tokens=1)])
    finished: list[str] = []
    for _ in range(4):  # A's last token, then W's only one: the blocks are free after that
        done = step(scheduler)
        assert "P" not in done.sampling and not done.out.preempted_req_ids
        finished += ids(done.finished)
    assert finished == ["A", "W"]
    assert p.status is RequestStatus.PREEMPTED and p.output_token_ids == [SAMPLED]
    scheduler.set_paused("P", False)
    readmitted = step(scheduler)
    assert readmitted.sampling == ["P"] and p.num_output_tokens == 2


@pytest.mark.parametrize(
    ("config", "script", "want_scheduled", "want_loading"),
    [
        pytest.param(
            {"max_num_seqs": 2},
            [req("P", 3), req("A", 3), STEP, Pause("P"), req("W", 3), STEP],
            [("A", 1), ("W", 3)],
            [],
            id="a-max-num-seqs-slot",
        ),
        pytest.param(
            # P holds 2 of the 4 blocks and A 1: W needs 2.
            {"num_blocks": 4},
            [req("P", 8), req("A", 3), STEP, Pause("P"), req("W", 8), STEP],
            [("A", 1), ("W", 8)],
            [],
            id="blocks",
        ),
        pytest.param(
            {"num_blocks": 4},
            [req("P", 8), req("A", 3), STEP, Pause("P"), req("R", 9, num_external_tokens=8), STEP],
            [("A", 1)],
            ["R"],
            id="blocks-for-a-kv-load",
        ),
    ],
)
def test_a_paused_running_request_yields_what_a_waiting_one_lacks(
    config: dict[str, Any],
    script: Script,
    want_scheduled: list[tuple[str, int]],
    want_loading: list[str],
) -> None:
    scheduler = make_scheduler(**config)
    last = run(scheduler, script)[-1]
    assert last.out.preempted_req_ids == ["P"]  # never A, newer but making progress
    assert last.scheduled == want_scheduled
    assert list(scheduler.waiting_for_remote_kv) == want_loading
    assert ids(scheduler.waiting) == ["P"]
    assert scheduler.requests["P"].status is RequestStatus.PREEMPTED


# ------------------------------------------------------------------------------------ priority
def test_priority_orders_the_queue_and_keeps_lower_prompts_out_of_a_higher_ones_step() -> None:
    scheduler = make_scheduler(max_num_seqs=2, by_priority=True)
    steps = run(
        scheduler,
        [req("L", 4, priority=5), req("M", 4, priority=3), req("H", 4, priority=0), STEP],
    )
    # H's prompt has its step to itself; then M and L, each in turn.
    assert steps[0].scheduled == [("H", 4)]
    assert ids(scheduler.waiting) == ["M", "L"]
    steps = run(scheduler, [STEP])
    assert steps[0].scheduled == [("H", 1), ("M", 4)]


def test_a_high_priority_arrival_preempts_the_lowest_and_runs_in_the_same_step() -> None:
    scheduler = make_scheduler(max_num_seqs=2, by_priority=True)
    steps = run(
        scheduler,
        [
            req("A", 4, priority=5, max_tokens=30),
            STEP,
            req("B", 4, priority=2, max_tokens=30),
            STEP,
            req("H", 4, priority=0),
            STEP,
        ],
    )
    # A, the lowest, gives H its slot; B runs on.
    assert steps[2].out.preempted_req_ids == ["A"]
    assert steps[2].scheduled == [("B", 1), ("H", 4)]
    assert ids(scheduler.waiting) == ["A"]
    # An arrival of the same priority as every running request waits for a slot.
    steps = run(scheduler, [req("E", 4, priority=2), STEP])
    assert not steps[0].out.preempted_req_ids and "E" in ids(scheduler.waiting)


def test_fcfs_ignores_priority() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    steps = run(scheduler, [req("L", 4, priority=5), req("H", 4, priority=0), STEP, STEP])
    assert steps[0].scheduled == [("L", 4)] and not steps[1].out.preempted_req_ids
