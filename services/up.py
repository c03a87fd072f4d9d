"""``splitserve up``: a router plus prefill and decode pools on this machine or a Ray cluster.

By default every service is a Ray actor under a controller (``services.cluster``), which lets
``splitserve scale`` resize the pools while it runs; ``--no-ray`` starts them as plain local
processes instead (``services.launcher``). Both take the same flags: every engine flag, the
cluster's shape, and the worker and router flags that are the same for every replica.

Both print each worker that fails to start (or, with ``--no-ray``, exits) on stderr, one line
with its pool, name and the error's last line; a start that fails again with the same error is
not printed again. SIGINT / SIGTERM stop everything at any point.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable

from engine.config import EngineConfig
from engine.cpu_isa import AUTO, library_env, resolve_isa
from engine.flags import add_flags, from_args, secret_env, to_argv
from services.cluster.config import ClusterConfig
from services.cluster.planner import PlannerConfig
from services.common.redis_config import RedisConfig
from services.common.roles import POOL_ROLES, Role
from services.common.tracing import TracingConfig
from services.launcher import LocalCluster, ModelWorkers, split_threads
from services.router.config import RouterConfig
from services.startup import WorkerFailure
from services.worker.config import PER_REPLICA_FLAGS, WorkerConfig, engine_unavailable

# Set per replica by the launcher or the controller, not by `up`'s flags.
_PER_WORKER = PER_REPLICA_FLAGS
_PER_ROUTER = (
    "model", "revision", "served_model_name", "host", "port", "mode", "prefill_workers",
    "decode_workers", "metrics_port", "seed", "router_id", "tls_dir",
)  # fmt: skip
# Per replica under the launcher too (port + i), but flags of `up` (the first router's).
_HTTP = ("http", "http_port")
# Router flags that are worker flags too, with the same meaning: one `up` flag sets both.
SHARED_WITH_WORKERS = ("stream_idle_timeout_s",)
_SUPERVISE_S = 0.5


def configure(parser: argparse.ArgumentParser) -> None:
    """Declare ``up``'s flags on its sub-parser."""
    add_flags(parser, EngineConfig)
    add_flags(parser, ClusterConfig)
    add_flags(parser, WorkerConfig, skip=_PER_WORKER)
    add_flags(parser, RouterConfig, skip=(*_PER_ROUTER, *SHARED_WITH_WORKERS))
    add_flags(parser, RedisConfig)
    add_flags(parser, TracingConfig)
    add_flags(parser, PlannerConfig)
    parser.set_defaults(func=run)


def configs_from_args(
    args: argparse.Namespace,
) -> tuple[ClusterConfig, WorkerConfig, RouterConfig, PlannerConfig]:
    """The cluster's shape, the config every worker and every router starts from (a pool's
    own flags go over the workers': ``ClusterConfig.pool_worker_config``, checked here), and
    the autoscaler's."""
    cluster: ClusterConfig = from_args(ClusterConfig, args)
    engine: EngineConfig = from_args(EngineConfig, args)
    redis: RedisConfig = from_args(RedisConfig, args)
    tracing: TracingConfig = from_args(TracingConfig, args)
    # Every model's workers share the machine's cores.
    num_engines = sum(
        cluster.num_workers(spec, role)
        for spec in (None, *cluster.extra_model_specs())
        for role in POOL_ROLES
    )
    # Workers hand text and stop strings to the router.
    worker_engine = dataclasses.replace(split_threads(engine, num_engines), detokenize=False)
    worker = from_args(
        WorkerConfig,
        args,
        skip=_PER_WORKER,
        engine=worker_engine,
        redis=redis,
        tracing=tracing,
        host=cluster.host,
    )
    router = from_args(
        RouterConfig,
        args,
        skip=_PER_ROUTER,
        model=engine.model,
        revision=engine.revision,
        served_model_name=engine.served_model_name,
        redis=redis,
        tracing=tracing,
        host=cluster.host,
        port=cluster.port,
        mode=cluster.mode,
        tls_dir=cluster.identity_tls_dir("router"),
    )
    for shared in model_worker_configs(cluster, worker):
        for role in cluster.pool_roles:
            cluster.pool_worker_config(role, shared)
    return cluster, worker, router, from_args(PlannerConfig, args)


def model_worker_configs(cluster: ClusterConfig, worker: WorkerConfig) -> list[WorkerConfig]:
    """The config each served model's workers start from: ``worker`` (the ``--model``'s),
    then each ``--extra-models`` entry's (``ValueError`` naming the entry's problem)."""
    primary = worker.engine.served_model_name or worker.engine.model
    return [worker, *(spec.worker_config(worker) for spec in cluster.extra_model_specs(primary))]


def run(args: argparse.Namespace) -> int:
    try:
        cluster, worker, router, planner = configs_from_args(args)
    except ValueError as exc:
        print(f"splitserve up: {exc}", file=sys.stderr)
        return 2
    if worker.engine.cpu_isa != AUTO:
        # Workers (launcher processes, or Ray actors under the raylet this process starts)
        # inherit these: torch's and oneDNN's kernels are then capped at the same level.
        os.environ.update(library_env(resolve_isa(worker.engine.cpu_isa)))
    for shared in model_worker_configs(cluster, worker):
        for role in cluster.pool_roles:
            problem = engine_unavailable(role, cluster.pool_worker_config(role, shared).engine)
            if problem is not None:
                print(f"splitserve up: {role} pool: {problem}", file=sys.stderr)
                return 2
    if planner.autoscale and not cluster.ray:
        print("splitserve up: --autoscale needs Ray (drop --no-ray)", file=sys.stderr)
        return 2
    if cluster.num_routers > 1 and not router.redis.enabled:
        # Each would keep its own index and reservations and herd onto the same workers.
        print("splitserve up: --num-routers above 1 needs --redis-url", file=sys.stderr)
        return 2
    failures = _FailureConsole()
    if cluster.ray:
        from services.cluster.driver import RayCluster, serve_on_ray

        def report(ray_cluster: RayCluster, addresses: list[str], elapsed_s: float) -> None:
            members = ray_cluster.members()
            workers = ", ".join(f"{m.role}@{m.address}" for m in members if m.role.is_pool)
            http_urls = (
                [
                    _http_url(cluster, address.rsplit(":", 1)[0], router.http_port + i)
                    for i, address in enumerate(addresses)
                ]
                if router.http and router.http_port
                else []
            )
            _print_banner(cluster, addresses, http_urls, workers, elapsed_s, on_ray=True)
            metrics = ", ".join(f"{m.name}:{m.metrics_port}" for m in members)
            print(f"Prometheus /metrics: {metrics}", flush=True)

        try:
            return serve_on_ray(
                cluster, worker, router, planner, args.log_level, report, failures.report
            )
        except TimeoutError as exc:
            print(f"splitserve up: {exc}", file=sys.stderr)
            return 1
    return _serve_local(cluster, worker, router, args.log_level, failures.report)


class _FailureConsole:
    """Prints each ``WorkerFailure`` on stderr in one line, except a failed start whose error
    is the one last printed for its pool (the controller retries it with backoff)."""

    def __init__(self) -> None:
        self._last_error: dict[str, str] = {}

    def report(self, failure: WorkerFailure) -> None:
        if failure.attempt > 1 and self._last_error.get(failure.role) == failure.error:
            return
        self._last_error[failure.role] = failure.error
        who = f"{failure.role} worker" if failure.role.is_pool else str(failure.role)
        if failure.restarting:
            what = f"exited ({failure.error}); restarting it (restart {failure.attempt})"
        elif failure.retry_in_s is None:
            what = f"exited ({failure.error}); not restarted (no orchestrator with --no-ray)"
        else:
            what = (
                f"failed to start: {failure.error} (attempt {failure.attempt}, retrying in "
                f"{failure.retry_in_s:.0f} s; this error is not repeated here)"
            )
        print(f"splitserve up: {who} {failure.worker} {what}", file=sys.stderr, flush=True)


def _serve_local(
    cluster: ClusterConfig,
    worker: WorkerConfig,
    router: RouterConfig,
    log_level: str,
    on_failure: Callable[[WorkerFailure], None],
) -> int:
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    if router.api_key_file and not router.admin_api_key:
        # The launcher's own Status calls need an admin key; this one lives as long as `up`.
        router = dataclasses.replace(router, admin_api_key=secrets.token_urlsafe(32))
    # Every replica of a role gets the same flags; secrets travel in the environment.
    shared_argv = (*to_argv(router.redis), *to_argv(router.tracing))
    os.environ.update(secret_env(router.redis))  # the launcher passes the admin key itself
    local = LocalCluster(
        engine=worker.engine,
        num_prefill=cluster.num_prefill_workers,
        num_decode=cluster.num_decode_workers,
        num_routers=cluster.num_routers,
        mode=cluster.mode,
        log_level=log_level,
        host=cluster.host,
        port=cluster.port,
        http_port=router.http_port if router.http else None,
        admin_api_key=router.admin_api_key,
        tls_dir=cluster.tls_dir,
        extra_worker_flags=(*to_argv(worker, skip=_PER_WORKER), *shared_argv),
        extra_role_flags={role: cluster.worker_args(role) for role in cluster.pool_roles},
        extra_models=_extra_model_workers(cluster, worker),
        extra_router_flags=(*to_argv(router, skip=(*_PER_ROUTER, *_HTTP)), *shared_argv),
    )
    start_s = time.monotonic()
    announced = False
    try:
        local.launch()
        while not stop.wait(_SUPERVISE_S):
            exited = local.supervise()
            for failure in exited:
                on_failure(failure)
            if any(f.role is Role.ROUTER for f in exited):
                print("splitserve up: a router exited; stopping", file=sys.stderr, flush=True)
                return 1
            if not announced and local.serving():
                announced = True
                _announce_local(cluster, local, time.monotonic() - start_s)
    finally:
        local.stop()
    return 0


def _extra_model_workers(cluster: ClusterConfig, worker: WorkerConfig) -> list[ModelWorkers]:
    """Each ``--extra-models`` entry's processes: its pool sizes, and the flags that make a
    worker that model (set over the shared flags, under the pools' own)."""
    primary = worker.engine.served_model_name or worker.engine.model
    extra = []
    for spec in cluster.extra_model_specs(primary):
        flags = ["--model", spec.model, "--served-model-name", spec.name]
        if spec.revision:
            flags += ["--revision", spec.revision]
        flags += shlex.split(spec.worker_args)
        num_prefill = cluster.num_workers(spec, Role.PREFILL)
        num_decode = cluster.num_workers(spec, Role.DECODE)
        extra.append(ModelWorkers(num_prefill, num_decode, tuple(flags)))
    return extra


def _announce_local(cluster: ClusterConfig, local: LocalCluster, elapsed_s: float) -> None:
    routers = [r.address for r in local.workers(Role.ROUTER)]
    workers = ", ".join(f"{p.role}@{p.address}" for p in local.processes if p.role.is_pool)
    http_urls = [
        _http_url(cluster, cluster.host, r.http_port)
        for r in local.workers(Role.ROUTER)
        if r.http_port is not None
    ]
    _print_banner(cluster, routers, http_urls, workers, elapsed_s, on_ray=False)
    metrics = ", ".join(f"{p.role}:{p.metrics_port}" for p in local.processes)
    print(f"Prometheus /metrics on {cluster.host}: {metrics}", flush=True)


def _http_url(cluster: ClusterConfig, host: str, port: int) -> str:
    return f"{'https' if cluster.tls_dir else 'http'}://{host}:{port}/v1"


def _print_banner(
    cluster: ClusterConfig,
    addresses: list[str],
    http_urls: list[str],
    workers: str,
    elapsed_s: float,
    *,
    on_ray: bool,
) -> None:
    how = "Ray actors" if on_ray else "local processes"
    print(
        f"splitserve router listening on {', '.join(addresses)} "
        f"({cluster.mode}, {how}, ready in {elapsed_s:.1f} s; {workers})",
        flush=True,
    )
    print(f'try: splitserve client --target {addresses[0]} --chat "Hello!"', flush=True)
    if http_urls:
        print(f"OpenAI API: {', '.join(http_urls)} (e.g. {http_urls[0]}/models)", flush=True)
    if on_ray:
        print(
            f"scale: splitserve scale prefill N --target {addresses[0]}; "
            f"status: splitserve status --target {addresses[0]}",
            flush=True,
        )
