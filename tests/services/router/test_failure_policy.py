"""Which worker failures the router retries: statuses and the worker's own failure marks."""

from __future__ import annotations

import grpc
import pytest

from services.common.failures import FAILURE_KEY, FailureKind
from services.router.failure_policy import FailurePolicy


def error(code: grpc.StatusCode, kind: FailureKind | None = None) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata() if kind is None else grpc.aio.Metadata((FAILURE_KEY, kind.value))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=f"{code.name} here")


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
    ],
)
def test_a_worker_that_went_away_is_retried(code):
    assert FailurePolicy().judge(error(code), "decode") is None


def test_a_rejected_or_self_failed_request_is_not_retried():
    policy = FailurePolicy()
    invalid = policy.judge(error(grpc.StatusCode.INVALID_ARGUMENT), "decode")
    assert invalid is not None and invalid.code == grpc.StatusCode.INVALID_ARGUMENT
    failed = policy.judge(error(grpc.StatusCode.INTERNAL, FailureKind.REQUEST), "decode")
    assert failed is not None
    assert (failed.code, failed.details) == (grpc.StatusCode.INTERNAL, "INTERNAL here")


def test_only_the_router_s_own_deadline_is_retried():
    policy = FailurePolicy()
    assert policy.judge(error(grpc.StatusCode.DEADLINE_EXCEEDED), "decode", True) is None
    assert policy.judge(error(grpc.StatusCode.DEADLINE_EXCEEDED), "decode") is not None


def test_a_request_on_two_engines_that_died_is_failed():
    policy = FailurePolicy(max_engine_deaths=2)
    dead = error(grpc.StatusCode.UNAVAILABLE, FailureKind.ENGINE_DEAD)
    assert policy.judge(dead, "decode") is None
    assert policy.judge(error(grpc.StatusCode.UNAVAILABLE), "decode") is None
    failure = policy.judge(dead, "decode")
    assert failure is not None and failure.code == grpc.StatusCode.INTERNAL
    assert "2 engines that died" in failure.details
