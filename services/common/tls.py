"""TLS material of one cluster identity, and who may call a worker.

A service's ``--tls-dir`` holds ``tls.crt``, ``tls.key`` and ``ca.crt`` (the layout of a
cert-manager Secret; ``splitserve certs`` writes one directory per identity). Inside the
cluster every gRPC hop is mutual TLS under that CA:

- a worker's server demands a client certificate the CA signed, and ``RequirePeerIdentity``
  admits only the router's and the controller's (health checks excepted: probes carry none);
- a channel to a cluster member presents the caller's certificate and verifies the server's
  against the CA under the callee identity's service name (``<identity>.splitserve.internal``),
  not the pod address it dials: a decode worker's certificate does not pass for a prefill
  worker's.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.common.grpc_guard import GuardingInterceptor, guarded
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.roles import Role

logger = logging.getLogger(__name__)

CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"
CA_FILE = "ca.crt"
_SERVICE_DOMAIN = "splitserve.internal"
_HEALTH_SERVICE = "grpc.health.v1.Health"


def service_name(role: Role) -> str:
    """The DNS name in ``role``'s certificates that members verify its holder by."""
    return f"{role.value}.{_SERVICE_DOMAIN}"


@dataclass(frozen=True, slots=True)
class TlsMaterial:
    """One identity's certificate, key and the cluster CA, read once (PEM bytes)."""

    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes

    @classmethod
    def from_dir(cls, tls_dir: str | Path) -> TlsMaterial:
        """Read ``tls.crt``, ``tls.key`` and ``ca.crt``; ``ValueError`` naming a missing one."""
        root = Path(tls_dir)
        try:
            return cls(*((root / name).read_bytes() for name in (CERT_FILE, KEY_FILE, CA_FILE)))
        except OSError as exc:
            raise ValueError(f"--tls-dir {root}: {exc.strerror}: {exc.filename}") from None

    def server_credentials(self, require_client_auth: bool) -> grpc.ServerCredentials:
        """Serve this certificate; with ``require_client_auth`` a client must present one the
        CA signed, else the handshake fails."""
        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_pem)],
            root_certificates=self.ca_pem,
            require_client_auth=require_client_auth,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Present this certificate; trust only servers the CA signed."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem,
            private_key=self.key_pem,
            certificate_chain=self.cert_pem,
        )


def identity_tls_dir(root: str, identity: str) -> str:
    """The directory of ``identity``'s material under ``root`` (``splitserve certs``' layout);
    empty when ``root`` is (TLS off)."""
    return str(Path(root) / identity) if root else ""


def read_tls_dir(tls_dir: str) -> TlsMaterial | None:
    """``TlsMaterial.from_dir``, or None for an empty ``tls_dir`` (plaintext)."""
    return TlsMaterial.from_dir(tls_dir) if tls_dir else None


def member_channel(address: str, callee: Role, tls: TlsMaterial | None) -> grpc.aio.Channel:
    """An asyncio channel to the cluster member at ``address``: mutual TLS verifying it as
    ``callee`` (whatever address is dialed) with ``tls``, plaintext without."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(
        address, tls.channel_credentials(), options=_member_options(callee)
    )


def member_channel_blocking(address: str, callee: Role, tls: TlsMaterial | None) -> grpc.Channel:
    """``member_channel`` for blocking code."""
    if tls is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(address, tls.channel_credentials(), options=_member_options(callee))


def _member_options(callee: Role) -> tuple[tuple[str, Any], ...]:
    return (*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", service_name(callee)))


def peer_identity(context: grpc.aio.ServicerContext) -> str | None:
    """The common name of the caller's verified client certificate (None without one)."""
    names = context.auth_context().get("x509_common_name") or []
    return names[0].decode() if names else None


class RequirePeerIdentity(GuardingInterceptor):
    """Admit a call only from a client certificate whose identity is in ``allowed`` (gRPC
    health checks excepted); ``PERMISSION_DENIED`` naming the identity otherwise. The TLS
    handshake has already checked that the CA signed it."""

    def __init__(self, allowed: Collection[Role]) -> None:
        self._allowed = frozenset(allowed)

    def wrap(
        self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        method = details.method
        if method.lstrip("/").startswith(_HEALTH_SERVICE + "/"):
            return handler

        async def check(request: Any, context: grpc.aio.ServicerContext) -> None:
            identity = peer_identity(context)
            if identity not in self._allowed:
                logger.warning("%s from %s (%s) refused", method, context.peer(), identity)
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{method} admits {sorted(self._allowed)} certificates, not {identity!r}",
                )

        return guarded(handler, check)
