"""The roles a splitserve process plays, and their names on the wire."""

from __future__ import annotations

import enum

from splitserve.v1 import worker_pb2

_TO_PROTO: dict[str, worker_pb2.WorkerRole] = {
    "prefill": worker_pb2.WORKER_ROLE_PREFILL,
    "decode": worker_pb2.WORKER_ROLE_DECODE,
}


class ClusterMode(enum.StrEnum):
    """How a cluster splits a request (``--mode``): a ``str``, as ``Role`` is."""

    # Prefill workers build the KV, decode workers pull it.
    DISAGGREGATED = "disaggregated"
    # Decode workers run whole requests; there is no prefill pool.
    COLOCATED = "colocated"


MODES = tuple(mode.value for mode in ClusterMode)


class Role(enum.StrEnum):
    """Who a party of the cluster is: a process's role (a pool's worker or a router), the
    controller, or a client. Its value is the name used in flags, logs, metrics labels, actor
    names, Kubernetes and the common name of the party's certificate (a ``str``, so it formats
    and serializes as that name)."""

    PREFILL = "prefill"
    DECODE = "decode"
    ROUTER = "router"
    CONTROLLER = "controller"  # the cluster controller (Ray) or the launcher (--no-ray)
    CLIENT = "client"  # a caller from outside the cluster (splitserve client, an application)

    @property
    def is_pool(self) -> bool:
        """A worker pool's role (the router is not a pool: it is replicated, not scaled)."""
        return self in POOL_ROLES

    def to_proto(self) -> worker_pb2.WorkerRole:
        """The ``WorkerRole`` of a pool role; ``ValueError`` for the router."""
        if not self.is_pool:
            raise ValueError(f"{self} has no WorkerRole")
        return _TO_PROTO[self.value]

    @classmethod
    def from_proto(cls, value: int) -> Role:
        """The pool role of a ``WorkerRole``; ``ValueError`` for UNSPECIFIED or unknown values."""
        for name, proto in _TO_PROTO.items():
            if proto == value:
                return cls(name)
        raise ValueError(f"role: must be WORKER_ROLE_PREFILL or WORKER_ROLE_DECODE, got {value}")


POOL_ROLES = (Role.PREFILL, Role.DECODE)
