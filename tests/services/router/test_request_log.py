"""The status a request's log line names, from how its call ended."""

from __future__ import annotations

import grpc
import pytest

from services.router.request_log import call_status


@pytest.mark.parametrize(
    ("outcome", "aborted_with", "status"),
    [
        ("stop", None, "OK"),
        ("length", None, "OK"),
        ("abort", None, "OK"),
        ("cancelled", None, "CANCELLED"),
        ("error", grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE"),
        ("invalid", grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
        ("error", None, "UNKNOWN"),
    ],
)
def test_call_status(outcome, aborted_with, status):
    assert call_status(outcome, aborted_with) == status
