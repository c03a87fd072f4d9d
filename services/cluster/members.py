"""The controller's bookkeeping of its actors (one ``Member`` each, one ``Pool`` per role) and
the choice of workers to remove.

Torch- and Ray-free so that the rules are plain functions: a member moves
``STARTING -> READY -> DRAINING -> (removed)``; a dead one is removed from any state.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.roles import Role
from services.router.scaler import PoolSize
from splitserve.v1 import worker_pb2

_MAX_START_BACKOFF_S = 30.0

# A pool's key: (served model, role); the routers' is ("", router).
PoolKey = tuple[str, Role]


class MemberState(enum.StrEnum):
    """Where a member is in its life; a ``str`` (its value), as ``Role`` is, so that
    ``members()`` and logs show the name."""

    STARTING = "starting"  # actor created, service loading; not routable
    READY = "ready"  # serving; routable
    DRAINING = "draining"  # routers send it nothing new; removed once idle


@dataclass(slots=True, eq=False)
class Member:
    """One actor of a pool (or a router) as the controller tracks it."""

    name: str
    role: Role
    actor: Any  # ray.actor.ActorHandle
    slot: int = 0  # routers: which port (--port + slot) it serves on
    model: str = ""  # workers: the served model whose pool it is in
    state: MemberState = MemberState.STARTING
    address: str = ""
    metrics_port: int = 0
    pid: int = 0
    hostname: str = ""  # its pod on Kubernetes
    num_missed_pings: int = 0  # in a row; a hung actor is replaced after a few
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def live(self) -> bool:
        """Counts toward the pool's size (a draining member is on its way out)."""
        return self.state is not MemberState.DRAINING

    def view(self) -> MemberView:
        return MemberView(
            self.name,
            self.role,
            self.state,
            self.address,
            self.metrics_port,
            self.pid,
            self.hostname,
            self.model,
        )


@dataclass(frozen=True, slots=True)
class MemberView:
    """One actor as the controller's ``members`` reports it."""

    name: str
    role: Role
    state: MemberState
    address: str
    metrics_port: int
    pid: int
    hostname: str
    model: str = ""


def busy_units(load: worker_pb2.WorkerLoad, num_router_inflight: int) -> int:
    """What a worker still has to finish before it can be removed: requests it runs or
    queues, KV waiting to arrive or to be pulled from it, and calls routers have open on it."""
    return (
        load.num_running
        + load.num_waiting
        + load.num_waiting_for_kv
        + load.num_kv_leases
        + num_router_inflight
    )


def pick_victims(members: Sequence[Member], busy: dict[str, int], count: int) -> list[Member]:
    """The ``count`` live members to remove: still-starting ones first (nothing to drain, the
    newest first), then ready ones with the least work in ``busy`` (by name; newest first on
    ties, so long-running workers keep their warm prefix caches)."""
    starting = [m for m in members if m.state is MemberState.STARTING]
    ready = [m for m in members if m.state is MemberState.READY]
    order = {id(m): i for i, m in enumerate(members)}
    starting.sort(key=lambda m: -order[id(m)])
    ready.sort(key=lambda m: (busy.get(m.name, 0), -order[id(m)]))
    return (starting + ready)[:count]


@dataclass(slots=True, eq=False)
class Pool:
    """One model's pool of one role (or the router replicas, of no model) and what the
    controller knows of it: its desired size, restarts, and the failed starts since one
    succeeded.

    Invariant: ``members`` are in the order they were launched; a removed member is in none.
    """

    role: Role
    desired: int
    members: list[Member] = field(default_factory=list)
    model: str = ""
    num_restarts: int = 0  # ready members that died or hung and were replaced
    num_failed_starts: int = 0  # in a row; 0 once a start succeeds or the pool is at its size
    retry_at_s: float = 0.0  # no new start before (the event loop's clock): backoff
    last_error: str = ""  # of the last failed start; "" once one succeeds
    # Why some live members cannot be placed now (no node has room), "" when all can: the
    # status reports it before the last failed start (it is why the pool is short now).
    shortage: str = ""

    def ready(self) -> list[Member]:
        return [m for m in self.members if m.state is MemberState.READY]

    def live(self) -> list[Member]:
        return [m for m in self.members if m.live]

    def forget(self, member: Member) -> None:
        """Drop ``member`` (if still here)."""
        if member in self.members:
            self.members.remove(member)

    def start_succeeded(self) -> None:
        self.num_failed_starts = 0
        self.last_error = ""

    def start_failed(self, error: str, now_s: float) -> float:
        """A start failed with ``error`` at ``now_s`` (the event loop's clock): the next waits
        a backoff that doubles with each failure in a row, up to ``_MAX_START_BACKOFF_S``.
        Returns the backoff."""
        self.num_failed_starts += 1
        backoff_s = min(2.0 ** (self.num_failed_starts - 1), _MAX_START_BACKOFF_S)
        self.retry_at_s = now_s + backoff_s
        self.last_error = error
        return backoff_s

    def note_shortage(self, num_slots: int) -> None:
        """Say, in the pool's status, when its live members outnumber the ``num_slots`` the
        Ray cluster's live nodes offer its role (those beyond wait for a node)."""
        resource = self.role.value
        num_live = len(self.live())
        self.shortage = (
            f"{num_live - num_slots} of {num_live} workers wait for a node: the Ray "
            f"cluster's live nodes offer {num_slots} '{resource}' slots (a node started "
            f"with --resources='{{\"{resource}\": 1}}' adds one)"
            if num_live > num_slots
            else ""
        )

    def size(self) -> PoolSize:
        states = [m.state for m in self.members]
        return PoolSize(
            model=self.model,
            role=self.role,
            desired_workers=self.desired,
            num_ready=states.count(MemberState.READY),
            num_starting=states.count(MemberState.STARTING),
            num_draining=states.count(MemberState.DRAINING),
            num_restarts=self.num_restarts,
            last_error=self.shortage or self.last_error,
            num_failed_starts=self.num_failed_starts,
        )
