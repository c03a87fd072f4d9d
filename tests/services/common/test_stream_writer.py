"""``StreamWriter``: a write that gRPC's core fails ends the handler as a cancelled one, even
when the call's cancellation has not reached the handler yet (seen under hostile load: the
decode worker logged ``ExecuteBatchError`` for a router that had stopped reading)."""

from __future__ import annotations

import asyncio
from typing import cast

import grpc
import pytest

from services.common.stream_writer import StreamWriter


class _EndedCall:
    """A call whose peer left: gRPC fails each write, and the cancellation is still on its
    way (``cancelled()`` is not yet true)."""

    async def write(self, message: object) -> None:
        raise grpc.aio.InternalError("Failed 'execute_batch'")

    def cancelled(self) -> bool:
        return False


class _Call:
    def __init__(self) -> None:
        self.written: list[object] = []

    async def write(self, message: object) -> None:
        self.written.append(message)


def test_a_write_failed_by_grpcs_core_ends_as_a_cancelled_handler() -> None:
    writer = StreamWriter(cast(grpc.aio.ServicerContext, _EndedCall()), idle_s=5.0)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(writer.write(b"token"))


def test_a_taken_write_returns_true() -> None:
    call = _Call()
    writer = StreamWriter(cast(grpc.aio.ServicerContext, call), idle_s=5.0)
    assert asyncio.run(writer.write(b"token")) is True
    assert call.written == [b"token"]
