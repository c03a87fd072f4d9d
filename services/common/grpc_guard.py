"""Run a check before a gRPC method's behavior, keeping the method's kind and serializers.

Server interceptors (``GuardingInterceptor``: ``request_decoding``, ``services.router.auth``,
``services.common.tls``) use ``guarded`` to put a check in front of a servicer method: the check
may abort the call (``context.abort``) or set per-call context (a ``contextvars.ContextVar`` set
in the check is visible to the behavior, which runs in the same task). Only unary-request
methods exist in splitserve's services; other kinds are returned unchanged.
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

Guard = Callable[[Any, grpc.aio.ServicerContext], Awaitable[None]]


class GuardingInterceptor(grpc.aio.ServerInterceptor, abc.ABC):
    """A server interceptor that hands each known method's handler to ``wrap`` (unknown methods
    pass through: gRPC answers them UNIMPLEMENTED)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        return self.wrap(handler, handler_call_details)

    @abc.abstractmethod
    def wrap(
        self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        """``handler`` as the call should run it: ``guarded`` by a check, or unchanged."""


def guarded(
    handler: grpc.RpcMethodHandler,
    guard: Guard,
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler:
    """``handler`` with ``guard(request, context)`` awaited before its behavior (and
    ``request_deserializer`` instead of its own when given)."""
    if handler.request_streaming:
        return handler
    deserializer = request_deserializer or handler.request_deserializer
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            _guard_unary_stream(handler.unary_stream, guard),
            request_deserializer=deserializer,
            response_serializer=handler.response_serializer,
        )
    return grpc.unary_unary_rpc_method_handler(
        _guard_unary(handler.unary_unary, guard),
        request_deserializer=deserializer,
        response_serializer=handler.response_serializer,
    )


def _guard_unary_stream(behavior: Callable[..., Any], guard: Guard) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await guard(request, context)
            async for response in behavior(request, context):
                yield response

        return stream
    return _guard_unary(behavior, guard)


def _guard_unary(
    behavior: Callable[..., Awaitable[Any]], guard: Guard
) -> Callable[..., Awaitable[Any]]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await guard(request, context)
        return await behavior(request, context)

    return call
