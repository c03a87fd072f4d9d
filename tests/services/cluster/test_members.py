"""The controller's choice of workers to remove, and the sizes it reports."""

from __future__ import annotations

from services.cluster.members import Member, MemberState, Pool, busy_units, pick_victims
from services.common.roles import Role
from splitserve.v1 import worker_pb2


def members(*states: MemberState) -> list[Member]:
    return [Member(f"w{i}", Role.DECODE, actor=None, state=s) for i, s in enumerate(states)]


def test_starting_workers_go_first_newest_first():
    pool = members(MemberState.READY, MemberState.STARTING, MemberState.STARTING)
    victims = pick_victims(pool, {"w0": 0}, 2)
    assert [m.name for m in victims] == ["w2", "w1"]


def test_ready_workers_with_the_least_work_go_next_newest_first_on_ties():
    pool = members(MemberState.READY, MemberState.READY, MemberState.READY, MemberState.READY)
    busy = {"w0": 0, "w1": 5, "w2": 0, "w3": 1}
    assert [m.name for m in pick_victims(pool, busy, 3)] == ["w2", "w0", "w3"]


def test_busy_units_count_requests_kv_and_router_calls():
    load = worker_pb2.WorkerLoad(
        num_running=1, num_waiting=2, num_waiting_for_kv=3, num_kv_leases=4, num_cached_blocks=99
    )
    assert busy_units(load, num_router_inflight=5) == 15
    assert busy_units(worker_pb2.WorkerLoad(num_cached_blocks=99), 0) == 0


def test_pool_size_counts_states():
    pool = members(MemberState.READY, MemberState.STARTING, MemberState.DRAINING)
    size = Pool(Role.DECODE, 2, pool, num_restarts=3).size()
    assert (size.num_ready, size.num_starting, size.num_draining) == (1, 1, 1)
    assert (size.desired_workers, size.num_restarts) == (2, 3)
    assert [m.live for m in pool] == [True, True, False]
