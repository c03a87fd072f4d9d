"""Writes of a server-streaming call whose reader may stop reading.

gRPC cannot take back a write: once a message is handed to ``context.write`` the call can send
nothing else (no other message, no status) until the reader takes it or goes away; a write
cancelled by a timeout leaves it pending in gRPC's core and the next ``abort`` fails with
``ExecuteBatchError``. So a write that waits past the idle timeout is left to finish on its
own: the handler frees the request's resources at once, and ends the call with its status only
once the reader has taken that message (it then sees the status next) or has left. What is held
meanwhile is one message.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import NoReturn

import grpc

from services.common.failures import FailureKind, abort_with


class StreamWriter:
    """One call's writes, each waited for at most ``idle_s``; used on the call's event loop."""

    def __init__(self, context: grpc.aio.ServicerContext, idle_s: float) -> None:
        self._context = context
        self.idle_s = idle_s
        self._pending: asyncio.Future[None] | None = None

    async def write(self, message: object) -> bool:
        """Send ``message``: True once gRPC took it, False when the reader took nothing for
        ``idle_s`` (the write stays pending: ``abort`` waits for it). Not to be called again
        after False. ``CancelledError`` when the call ended meanwhile (cancelled, past its
        deadline, or its connection lost)."""
        write = asyncio.ensure_future(self._context.write(message))
        try:
            done, _ = await asyncio.wait({write}, timeout=self.idle_s)
        except asyncio.CancelledError:
            write.cancel()
            raise
        if not done:
            self._pending = write
            return False
        try:
            write.result()
        except grpc.aio.InternalError:
            # gRPC's core failed the write: the call is over (the reader cancelled it, its
            # deadline passed or its connection dropped), and the write's failure can arrive
            # before the handler's cancellation does. End as a cancelled handler does.
            raise asyncio.CancelledError from None
        return True

    async def abort(self, code: grpc.StatusCode, kind: FailureKind, details: str) -> NoReturn:
        """End the call with ``code`` and ``details``, marked with ``kind``, after the pending
        write (if any) has ended: the reader took it, or left."""
        if self._pending is not None:
            try:
                with contextlib.suppress(Exception):
                    await self._pending
            except asyncio.CancelledError:
                self._pending.cancel()
                raise
        await abort_with(self._context, code, kind, details)
