"""The scheduler's remote-KV admission without a model (see ``test_scheduler``): a request whose
leading tokens arrive by transfer allocates only what the local cache lacks, waits off the
running batch, and is requeued once its KV has arrived (or failed): behind preempted requests and
earlier arrivals, ahead of new requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine.block_pool import BlockStored
from engine.kv_cache_manager import cdiv
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from engine.scheduler_output import KVLoad
from tests.engine.scheduler_script import (
    BLOCK_SIZE,
    SAMPLED,
    STEP,
    Step,
    ids,
    make_scheduler,
    req,
    run,
    step,
    tokens,
)


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
    assert ids(scheduler.waiting) == ["R0", "R1", "R2"]


def test_arrived_kv_queues_in_arrival_order_behind_preempted_and_ahead_of_new_requests() -> None:
    # 6 blocks: R0-R2 take 1 each for their loads, A 2, B 1; A's next decode preempts B.
    scheduler = make_scheduler(num_blocks=6)
    remotes = [req(f"R{i}", tokens(i, 5), num_external_tokens=4) for i in range(3)]
    run(scheduler, [*remotes, req("A", 8), req("B", 3), STEP])
    preempting = run(scheduler, [STEP, req("N", 3)])[-1]
    assert preempting.out.preempted_req_ids == ["B"]
    for req_id in ("R0", "R1", "R2"):
        scheduler.finish_remote_kv(req_id, True)
        assert ids(scheduler.waiting)[-1] == "N"
    assert ids(scheduler.waiting) == ["B", "R0", "R1", "R2", "N"]


def test_requests_whose_kv_arrived_never_hold_the_cache_between_them() -> None:
    """With nothing running, two requests whose KV arrived each hold part of the cache and need
    more than is left: the newest one's blocks are freed (it finds them again, or computes
    them) and the older runs; both finish."""
    # 5 blocks of 4: each load takes 2, each prompt needs 2 more for its last 8 tokens, 1 is
    # left; a prompt and its 2-token reply fit in the 5.
    scheduler = make_scheduler(num_blocks=5)
    remotes = [
        req(f"R{i}", tokens(10 * i, 16), num_external_tokens=8, max_tokens=2) for i in range(2)
    ]
    admitting = run(scheduler, [*remotes, STEP])[-1]
    assert [load.req_id for load in admitting.out.kv_loads] == ["R0", "R1"]
    for req_id in ("R0", "R1"):
        scheduler.finish_remote_kv(req_id, True)
    unblocked = step(scheduler)
    assert unblocked.out.preempted_req_ids == ["R1"]
    assert unblocked.scheduled == [("R0", 8)]
    assert ids(scheduler.waiting) == ["R1"] and scheduler.requests["R1"].num_computed_tokens == 0
    finished: list[str] = []
    for _ in range(64):
        finished += ids(step(scheduler).finished)
        if not (scheduler.running or scheduler.waiting):
            break
    assert sorted(finished) == ["R0", "R1"]
