"""Run the HTTP API with uvicorn inside the router's own event loop.

The router's gRPC server and the HTTP server share one loop and one ``RouterServicer``. The
socket is bound here (a port in use is an ``OSError`` naming it, and port 0 picks a free
one); uvicorn's own signal handling stays off: the router's ``serve_until_signal`` owns
SIGTERM and stops this server with the rest. Connections are bounded in size and time by
``HttpLimits`` (see ``connection``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from services.common.tls import CERT_FILE, KEY_FILE
from services.router.openai.connection import HttpLimits, limited_protocol

logger = logging.getLogger(__name__)


class HttpServer:
    """A started uvicorn server on ``port``; ``stop`` lets open requests finish (``grace_s``)
    and then cancels them."""

    def __init__(self, server: uvicorn.Server, sock: socket.socket) -> None:
        self._server = server
        self._socket = sock
        self.port: int = sock.getsockname()[1]
        self._ticker: asyncio.Task[None] | None = None

    @classmethod
    async def start(
        cls,
        app: FastAPI,
        host: str,
        port: int,
        limits: HttpLimits,
        tls_dir: str = "",
        grace_s: float = 5.0,
    ) -> HttpServer:
        """Bind ``host:port`` and serve ``app`` (HTTPS with ``tls_dir``'s certificate) within
        ``limits``."""
        sock = _bind(host, port)
        tls_files: dict[str, str] = {}
        if tls_dir:
            tls_files = {
                "ssl_certfile": str(Path(tls_dir) / CERT_FILE),
                "ssl_keyfile": str(Path(tls_dir) / KEY_FILE),
            }
        config = uvicorn.Config(
            app,
            http=limited_protocol(limits),
            lifespan="off",
            access_log=False,
            log_config=None,
            timeout_graceful_shutdown=int(grace_s) or 1,
            **tls_files,  # type: ignore[arg-type]
        )
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[sock])
        running = cls(server, sock)
        # uvicorn's tick keeps the Date header current and applies its connection limits.
        running._ticker = asyncio.get_running_loop().create_task(server.main_loop())
        return running

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._ticker is not None:
            await self._ticker
        await self._server.shutdown(sockets=[self._socket])


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it. Without it a stream's small writes wait for the
    # client's delayed ACK: +40 ms to every request after the first on a kept-alive connection.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind the HTTP API to {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock
