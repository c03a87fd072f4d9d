"""The router's client port: which API key role each RPC needs (see ``api_keys``).

``Generate`` needs a data key; ``Scale``, ``Status`` and ``Explain`` (and any method added to
the service later: fail closed) need an admin key. gRPC health checking and reflection stay
open: probes carry no credentials, and the schema is public. A missing or unknown key is
``UNAUTHENTICATED``; a data key on an admin method is ``PERMISSION_DENIED``. The servicer reads
who called from ``CALLER``.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Mapping
from typing import Any

import grpc

from services.common.api_keys import BEARER_PREFIX, ApiKey, ApiKeyStore, KeyRole
from services.common.grpc_guard import GuardingInterceptor, guarded
from services.common.router_channel import AUTHORIZATION

logger = logging.getLogger(__name__)

ROUTER_METHOD_ROLES: Mapping[str, KeyRole] = {"Generate": KeyRole.DATA}

# The key of the call being served (None when the router takes no keys).
CALLER: contextvars.ContextVar[ApiKey | None] = contextvars.ContextVar("caller", default=None)


def caller_name(context: grpc.aio.ServicerContext) -> str:
    """Who is calling, for the log: the key's fingerprint (if keys are on) and the peer."""
    key = CALLER.get()
    return f"key {key.fingerprint} at {context.peer()}" if key else context.peer()


class RequireApiKey(GuardingInterceptor):
    """Checks the ``authorization`` metadata of every call to ``service``'s methods against
    ``keys``, each method needing ``method_roles.get(method, ADMIN)``. Stateless apart from
    the key store."""

    def __init__(
        self, keys: ApiKeyStore, service: str, method_roles: Mapping[str, KeyRole]
    ) -> None:
        self._keys = keys
        self._service = service
        self._method_roles = method_roles

    def wrap(
        self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        service, _, method = details.method.lstrip("/").rpartition("/")
        if service != self._service:
            return handler
        needed = self._method_roles.get(method, KeyRole.ADMIN)
        metadata = dict(details.invocation_metadata or ())
        presented = metadata.get(AUTHORIZATION)
        key = self._keys.authenticate(presented)

        async def check(request: Any, context: grpc.aio.ServicerContext) -> None:
            if key is None:
                why = _why_refused(presented)
                logger.info("%s from %s refused: %s", method, context.peer(), why)
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
            elif not key.role.allows(needed):
                logger.warning(
                    "%s from key %s at %s refused: a data key",
                    method,
                    key.fingerprint,
                    context.peer(),
                )
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{method} needs an admin API key; this one (key {key.fingerprint}) is a "
                    "data key",
                )
            CALLER.set(key)

        return guarded(handler, check)


def _why_refused(presented: str | None) -> str:
    if not presented:
        return f"missing API key: send metadata '{AUTHORIZATION}: {BEARER_PREFIX}<key>'"
    if not presented.startswith(BEARER_PREFIX):
        return f"malformed {AUTHORIZATION} metadata: expected '{BEARER_PREFIX}<key>'"
    return "invalid API key"
