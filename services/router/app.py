"""The router as a running server: start it (tokenizer, gRPC port, API keys, worker polling),
serve until a signal, stop it. ``python -m services.router`` runs ``main``."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import sys
from dataclasses import dataclass, fields

from engine.loader.models import resolve_model
from engine.tokenizer import Tokenizer
from services.common.api_keys import ApiKeyStore
from services.common.grpc_server import ServingServer, serve_until_signal, start_server
from services.common.metrics import start_metrics_server
from services.common.tls import read_tls_dir
from services.router.auth import ROUTER_METHOD_ROLES, RequireApiKey
from services.router.config import RouterConfig, parse_router_args
from services.router.openai.body_parser import BodyParser
from services.router.openai.connection import HttpLimits
from services.router.openai.routes import build_app
from services.router.openai.server import HttpServer
from services.router.pool_metrics import register_pool_metrics, unregister_pool_metrics
from services.router.scaler import PoolScaler
from services.router.server import SERVICE_NAME, RouterServicer
from splitserve.v1 import router_pb2_grpc

logger = logging.getLogger(__name__)

# How often the router looks for a changed API key file (one stat call).
_KEY_FILE_CHECK_S = 5.0


@dataclass(slots=True)
class RunningRouter:
    """A started router: its servicer, the ports it serves on (gRPC, and HTTP unless
    ``--no-http``) and the keys it accepts."""

    servicer: RouterServicer
    serving: ServingServer
    api_keys: ApiKeyStore
    http: HttpServer | None = None
    bodies: BodyParser | None = None
    watch_task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        return self.serving.port

    @property
    def http_port(self) -> int | None:
        return self.http.port if self.http is not None else None

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop serving (in-flight calls get ``grace_s``), then close the worker channels."""
        if self.watch_task is not None:
            self.watch_task.cancel()
        if self.http is not None:
            await asyncio.gather(self.serving.stop(grace_s), self.http.stop())
            if self.bodies is not None:
                self.bodies.close()
        else:
            await self.serving.stop(grace_s)
        await self.servicer.stop()
        unregister_pool_metrics(self.servicer.pool_collector)


async def start_router(
    config: RouterConfig,
    scaler: PoolScaler | None = None,
    api_keys: ApiKeyStore | None = None,
) -> RunningRouter:
    """Load the tokenizer, start serving and polling the workers; health is SERVING on return.
    ``api_keys`` defaults to the config's (``ValueError`` for an unreadable or malformed key
    file)."""
    if api_keys is None:
        api_keys = ApiKeyStore(config.api_key_file, config.admin_api_key)
    tls = read_tls_dir(config.tls_dir)
    if not api_keys.enabled and not _is_loopback(config.host):
        logger.warning(
            "the router listens on %s without API keys: anyone who reaches port %d may "
            "generate and resize the pools (--api-key-file)",
            config.host,
            config.port,
        )
    tokenizer = await asyncio.to_thread(
        lambda: Tokenizer(
            resolve_model(config.model, revision=config.revision, tokenizer_only=True)
        )
    )
    servicer = RouterServicer(config, tokenizer, scaler, tls)
    interceptors = (
        (RequireApiKey(api_keys, SERVICE_NAME, ROUTER_METHOD_ROLES),) if api_keys.enabled else ()
    )
    serving = await start_server(
        config.host,
        config.port,
        lambda server: router_pb2_grpc.add_RouterServicer_to_server(servicer, server),
        (SERVICE_NAME,),
        interceptors,
        # Clients authenticate with API keys; the certificate proves the router to them.
        tls.server_credentials(require_client_auth=False) if tls else None,
    )
    await servicer.start()
    http = bodies = None
    if config.http:
        bodies = BodyParser()
        app = build_app(servicer, api_keys, _max_body_bytes(config), bodies)
        try:
            http = await HttpServer.start(
                app, config.host, config.http_port, _http_limits(config), config.tls_dir
            )
        except OSError:
            bodies.close()
            await serving.stop(0)
            await servicer.stop()
            raise
    register_pool_metrics(servicer.pool_collector)
    start_metrics_server(config.host, config.metrics_port)
    await serving.set_serving((SERVICE_NAME,))
    logger.info(
        "router serving on %s:%d (%s; %d prefill, %d decode workers; API keys %s; %s; %s)",
        config.host,
        serving.port,
        config.mode,
        len(servicer.prefill_pool.workers),
        len(servicer.decode_pool.workers),
        "on" if api_keys.enabled else "off",
        "TLS" if tls else "plaintext",
        f"OpenAI API on port {http.port}" if http else "no HTTP API",
    )
    running = RunningRouter(servicer, serving, api_keys, http, bodies)
    if config.api_key_file:
        running.watch_task = asyncio.get_running_loop().create_task(_watch_keys(api_keys))
    return running


async def _watch_keys(api_keys: ApiKeyStore) -> None:
    """Re-read the key file whenever it changes (a rotated Kubernetes Secret, a router on Ray
    that no SIGHUP reaches), checking every ``_KEY_FILE_CHECK_S``."""
    while True:
        await asyncio.sleep(_KEY_FILE_CHECK_S)
        await asyncio.to_thread(api_keys.reload_if_changed)


def _max_body_bytes(config: RouterConfig) -> int:
    """The largest HTTP body worth parsing: the largest prompt, JSON-escaped (up to 6 bytes
    a character), plus room for the other fields."""
    return 6 * config.max_prompt_bytes + 2**20


def _http_limits(config: RouterConfig) -> HttpLimits:
    # Each limit is the router flag of its name after --http-, but for the streams' own bound.
    idle = "stream_idle_timeout_s"
    names = [f.name for f in fields(HttpLimits) if f.name != idle]
    limits = {name: getattr(config, f"http_{name}") for name in names}
    return HttpLimits(**limits, stream_idle_timeout_s=config.stream_idle_timeout_s)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def serve(config: RouterConfig, api_keys: ApiKeyStore) -> None:
    """Run a router until SIGTERM / SIGINT; SIGHUP re-reads the API key file."""
    router = await start_router(config, api_keys=api_keys)
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, api_keys.reload)

    async def stop_http_and_servicer() -> None:
        if router.http is not None:
            await router.http.stop()
        await router.servicer.stop()

    await serve_until_signal(router.serving, stop_http_and_servicer)


def main(argv: list[str] | None = None) -> int:
    config = parse_router_args(argv)
    try:
        api_keys = ApiKeyStore(config.api_key_file, config.admin_api_key)
        read_tls_dir(config.tls_dir)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    asyncio.run(serve(config, api_keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
