"""A real ``redis-server`` per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.services.router.redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()
