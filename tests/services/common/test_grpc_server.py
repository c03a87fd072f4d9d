"""``start_server``: a port is served by one server only."""

from __future__ import annotations

import asyncio

import pytest

from services.common.grpc_server import start_server


def test_a_second_server_on_a_port_in_use_fails_to_start_instead_of_sharing_it() -> None:
    async def main() -> None:
        first = await start_server("127.0.0.1", 0, lambda server: None, ())
        try:
            with pytest.raises(OSError, match=f"127.0.0.1:{first.port}"):
                await start_server("127.0.0.1", first.port, lambda server: None, ())
        finally:
            await first.stop(grace_s=0)

    asyncio.run(main())
