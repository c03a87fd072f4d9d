"""How a service reaches the cluster's Redis: one set of flags shared by router and workers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from engine.flags import flag


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """Where the prefix index and the routers' reservations live; no URL means no Redis."""

    redis_url: str | None = flag(
        None,
        "Redis of the prefix index and the routers' reservations "
        "(redis://[user:password@]host:port/db, rediss:// for TLS)",
    )
    redis_password: str | None = flag(
        None, "Redis password (overrides one in the URL; set it through the env var)", secret=True
    )
    redis_tls_ca_file: str | None = flag(None, "CA bundle that verifies a rediss:// server")
    redis_tls_cert_file: str | None = flag(None, "client certificate for mutual TLS")
    redis_tls_key_file: str | None = flag(None, "client certificate's private key")
    redis_namespace: str = flag(
        "splitserve:", "prefix of every key (clusters sharing one Redis need different ones)"
    )
    redis_kv_event_stream_len: int = flag(
        0,
        "entries of the prefix index's change stream in Redis, which every router then follows "
        "to match prompts in its own memory (0: no stream; routers match in Redis)",
    )

    def __post_init__(self) -> None:
        tls_files = (self.redis_tls_ca_file, self.redis_tls_cert_file, self.redis_tls_key_file)
        if any(tls_files) and not (self.redis_url or "").startswith("rediss://"):
            raise ValueError("--redis-tls-* options need a rediss:// --redis-url")
        if bool(self.redis_tls_cert_file) != bool(self.redis_tls_key_file):
            raise ValueError("--redis-tls-cert-file and --redis-tls-key-file go together")
        if self.redis_kv_event_stream_len < 0:
            raise ValueError(
                f"--redis-kv-event-stream-len must be >= 0, got {self.redis_kv_event_stream_len}"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.redis_url)

    def client(self) -> aioredis.Redis:
        """A client of ``redis_url``. A silent Redis fails a call within a second instead of
        hanging its caller."""
        if not self.redis_url:
            raise ValueError("no --redis-url")
        options: dict[str, Any] = {"socket_timeout": 1.0, "socket_connect_timeout": 1.0}
        if self.redis_password is not None:
            options["password"] = self.redis_password
        if self.redis_tls_ca_file:
            options["ssl_ca_certs"] = self.redis_tls_ca_file
        if self.redis_tls_cert_file:
            options["ssl_certfile"] = self.redis_tls_cert_file
            options["ssl_keyfile"] = self.redis_tls_key_file
        return aioredis.Redis.from_url(self.redis_url, **options)
