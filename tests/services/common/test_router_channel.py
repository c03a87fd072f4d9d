"""Client channels carry the API key on every call kind, blocking and asyncio."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.router_channel import open_router_aio_channel, open_router_channel

KEY = "channel-test-key-0123456789"
SERVICE = "splitserve.test.Echo"


async def _serve(seen: list[str | None]) -> tuple[grpc.aio.Server, str]:
    """A server whose two methods (unary, server-streaming) record the authorization sent."""

    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        seen.append(dict(context.invocation_metadata()).get("authorization"))
        return b"ok"

    async def stream(request: bytes, context: grpc.aio.ServicerContext):
        seen.append(dict(context.invocation_metadata()).get("authorization"))
        yield b"ok"

    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.mark.parametrize("api_key", [KEY, ""])
def test_every_call_kind_carries_the_key(api_key):
    async def run() -> list[str | None]:
        seen: list[str | None] = []
        server, target = await _serve(seen)
        try:
            async with open_router_aio_channel(target, api_key) as channel:
                await channel.unary_unary(f"/{SERVICE}/Unary")(b"")
                async for _ in channel.unary_stream(f"/{SERVICE}/Stream")(b""):
                    pass
            with open_router_channel(target, api_key) as blocking:
                unary = blocking.unary_unary(f"/{SERVICE}/Unary")
                await asyncio.to_thread(unary, b"")
                stream = blocking.unary_stream(f"/{SERVICE}/Stream")
                await asyncio.to_thread(lambda: list(stream(b"")))
        finally:
            await server.stop(None)
        return seen

    expected = f"Bearer {KEY}" if api_key else None
    assert asyncio.run(run()) == [expected] * 4
