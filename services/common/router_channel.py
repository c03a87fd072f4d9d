"""Client channels to a router: TLS when given the CA, and the caller's API key on every call.

Every command that calls a router (``splitserve client``, ``status``, ``scale``, ``loadtest``)
takes ``--api-key`` (env ``SPLITSERVE_API_KEY``) and ``--tls-ca-file`` (env
``SPLITSERVE_TLS_CA_FILE``: the router's client port serves TLS, verified against this CA) and
opens its channel here, so that each call carries ``authorization: Bearer KEY``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from services.common.api_keys import BEARER_PREFIX
from services.common.grpc_server import CHANNEL_OPTIONS

API_KEY_ENV = "SPLITSERVE_API_KEY"
TLS_CA_FILE_ENV = "SPLITSERVE_TLS_CA_FILE"
AUTHORIZATION = "authorization"


def add_router_credential_flags(parser: argparse.ArgumentParser) -> None:
    """``--api-key`` and ``--tls-ca-file``, defaulting to their env vars."""
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV, ""),
        help=f"API key sent to the router (prefer the env var) [env {API_KEY_ENV}]",
    )
    parser.add_argument(
        "--tls-ca-file",
        default=os.environ.get(TLS_CA_FILE_ENV, ""),
        help="CA certificate that verifies the router's TLS certificate (empty: plaintext) "
        f"[env {TLS_CA_FILE_ENV}]",
    )


def router_credentials(args: argparse.Namespace) -> dict[str, str]:
    """The keyword arguments of ``open_router_channel`` from ``add_router_credential_flags``'s
    flags."""
    return {"api_key": args.api_key, "ca_file": args.tls_ca_file}


def api_key_metadata(api_key: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that presents ``api_key`` (none for an empty key)."""
    return ((AUTHORIZATION, BEARER_PREFIX + api_key),) if api_key else ()


def open_router_channel(target: str, api_key: str = "", ca_file: str = "") -> grpc.Channel:
    """A blocking channel to the router at ``target`` whose calls carry ``api_key``; TLS
    verified against ``ca_file`` when given (``OSError`` if it cannot be read)."""
    if ca_file:
        credentials = grpc.ssl_channel_credentials(Path(ca_file).read_bytes())
        channel = grpc.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
    else:
        channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    if not api_key:
        return channel
    return grpc.intercept_channel(channel, _AddMetadata(api_key_metadata(api_key)))


def open_router_aio_channel(target: str, api_key: str = "", ca_file: str = "") -> grpc.aio.Channel:
    """``open_router_channel`` for asyncio."""
    metadata = api_key_metadata(api_key)
    interceptors: list[grpc.aio.ClientInterceptor] | None = (
        [_AddMetadataUnaryUnaryAio(metadata), _AddMetadataUnaryStreamAio(metadata)]
        if api_key
        else None
    )
    if ca_file:
        credentials = grpc.ssl_channel_credentials(Path(ca_file).read_bytes())
        return grpc.aio.secure_channel(
            target, credentials, options=CHANNEL_OPTIONS, interceptors=interceptors
        )
    return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS, interceptors=interceptors)


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _ClientCallDetails(_CallDetails, grpc.ClientCallDetails):
    pass


class _AddMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _ClientCallDetails(
            details.method,
            details.timeout,
            (*(details.metadata or ()), *self._metadata),
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        return continuation(self._details(client_call_details), request)


class _AddMetadataAio:
    """Adds fixed metadata to every call (the calls' own metadata first)."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._metadata)
        return grpc.aio.ClientCallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            details.wait_for_ready,
        )


# grpc.aio files an interceptor under the first call kind it implements only: one per kind.
class _AddMetadataUnaryUnaryAio(_AddMetadataAio, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        return await continuation(self.details(client_call_details), request)


class _AddMetadataUnaryStreamAio(_AddMetadataAio, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        return await continuation(self.details(client_call_details), request)
