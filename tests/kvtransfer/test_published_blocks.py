"""``PublishedBlocks``, the source's table behind every backend: what a grant admits, and that a
wrong one tells a prober nothing."""

from __future__ import annotations

import logging

import pytest

from kvtransfer._common import GRANT_BYTES, PublishedBlocks


def test_a_wrong_or_missing_grant_is_refused_exactly_like_an_unknown_request():
    published = PublishedBlocks()
    grant = published.publish("r", [1, 2])
    assert len(grant) == GRANT_BYTES
    assert published.check_read("never", grant, [1]) == (
        "req_id=never is not published under this grant"
    )
    refusal = "req_id=r is not published under this grant"
    for presented in (b"", bytes(GRANT_BYTES), grant[:-1], grant + b"\0"):
        assert published.check_read("r", presented, [1]) == refusal
        assert published.begin_read("r", presented, [1]) == refusal
    assert published.check_read("r", grant, [2, 1]) is None
    assert published.check_read("r", grant, [3]) == "blocks [3] were not published under req_id=r"


def test_a_release_with_a_wrong_grant_is_ignored_and_logged_once_without_the_grant(
    caplog: pytest.LogCaptureFixture,
):
    published = PublishedBlocks()
    grant = published.publish("r", [1])
    wrong = bytes(GRANT_BYTES)
    with caplog.at_level(logging.DEBUG, logger="kvtransfer._common"):
        published.release("r", wrong)
    (warning,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "req_id=r" in warning.getMessage()
    assert wrong not in (warning.args or ()) and grant not in (warning.args or ())
    assert published.take_released() == [] and published.has_blocks()
    published.release("r", grant)
    assert published.take_released() == ["r"] and not published.has_blocks()


def test_unpublish_refuses_new_reads_at_once_and_reports_the_blocks_free_after_the_last_read(
    caplog: pytest.LogCaptureFixture,
):
    published = PublishedBlocks()
    grants = {r: published.publish(r, [i]) for i, r in enumerate(("sending", "idle", "overdue"))}
    for req_id in ("sending", "overdue"):
        assert published.begin_read(req_id, grants[req_id], []) is None
    published.unpublish("sending", wait_s=3600.0)
    published.unpublish("idle", wait_s=3600.0)
    published.unpublish("overdue", wait_s=0.0)
    published.unpublish("never-published", wait_s=3600.0)
    assert published.begin_read("sending", grants["sending"], []) is not None
    with caplog.at_level(logging.WARNING, logger="kvtransfer._common"):
        assert published.take_unpublished() == ["idle", "never-published", "overdue"]
    assert "req_id=overdue unpublished while a read was still sending" in caplog.text
    assert published.has_blocks()  # "sending" is still being sent
    published.unpublish("sending", wait_s=3600.0)  # once is enough
    assert published.take_unpublished() == []
    published.end_read("sending")
    published.end_read("overdue")
    assert published.take_unpublished() == ["sending"] and published.take_unpublished() == []
    assert not published.has_blocks()
