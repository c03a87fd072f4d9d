"""Process lifecycle of a worker: load the engine, open the KV transfer endpoint, serve gRPC."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import grpc
from opentelemetry.trace import Span

from engine.backend import EngineBackend
from engine.build import build_engine
from engine.sampling_params import SamplingParams
from kvtransfer.base import KVTransferBackend, PeerInfo
from kvtransfer.registry import TLS_BACKENDS, make_backend
from kvtransfer.tls import KVTransferTls
from services.common.background import BackgroundTasks
from services.common.convert import peer_info_to_proto
from services.common.failures import FailureKind, abort_with
from services.common.grpc_server import ServingServer, serve_until_signal, start_server
from services.common.metrics import (
    WorkerMetrics,
    register_worker_metrics,
    start_metrics_server,
)
from services.common.prefix_index import RedisPrefixIndex
from services.common.roles import Role
from services.common.serving_metrics import ServingMetrics
from services.common.tls import RequirePeerIdentity, read_tls_dir
from services.common.tracing import Tracing
from services.worker.config import WorkerConfig, parse_worker_args
from services.worker.engine_loop import EngineHooks, EngineLoop
from services.worker.engine_thread import EngineThread
from services.worker.kv_events import KVEventPublisher
from services.worker.kv_hooks import KVHooks
from splitserve.v1 import worker_pb2

logger = logging.getLogger(__name__)

_DRAIN_POLL_S = 0.05
# What a drained server still gives its calls (ending streams only takes a loop turn).
_STOP_GRACE_S = 1.0
# Who may call a worker over mutual TLS: the router routes, the controller probes loads.
_CALLERS = (Role.ROUTER, Role.CONTROLLER)


class WorkerServicer(Protocol):
    def load(self) -> worker_pb2.WorkerLoad:
        """What ``GetLoad`` returns: the engine's latest stats plus the role's counters."""


@dataclass(slots=True)
class WorkerRuntime:
    """Everything a worker's gRPC servicer needs. ``loop`` owns the engine once started."""

    config: WorkerConfig
    role: Role
    worker_id: str
    engine: EngineBackend
    loop: EngineLoop
    kv_backend: KVTransferBackend
    kv_peer: PeerInfo | None  # None: the engine's KV does not move (it prefills everything)
    tracing: Tracing
    # None when the engine keeps vLLM's serving metrics itself (``EngineBackend.metrics``).
    metrics: ServingMetrics | None
    # Set by ``RunningWorker.drain``: new calls are refused (UNAVAILABLE, retryable).
    shutting_down: bool = False

    async def refuse_if_shutting_down(self, context: grpc.aio.ServicerContext) -> None:
        """Abort a new call with UNAVAILABLE marked ``FailureKind.SHUTDOWN`` (routers retry it
        elsewhere) once the worker drains; return otherwise."""
        if self.shutting_down:
            await abort_with(
                context,
                grpc.StatusCode.UNAVAILABLE,
                FailureKind.SHUTDOWN,
                "the worker is shutting down",
            )

    async def compile_constraint(
        self, params: SamplingParams, context: grpc.aio.ServicerContext
    ) -> None:
        """Compile ``params.constraint``, if any, on the engine's grammar threads and wait for
        it here, so that the engine adds the request with its grammar ready (a cache hit) and
        its errors stay the caller's: abort the call with INVALID_ARGUMENT naming the field when
        the constraint is over its budget (size or time) or does not compile."""
        if params.constraint is None:
            return
        try:
            await self.engine.prepare_constraint(params.constraint)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.constraint.{exc}")

    def start_call_span(self, name: str, context: grpc.aio.ServicerContext, req_id: str) -> Span:
        """The span of a call on ``req_id``: a child of the router's call span when the call
        carries a trace context, else the no-op span (see ``Tracing.start_worker_span``)."""
        metadata = context.invocation_metadata() or ()
        return self.tracing.start_worker_span(name, metadata, {"splitserve.req_id": req_id})

    def info(self) -> worker_pb2.WorkerInfo:
        info = self.engine.info
        return worker_pb2.WorkerInfo(
            worker_id=self.worker_id,
            role=self.role.to_proto(),
            model=self.config.engine.model,
            revision=self.config.engine.revision or "",
            scheduling_policy=str(self.config.engine.scheduling_policy),
            served_model_name=info.served_model_name,
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
            block_size=info.block_size,
            kv_peer=None if self.kv_peer is None else peer_info_to_proto(self.kv_peer),
            kv_transfer_backend=self.kv_backend.name,
            dtype=info.dtype,
            cpu_isa=info.cpu_isa,
            kernels=info.kernels,
        )


def build_runtime(
    config: WorkerConfig,
    role: Role,
    port: int,
    make_hooks: Callable[[KVTransferBackend], EngineHooks],
) -> WorkerRuntime:
    """Load the model and register its KV cache with the transfer backend (blocking)."""
    worker_id = config.resolved_worker_id(role, port)
    kv_tls = kv_transfer_tls(config, role)
    engine = build_engine(config.engine)
    backend = make_backend(
        config.kv_transfer,
        worker_id,
        host=config.kv_bind_host,
        advertise_host=config.kv_advertise_host,
        io_timeout_s=config.kv_io_timeout_s,
        tls=kv_tls,
    )
    kv_peer = None
    if engine.kv_cache is not None and engine.kv_cache_spec is not None:
        kv_peer = backend.register_kv_cache(engine.kv_cache, engine.kv_cache_spec)
    elif role is Role.PREFILL:
        raise RuntimeError(
            f"a prefill worker's engine must share its KV cache; {engine.info.kernels} keeps its "
            "own (the log above says why): run it on decode workers, colocated"
        )
    loop = EngineLoop(engine, make_hooks(backend))
    tracing = Tracing(config.tracing, f"splitserve-{role}", {"service.instance.id": worker_id})
    metrics = None
    if engine.metrics is None:
        metrics = ServingMetrics(engine.info.served_model_name, str(role))
    return WorkerRuntime(config, role, worker_id, engine, loop, backend, kv_peer, tracing, metrics)


def kv_transfer_tls(config: WorkerConfig, role: Role) -> KVTransferTls | None:
    """The mutual TLS of a worker's KV transfers: its ``--tls-dir`` material, pairing workers
    (prefill and decode certificates) only. None without ``--tls-dir``, and for a backend without
    TLS (``nixl``: logged, its reads stay gated by grants alone)."""
    if not config.tls_dir:
        return None
    if config.kv_transfer not in TLS_BACKENDS:
        logger.warning(
            "--kv-transfer %s moves KV blocks and its notifications outside TLS (reads are "
            "gated by per-request grants only); %s put them under the cluster's mutual TLS",
            config.kv_transfer,
            " or ".join(TLS_BACKENDS),
        )
        return None
    # Every worker reads from and serves to both roles (a prefill worker pulls a prefix a
    # decode worker holds); no other certificate (router, controller, client) moves KV.
    return KVTransferTls.from_dir(config.tls_dir, {Role.PREFILL.value, Role.DECODE.value})


@dataclass(slots=True)
class RunningWorker:
    """A started worker: its runtime, servicer and the port it serves on."""

    runtime: WorkerRuntime
    servicer: WorkerServicer
    serving: ServingServer
    publisher: KVEventPublisher | None
    # Set when the engine thread died: the worker reports NOT_SERVING and its process exits.
    engine_died: asyncio.Event
    # The worker's load and engine metrics as Prometheus series (exported until ``cleanup``).
    worker_metrics: WorkerMetrics

    @property
    def port(self) -> int:
        return self.serving.port

    def load(self) -> worker_pb2.WorkerLoad:
        return self.servicer.load()

    async def stop(self, grace_s: float = 5.0) -> None:
        """``drain`` for up to ``grace_s``, stop serving, then the engine and KV transfers."""
        await self.drain(grace_s)
        await self.serving.stop(_STOP_GRACE_S)
        await self.cleanup()

    async def drain(self, grace_s: float) -> None:
        """Take no new request (health NOT_SERVING, ``WorkerLoad.shutting_down``, new calls
        UNAVAILABLE) and give the open streams, and a prefill worker's leases, up to
        ``grace_s`` to finish; then end the streams still open with UNAVAILABLE marked
        ``FailureKind.SHUTDOWN``, which routers continue on other workers token-exactly."""
        runtime = self.runtime
        runtime.shutting_down = True
        await self.serving.set_not_serving()
        loop = runtime.loop

        def busy() -> bool:
            return loop.is_alive and bool(loop.num_streams or loop.stats.num_held_kv)

        await _wait_until(lambda: not busy(), grace_s)
        if loop.num_streams:
            logger.warning(
                "shutdown grace of %.0f s over: ending %d open streams (they continue on other "
                "workers)",
                grace_s,
                loop.num_streams,
            )
            loop.end_streams("the worker is shutting down")
            await _wait_until(lambda: not loop.num_streams, _STOP_GRACE_S)

    async def cleanup(self) -> None:
        """Stop the engine, the index publisher and the KV transfer endpoint; export the
        spans still buffered; stop exporting the worker's load."""
        self.worker_metrics.unregister()
        if self.publisher is not None:
            await self.publisher.stop()
        self.runtime.loop.shutdown()
        self.runtime.kv_backend.close()
        await self.runtime.tracing.shutdown()


@dataclass(frozen=True, slots=True)
class WorkerService:
    """What makes a worker a prefill or a decode worker: its role, its gRPC service and the
    servicer of its calls. Every worker's engine loop runs the same ``KVHooks`` around each
    step: each worker is both a KV source and a KV reader."""

    role: Role
    service_name: str  # the gRPC service's full name, as health checks and reflection say it
    make_servicer: Callable[[WorkerRuntime, KVHooks], WorkerServicer]
    add_to_server: Callable[[Any, grpc.aio.Server], None]  # add_<Service>Servicer_to_server


async def start_worker(config: WorkerConfig, service: WorkerService) -> RunningWorker:
    """Load the engine and serve ``service``; health is SERVING on return."""
    role, service_name = service.role, service.service_name
    tls = read_tls_dir(config.tls_dir)  # before the model loads: a bad path fails at once
    # The engine is built on the thread that will step it (see engine_thread).
    engine_thread = EngineThread()

    def make_hooks(backend: KVTransferBackend) -> KVHooks:
        return KVHooks(backend, config.lease_ttl_s)

    try:
        runtime = await engine_thread.run(build_runtime, config, role, config.port, make_hooks)
    except BaseException:
        engine_thread.shutdown()
        raise
    hooks = cast(KVHooks, runtime.loop.hooks)  # make_hooks made them, above
    servicer = service.make_servicer(runtime, hooks)
    serving = await start_server(
        config.host,
        config.port,
        lambda server: service.add_to_server(servicer, server),
        (service_name,),
        (RequirePeerIdentity(_CALLERS),) if tls else (),
        tls.server_credentials(require_client_auth=True) if tls else None,
    )
    worker_metrics = register_worker_metrics(
        str(role),
        runtime.worker_id,
        runtime.engine.info.served_model_name,
        servicer.load,
        runtime.engine.metrics,
    )
    start_metrics_server(config.host, config.metrics_port)
    publisher = make_kv_event_publisher(config, runtime)
    engine_died = asyncio.Event()
    background = BackgroundTasks()

    def on_engine_dead(cause: BaseException) -> None:
        logger.error(
            "engine died (%r): NOT_SERVING; its streams fail with UNAVAILABLE and the process "
            "exits so that its supervisor starts a new one",
            cause,
        )
        engine_died.set()
        background.spawn(serving.set_not_serving())

    runtime.loop.on_dead = on_engine_dead
    runtime.loop.start(engine_thread)
    if publisher is not None:
        publisher.start()
    await serving.set_serving((service_name,))
    kv_at = "no KV transfer" if runtime.kv_peer is None else runtime.kv_peer.address
    logger.info(
        "%s worker %s serving on %s:%d (KV over %s at %s)",
        role,
        runtime.worker_id,
        config.host,
        serving.port,
        runtime.kv_backend.name,
        kv_at,
    )
    return RunningWorker(runtime, servicer, serving, publisher, engine_died, worker_metrics)


def worker_main(service: WorkerService, argv: list[str] | None) -> int:
    """``python -m services.<role>``: parse the flags, start the worker and serve until a
    signal or the engine's death (see ``serve_worker``); returns the exit status."""
    config = parse_worker_args(service.role, argv)
    return asyncio.run(serve_worker(start_worker(config, service)))


async def serve_worker(starting: Awaitable[RunningWorker]) -> int:
    """Run the worker ``starting`` starts (see ``start_worker``) until SIGTERM / SIGINT (then
    ``drain`` for ``--shutdown-grace-s``) or until its engine dies; return the process's exit
    status (1: the engine died)."""
    worker = await starting
    grace_s = worker.runtime.config.shutdown_grace_s
    await serve_until_signal(
        worker.serving,
        worker.cleanup,
        fatal=worker.engine_died,
        before_stop=lambda: worker.drain(grace_s),
    )
    return 1 if worker.engine_died.is_set() else 0


async def _wait_until(done: Callable[[], bool], timeout_s: float) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline_s:
        await asyncio.sleep(_DRAIN_POLL_S)


def make_kv_event_publisher(
    config: WorkerConfig, runtime: WorkerRuntime
) -> KVEventPublisher | None:
    """With ``--redis-url``: a publisher of the worker's prefix-cache events, fed by its engine
    loop (call ``start()`` once the loop runs). None without a Redis."""
    if not config.redis.enabled:
        return None
    publisher = KVEventPublisher(
        RedisPrefixIndex.from_config(config.redis),
        runtime.worker_id,
        snapshot=lambda: runtime.loop.call(lambda engine: engine.prefix_cache_blocks()),
        ttl_s=config.heartbeat_ttl_s,
    )
    runtime.loop.on_kv_events = publisher.submit
    return publisher
