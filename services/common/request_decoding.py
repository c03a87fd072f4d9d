"""Requests whose bytes do not parse get ``INVALID_ARGUMENT``, on every RPC of every server.

gRPC itself answers a request message that fails to deserialize with ``UNKNOWN``
("Unexpected DecodeError"), which tells a client neither that the fault is its own nor that a
retry cannot help. ``RejectUndecodableRequests`` wraps each method's deserializer so that a
``DecodeError`` yields an ``Undecodable`` marker instead of raising, and the method's behavior
so that the marker is aborted with ``INVALID_ARGUMENT`` before the servicer sees it. Only
unary-request methods exist in splitserve's services (and gRPC's health and reflection ones
that are not wrapped are left as they are).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from services.common.grpc_guard import GuardingInterceptor, guarded


@dataclass(frozen=True, slots=True)
class Undecodable:
    """What a wrapped deserializer returns for bytes that do not parse."""

    error: str


def _tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            return Undecodable(str(exc))

    return deserialize


async def _reject_undecodable(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, Undecodable):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"request does not parse: {request.error}"
        )


class RejectUndecodableRequests(GuardingInterceptor):
    """A server interceptor: unary-request methods answer unparsable bytes with
    ``INVALID_ARGUMENT``; the servicer never sees them. Stateless."""

    def wrap(
        self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        if handler.request_streaming or handler.request_deserializer is None:
            return handler
        return guarded(handler, _reject_undecodable, _tolerant(handler.request_deserializer))
