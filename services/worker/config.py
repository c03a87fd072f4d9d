"""Configuration and process entry shared by the prefill and decode workers."""

from __future__ import annotations

import argparse
import dataclasses
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from engine.config import EngineConfig, EngineKind
from engine.flags import add_flags, flag, from_args
from engine.vllm_engine.args import (
    VLLMNotInstalledError,
    kv_stays_reason,
    parse_vllm_args,
    require_vllm,
)
from kvtransfer.registry import default_backend, is_available
from services.common.redis_config import RedisConfig
from services.common.roles import Role
from services.common.service_flags import parse_service_args, shared_configs
from services.common.tracing import TracingConfig

KV_TRANSFER_BACKENDS = ("nixl", "ucx", "tcp")
# Set per replica (by the launcher, the controller or the pod), never for a whole pool.
PER_REPLICA_FLAGS = ("host", "port", "worker_id", "metrics_port", "tls_dir")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """A worker process: its engine plus how it serves gRPC and KV transfers."""

    engine: EngineConfig
    redis: RedisConfig = field(default_factory=RedisConfig)  # unset URL: no index published
    tracing: TracingConfig = field(default_factory=TracingConfig)
    host: str = flag("127.0.0.1", "address the gRPC server binds (0.0.0.0 in a pod)")
    port: int = flag(50061, "gRPC port (0: any free port)")
    worker_id: str = flag("", "unique worker id (default: <role>-<hostname>-<port>)")
    kv_transfer: str = flag(
        default_backend(),
        "KV transfer backend (default: nixl when installed, else tcp)",
        choices=KV_TRANSFER_BACKENDS,
    )
    kv_host: str | None = flag(
        None, "address the KV transfer listener binds (default: --host, as the gRPC server)"
    )
    kv_advertise_host: str | None = flag(
        None, "address peers use to reach this worker's KV (default: --kv-host)"
    )
    kv_io_timeout_s: float = flag(
        10.0, "seconds a KV read may wait on a silent peer before it fails (and is recomputed)"
    )
    heartbeat_ttl_s: float = flag(
        3.0, "seconds the prefix index keeps this worker routable without a heartbeat"
    )
    metrics_port: int = flag(0, "port of the Prometheus /metrics endpoint (0: off)")
    stream_idle_timeout_s: float = flag(
        60.0,
        "seconds a decode stream whose reader stopped reading stays paused (keeping its KV "
        "blocks) before the worker aborts it (ABORTED)",
    )
    shutdown_grace_s: float = flag(
        30.0,
        "on SIGTERM: seconds the worker keeps serving its open streams (taking no new ones) "
        "before it ends them, marked so that routers continue them on other workers",
    )
    lease_ttl_s: float = flag(
        30.0,
        "seconds leased blocks wait for their reader's pull: a finished prefill's (for the "
        "decode worker), a cached prefix pinned for a peer; the router asks for as long as "
        "the request may still wait (its reader may queue it first), at most 10 times this",
    )
    tls_dir: str = flag(
        "",
        "directory of this worker's TLS material (tls.crt, tls.key, ca.crt; see splitserve "
        "certs): serve mutual TLS, admitting only the cluster's router and controller "
        "certificates, and run tcp / ucx KV transfers over mutual TLS between prefill and "
        "decode certificates (empty: plaintext)",
    )

    def __post_init__(self) -> None:
        if self.lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {self.lease_ttl_s}")
        if self.heartbeat_ttl_s <= 0:
            raise ValueError(f"heartbeat_ttl_s must be > 0, got {self.heartbeat_ttl_s}")
        if self.kv_io_timeout_s <= 0:
            raise ValueError(f"kv_io_timeout_s must be > 0, got {self.kv_io_timeout_s}")
        if not is_available(self.kv_transfer):
            extra = self.kv_transfer
            raise ValueError(f"--kv-transfer {extra} needs pip install 'splitserve[{extra}]'")

    def with_pool_flags(self, argv: Sequence[str]) -> WorkerConfig:
        """This config with the engine and worker flags in ``argv`` (one pool's
        ``--prefill-worker-args`` / ``--decode-worker-args``) set over it; the rest is kept.
        ``ValueError`` naming the flag that is unknown, set per replica
        (``PER_REPLICA_FLAGS``) or given a bad value."""
        if not argv:
            return self
        for name in PER_REPLICA_FLAGS:
            flag_text = "--" + name.replace("_", "-")
            if any(a == flag_text or a.startswith(flag_text + "=") for a in argv):
                raise ValueError(f"{flag_text} is set for each worker, not for a pool")
        parser = _PoolFlagParser(prog="pool worker args", add_help=False, allow_abbrev=False)
        add_flags(parser, EngineConfig, skip=("detokenize",), defaults=False)
        add_flags(parser, WorkerConfig, skip=PER_REPLICA_FLAGS, defaults=False)
        given = vars(parser.parse_args(list(argv)))
        engine_names = {f.name for f in dataclasses.fields(EngineConfig)}
        engine = {name: value for name, value in given.items() if name in engine_names}
        worker = {name: value for name, value in given.items() if name not in engine_names}
        return dataclasses.replace(
            self, engine=dataclasses.replace(self.engine, **engine), **worker
        )

    @property
    def kv_bind_host(self) -> str:
        """Where the KV listener binds: ``--kv-host``, else ``--host`` (a worker reachable on
        one address must not keep its KV on another, such as loopback)."""
        return self.kv_host or self.host

    def resolved_worker_id(self, role: str, port: int) -> str:
        return self.worker_id or f"{role}-{socket.gethostname()}-{port}"


def parse_worker_args(role: Role, argv: list[str] | None) -> WorkerConfig:
    """``python -m services.<role>`` flags: every engine flag plus the worker's own."""
    parser, args = parse_service_args(
        f"python -m services.{role}",
        f"splitserve {role} worker",
        (EngineConfig, WorkerConfig),
        argv,
    )
    # Workers hand text and stop strings to the router.
    engine = from_args(EngineConfig, args, detokenize=False)
    problem = engine_unavailable(role, engine)
    if problem:
        parser.exit(2, f"{parser.prog}: error: {problem}\n")
    redis, tracing = shared_configs(args)
    return from_args(WorkerConfig, args, engine=engine, redis=redis, tracing=tracing)


def engine_unavailable(role: Role, engine: EngineConfig) -> str | None:
    """Why a ``role`` worker cannot run ``engine`` here, in one line (None: it can): checked
    before the model loads, so the worker fails at once."""
    if engine.engine is not EngineKind.VLLM:
        return None
    try:
        require_vllm()
    except VLLMNotInstalledError as exc:
        return str(exc)
    if role is Role.PREFILL:
        reason = kv_stays_reason(parse_vllm_args(engine.vllm_args))
        if reason is not None:
            return (
                f"--engine vllm on a prefill worker needs its KV to move, but {reason}; serve "
                "it colocated (splitserve up --mode colocated --num-prefill-workers 0: decode "
                "workers run whole requests)"
            )
    return None


class _PoolFlagParser(argparse.ArgumentParser):
    """Raises ``ValueError`` where ``ArgumentParser`` would print usage and exit: pool flags
    are checked inside ``splitserve up`` and in the controller, not on a command line."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)
