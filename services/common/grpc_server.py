"""gRPC server plumbing shared by the router and the workers.

Every server gets standard ``grpc.health.v1`` health checking (NOT_SERVING until ready) and
server reflection, answers unparsable request bytes with INVALID_ARGUMENT
(``request_decoding``), stops gracefully on SIGTERM / SIGINT, and exposes the same channel
options.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.request_decoding import RejectUndecodableRequests

logger = logging.getLogger(__name__)

# Prompts of 100k+ tokens and their responses must fit.
MAX_MESSAGE_BYTES = 64 * 2**20
# HTTP/2 keepalive: a peer that stops answering pings (a hung or SIGSTOPped process, a cut
# link: TCP alone may wait for minutes) fails its calls with UNAVAILABLE within about
# KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS, even while a stream is silent.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
_MESSAGE_SIZES = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)
CHANNEL_OPTIONS = (
    *_MESSAGE_SIZES,
    # A peer that is still starting (a worker compiling its kernels, a router) is retried at
    # least every 2 s, not after gRPC's default backoff of up to 120 s.
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # What a channel reads ahead of its caller: 4 KiB per stream, not the window gRPC grows
    # by probing. A router reading a decode stream no faster than its HTTP client (one that
    # reads nothing) then blocks the worker's writes within a few hundred tokens, which pauses
    # the request in the engine; 64 KiB let it generate thousands more. The channels carry
    # tokens and control messages only (KV moves over kvtransfer), and a message larger than
    # the window still arrives whole.
    ("grpc.http2.lookahead_bytes", 4096),
    ("grpc.http2.bdp_probe", 0),
)
SERVER_OPTIONS = (
    *_MESSAGE_SIZES,
    # gRPC sets SO_REUSEPORT by default: a second server on a port in use would then share it,
    # each getting some of the connections, instead of failing to start.
    ("grpc.so_reuseport", 0),
    # The server pings its clients too: the calls of a router that hangs or is cut off are
    # cancelled (freeing their KV blocks) instead of waiting for it forever.
    ("grpc.keepalive_time_ms", 2 * KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    # Accept the clients' keepalive pings (gRPC's default answers them with GOAWAY).
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
)
OVERALL_HEALTH = ""  # the health service name that covers the whole server


class ServingServer:
    """A started ``grpc.aio`` server plus its health servicer."""

    def __init__(
        self, server: grpc.aio.Server, health_servicer: health.aio.HealthServicer, port: int
    ):
        self.server = server
        self.health = health_servicer
        self.port = port

    async def set_serving(self, service_names: Sequence[str]) -> None:
        for name in (OVERALL_HEALTH, *service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def set_not_serving(self) -> None:
        """Report NOT_SERVING for every service from now on (the server keeps running)."""
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace_s: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


async def start_server(
    host: str,
    port: int,
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
) -> ServingServer:
    """Create, bind and start a server (TLS with ``credentials``, else plaintext); ``register``
    adds the servicers, ``interceptors`` run before the servicer (and before undecodable
    requests are refused), in order.

    Health reports NOT_SERVING until ``ServingServer.set_serving`` is called. ``port`` 0 binds
    a free port (``ServingServer.port``); a port in use raises ``OSError`` (never shared).
    """
    server = grpc.aio.server(
        options=SERVER_OPTIONS, interceptors=(*interceptors, RejectUndecodableRequests())
    )
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in (OVERALL_HEALTH, *service_names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(
        (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = f"{host}:{port}"
    try:
        if credentials is None:
            bound_port = server.add_insecure_port(address)
        else:
            bound_port = server.add_secure_port(address, credentials)
    except RuntimeError:  # newer grpcio raises where older ones returned 0
        bound_port = 0
    if bound_port == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port} (in use?)")
    await server.start()
    return ServingServer(server, health_servicer, bound_port)


def freeze_startup_heap() -> None:
    """Keep the cyclic GC from walking what a service's startup allocated (torch, the model,
    the tokenizer, channels) again and again: it lives as long as the process, and a full
    collection of it holds the GIL for ~200 ms, a stall of every stream and a spike in routing
    latency. For a service's own process only (``serve_until_signal``, the Ray actors): frozen
    objects are never collected, which a process starting many services (a test run) would
    leak."""
    gc.freeze()


async def serve_until_signal(
    serving: ServingServer,
    cleanup: Callable[[], Awaitable[None]] | None = None,
    fatal: asyncio.Event | None = None,
    before_stop: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Block until SIGTERM / SIGINT (then run ``before_stop``, a drain) or until ``fatal`` is
    set; then stop the server (5 s grace) and run ``cleanup``. What the process allocated
    before is frozen out of the cyclic GC (``freeze_startup_heap``)."""
    freeze_startup_heap()
    signalled = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signalled.set)
    waits = [
        asyncio.ensure_future(serving.server.wait_for_termination()),
        asyncio.ensure_future(signalled.wait()),
    ]
    if fatal is not None:
        waits.append(asyncio.ensure_future(fatal.wait()))
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    logger.info("shutting down")
    if signalled.is_set() and before_stop is not None:
        await before_stop()
    await serving.stop(grace_s=5.0)
    if cleanup is not None:
        await cleanup()
    for task in waits:
        task.cancel()
