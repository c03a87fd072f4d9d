"""``Role``: one name per role, and the pool roles' WorkerRole on the wire."""

from __future__ import annotations

import pytest

from services.common.roles import POOL_ROLES, Role
from splitserve.v1 import worker_pb2


@pytest.mark.parametrize(
    ("role", "proto"),
    [(Role.PREFILL, worker_pb2.WORKER_ROLE_PREFILL), (Role.DECODE, worker_pb2.WORKER_ROLE_DECODE)],
)
def test_pool_roles_round_trip_through_the_proto(role, proto):
    assert role.is_pool and role in POOL_ROLES
    assert role.to_proto() == proto
    assert Role.from_proto(proto) is role


def test_the_router_is_not_a_pool():
    assert not Role.ROUTER.is_pool and Role.ROUTER not in POOL_ROLES
    with pytest.raises(ValueError, match="router has no WorkerRole"):
        Role.ROUTER.to_proto()


@pytest.mark.parametrize("value", [worker_pb2.WORKER_ROLE_UNSPECIFIED, 99])
def test_unknown_proto_values_are_refused_by_name(value):
    with pytest.raises(ValueError, match="WORKER_ROLE_PREFILL or WORKER_ROLE_DECODE"):
        Role.from_proto(value)


def test_a_role_formats_as_its_name():
    assert f"{Role.DECODE} worker" == "decode worker"
    assert Role("prefill") is Role.PREFILL
