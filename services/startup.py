"""Why a cluster does not serve yet, for ``splitserve up`` and every command that talks to it.

Orchestrators report each worker that fails to start as a ``WorkerFailure`` (the Ray controller,
``services.cluster.controller``; the process launcher of ``--no-ray``, ``services.launcher``),
which ``splitserve up`` prints on its console. Clients learn the same through ``Router.Status``:
each pool's size and last start error (``PoolStatus.last_error``) under an orchestrator, or each
worker's last error in a fixed cluster. ``splitserve client``, ``loadtest``, ``status`` and
``scale`` all wait with ``wait_for_cluster``, bounded by their own timeout, and say why in one
line on stderr that changes only when the reason does (``WaitMessages``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

import grpc

from services.common.roles import Role
from splitserve.v1 import router_pb2, router_pb2_grpc, worker_pb2

_POLL_S = 0.5
_STATUS_TIMEOUT_S = 10.0
# Decode first: without a decode worker nothing is served (prefill is optional).
_ROLE_ORDER = (Role.DECODE.to_proto(), Role.PREFILL.to_proto())

# Why a Status reply is not what a command waits for (None: it is).
WhyNot = Callable[[router_pb2.StatusResponse], str | None]


@dataclass(frozen=True, slots=True)
class WorkerFailure:
    """A worker (or router) that failed to start, or exited, as its orchestrator reports it."""

    role: Role
    worker: str  # the actor's name (Ray) or the process's address (--no-ray)
    error: str  # the error's last line
    attempt: int  # failed starts of this pool in a row (1: the first since one served)
    retry_in_s: float | None  # when the next start is tried; None: never (no orchestrator)
    # It had served and then exited (its engine died, it was killed): it is being restarted.
    restarting: bool = False


class FailureLog:
    """The last ``keep`` failures and how many there were in all, so that a reader that polls
    with the count it has seen (``since``) gets each failure once."""

    def __init__(self, keep: int) -> None:
        self._failures: deque[WorkerFailure] = deque(maxlen=keep)
        self._num_failures = 0

    def add(self, failure: WorkerFailure) -> None:
        self._failures.append(failure)
        self._num_failures += 1

    def since(self, after: int) -> tuple[int, list[WorkerFailure]]:
        """How many failures there were in all, and those after the first ``after`` (at most
        the last ``keep``), oldest first."""
        missed = min(self._num_failures - after, len(self._failures))
        return self._num_failures, list(self._failures)[len(self._failures) - missed :]


class ClusterNotReady(Exception):
    """A command's deadline passed before the cluster was ready; the message says why."""


def last_line(text: str) -> str:
    """The last non-blank line of ``text``, stripped ('' if there is none)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def describe_pool(pool: router_pb2.PoolStatus, with_model: bool = False) -> str | None:
    """What keeps an orchestrated pool from its size, or None when it is at its size (named
    with its model when ``with_model``: a cluster of several). Stable while nothing changes:
    no counter that ticks with every retry."""
    role = Role.from_proto(pool.role)
    name = f"{pool.model} {role}" if with_model else str(role)
    parts = [f"{name} pool: {pool.num_ready}/{pool.desired_workers} ready"]
    if pool.num_draining:
        parts.append(f"{pool.num_draining} draining")
    if pool.last_error:
        parts.append(f"failing to start (retrying): {pool.last_error}")
    elif pool.num_ready < pool.desired_workers:
        parts.append("starting")
    return ", ".join(parts) if len(parts) > 1 else None


def cluster_problems(status: router_pb2.StatusResponse) -> list[str]:
    """Every pool (orchestrated cluster) or worker (fixed cluster) that does not serve as it
    should, decode first."""
    if status.pools:
        pools = sorted(status.pools, key=lambda p: _ROLE_ORDER.index(p.role))
        several = len(status.models) > 1
        return [text for p in pools if (text := describe_pool(p, several)) is not None]
    workers = sorted(status.workers, key=lambda w: _ROLE_ORDER.index(w.role))
    return [
        f"{Role.from_proto(w.role)} worker {w.address}: {w.last_error or 'not answering yet'}"
        for w in workers
        if not w.healthy
    ]


def why_not_serving(status: router_pb2.StatusResponse) -> str | None:
    """Why the router cannot take a request yet (None: a decode worker serves)."""
    if any(
        w.role == Role.DECODE.to_proto() and w.healthy and not w.draining for w in status.workers
    ):
        return None
    return "; ".join(["no decode worker is ready yet", *cluster_problems(status)])


def why_pool_not_at_size(role: worker_pb2.WorkerRole, model: str = "") -> WhyNot:
    """For ``splitserve scale --wait``: why ``model``'s ``role`` pool (empty: the router's
    ``--model``'s) is not at its size with every worker ready and none draining."""

    def why_not(status: router_pb2.StatusResponse) -> str | None:
        name = model or status.model
        pool = next((p for p in status.pools if p.role == role and p.model == name), None)
        if pool is None:
            return f"the router reports no {name} {Role.from_proto(role)} pool"
        return describe_pool(pool, len(status.models) > 1)

    return why_not


def router_answers(status: router_pb2.StatusResponse) -> str | None:
    """For commands that only need the router: any Status reply will do."""
    return None


class WaitMessages:
    """The one line a waiting command shows on ``stream``, written again only when the reason
    changes (a new line each time: ``stream`` need not be a terminal)."""

    def __init__(self, stream: TextIO, prefix: str = "waiting for the cluster") -> None:
        self._stream = stream
        self._prefix = prefix
        self._shown = ""

    def show(self, reason: str) -> None:
        if reason != self._shown:
            self._shown = reason
            self._stream.write(f"{self._prefix}: {reason}\n")
            self._stream.flush()


def wait_for_cluster(
    stub: router_pb2_grpc.RouterStub,
    target: str,
    deadline_s: float,
    messages: WaitMessages,
    why_not: WhyNot = why_not_serving,
) -> router_pb2.StatusResponse:
    """Poll ``Router.Status`` at ``target`` until ``why_not`` accepts a reply, and return it.

    A router that does not answer yet is waited for too. Each reason to wait goes to
    ``messages``; ``ClusterNotReady`` (with the last reason) once ``deadline_s``
    (``time.monotonic()``) passes. Errors other than an unreachable router propagate.
    """
    while True:
        remaining_s = deadline_s - time.monotonic()
        try:
            status = stub.Status(
                router_pb2.StatusRequest(), timeout=max(min(remaining_s, _STATUS_TIMEOUT_S), 0.01)
            )
        except grpc.RpcError as exc:
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            reason = f"no router answers at {target} yet"
        else:
            why = why_not(status)
            if why is None:
                return status
            reason = why
        if time.monotonic() + _POLL_S > deadline_s:
            raise ClusterNotReady(reason)
        messages.show(reason)
        time.sleep(_POLL_S)
