"""The status a request's log line names, from how its call ended."""

from __future__ import annotations

import grpc
import pytest

from services.router.request_log import Outcome, call_status


@pytest.mark.parametrize(
    ("outcome", "aborted_with", "status"),
    [
        (Outcome.STOP, None, "OK"),
        (Outcome.LENGTH, None, "OK"),
        (Outcome.ABORT, None, "OK"),
        (Outcome.CANCELLED, None, "CANCELLED"),
        (Outcome.ERROR, grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE"),
        (Outcome.INVALID, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
        (Outcome.ERROR, None, "UNKNOWN"),
    ],
)
def test_call_status(outcome, aborted_with, status):
    assert call_status(outcome, aborted_with) == status
