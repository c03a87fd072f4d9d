"""The Redis options every service shares: a password and TLS against real redis-servers, the
flag checks, and a cluster whose router and workers reach a TLS Redis with a password given
only through environment variables."""

from __future__ import annotations

import asyncio
import random

import pytest
import redis

from engine.block_hash import hash_block_tokens
from loadtest.fixtures.redis_server import RedisServer
from services.common.prefix_index import RedisPrefixIndex
from services.common.redis_config import RedisConfig
from tests.services.conftest import greedy

PASSWORD = "s3cret"


@pytest.fixture(scope="module")
def secure_redis(tmp_path_factory) -> RedisServer:
    server = RedisServer(tmp_path_factory.mktemp("redis-tls"), password=PASSWORD, tls=True)
    server.start()
    yield server
    server.stop()


def round_trip(config: RedisConfig) -> dict[str, int]:
    async def main() -> dict[str, int]:
        index = RedisPrefixIndex.from_config(config)
        try:
            blocks = hash_block_tokens(list(range(32)), 16)
            await index.heartbeat("w", ttl_s=30)
            await index.store("w", blocks)
            return await index.match(blocks)
        finally:
            await index.close()

    return asyncio.run(main())


def test_password_and_tls_reach_the_index(secure_redis):
    config = RedisConfig(
        secure_redis.url, redis_password=PASSWORD, redis_tls_ca_file=str(secure_redis.ca_file)
    )
    assert round_trip(config) == {"w": 2}


def test_a_wrong_password_or_an_unverified_server_fails_clearly(secure_redis):
    ca_file = str(secure_redis.ca_file)
    with pytest.raises(redis.AuthenticationError):
        round_trip(RedisConfig(secure_redis.url, redis_password="wrong", redis_tls_ca_file=ca_file))
    with pytest.raises(redis.ConnectionError, match=r"(?i)certificate"):
        round_trip(RedisConfig(secure_redis.url, redis_password=PASSWORD))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"redis_url": "redis://h:6379/0", "redis_tls_ca_file": "ca.pem"}, "rediss://"),
        (
            {"redis_url": "rediss://h:6379/0", "redis_tls_cert_file": "c.pem"},
            "go together",
        ),
    ],
)
def test_inconsistent_tls_flags_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        RedisConfig(**fields)


def test_a_cluster_routes_by_prefix_through_a_tls_redis_with_a_password(
    start_cluster, secure_redis, monkeypatch
):
    monkeypatch.setenv("SPLITSERVE_REDIS_PASSWORD", PASSWORD)
    monkeypatch.setenv("SPLITSERVE_REDIS_TLS_CA_FILE", str(secure_redis.ca_file))
    redis_flags = ("--redis-url", secure_redis.url)
    _, client = start_cluster(
        num_prefill=2,
        num_decode=1,
        extra_worker_flags=(*redis_flags, "--heartbeat-ttl-s", "1"),
        extra_router_flags=redis_flags,
    )
    rng = random.Random(0)
    shared = [rng.randrange(3, 480) for _ in range(64)]
    cached = [
        client.generate(
            token_ids=shared + [rng.randrange(3, 480)] * 5, sampling=greedy(2)
        ).last.usage.cached_tokens
        for _ in range(4)
    ]
    assert cached[0] == 0 and all(c >= 64 for c in cached[1:]), cached
    status = client.status()
    assert status.prefix_hit_blocks_realized == status.prefix_hit_blocks_predicted >= 12
