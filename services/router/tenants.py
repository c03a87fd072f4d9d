"""Tenants: whose requests share limits and a prefix cache.

A request's tenant is its API key's (``tenant=NAME`` in the key file; ``default`` for a key
that names none, or when the router takes no keys). ``--tenant-limits`` bounds each tenant:

    acme:max_concurrent_requests=8,max_tokens_per_s=2000;*:max_tokens_per_s=500

``*`` applies to every tenant not listed. ``max_concurrent_requests`` caps the tenant's
generations in flight on this router; ``max_tokens_per_s`` its prompt plus generated tokens per
second, as a token bucket that saves up at most one second's worth: a request is admitted while
the tenant's bucket is not in debt, its prompt is charged once tokenized and its tokens as they
stream, so a tenant that overran waits until its debt is repaid. ``priority`` is the tenant's
scheduling priority on the workers (vLLM's: lower runs first under ``--scheduling-policy
priority``): its requests' default, and the best a request of it may ask for. A refused request gets
``RESOURCE_EXHAUSTED`` (HTTP 429) with ``retry-after`` seconds (trailing metadata; the HTTP
header), and costs the other tenants nothing.

Each tenant's prefix cache is its own: the router salts every request's blocks with its tenant
(``tenant_cache_salt``), so two tenants never share a cached block, and a client's
``cache_salt`` only subdivides its tenant's cache. The limits are per router: with several
routers, each enforces them on the requests it serves.
"""

from __future__ import annotations

import enum
import hashlib
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from services.common.api_keys import DEFAULT_TENANT, check_tenant_name

# The entry of --tenant-limits for every tenant it does not name.
OTHER_TENANTS = "*"
# How many seconds of its rate a tenant's bucket saves up while it is idle.
_BURST_S = 1.0
# Retry-After for a tenant at its concurrency cap: when one of its requests ends is unknown.
_CONCURRENCY_RETRY_AFTER_S = 1


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """One tenant's bounds (None: unbounded)."""

    max_concurrent_requests: int | None = None
    max_tokens_per_s: float | None = None
    # The best (lowest) scheduling priority its requests may have, and their default.
    priority: int = 0

    def __post_init__(self) -> None:
        if self.max_concurrent_requests is not None and self.max_concurrent_requests < 1:
            raise ValueError(
                f"max_concurrent_requests must be at least 1, got {self.max_concurrent_requests}"
            )
        if self.max_tokens_per_s is not None and not self.max_tokens_per_s > 0:
            raise ValueError(f"max_tokens_per_s must be positive, got {self.max_tokens_per_s}")


_LIMIT_TYPES: dict[str, Callable[[str], int | float]] = {
    "max_concurrent_requests": int,
    "max_tokens_per_s": float,
    "priority": int,
}


def parse_tenant_limits(spec: str) -> dict[str, TenantLimits]:
    """``--tenant-limits``' value as {tenant or ``*``: limits}; ``ValueError`` naming the part
    that is wrong."""
    limits: dict[str, TenantLimits] = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, sep, fields = part.partition(":")
        name = name.strip()
        if not sep:
            raise ValueError(f"{part!r}: expected NAME:LIMIT=VALUE[,LIMIT=VALUE...]")
        if name != OTHER_TENANTS:
            check_tenant_name(name)
        if name in limits:
            raise ValueError(f"tenant {name!r} is given twice")
        values: dict[str, int | float] = {}
        for item in filter(None, (f.strip() for f in fields.split(","))):
            key, _, value = item.partition("=")
            kind = _LIMIT_TYPES.get(key.strip())
            if kind is None:
                raise ValueError(
                    f"{name}: unknown limit {key.strip()!r} (known: {', '.join(_LIMIT_TYPES)})"
                )
            try:
                values[key.strip()] = kind(value)
            except ValueError:
                raise ValueError(f"{name}: {key.strip()} must be a number, got {value!r}") from None
        try:
            limits[name] = TenantLimits(**values)  # type: ignore[arg-type]
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    return limits


def tenant_cache_salt(tenant: str, cache_salt: str) -> str:
    """The salt of a tenant's request blocks: the client's own for the default tenant (so a
    router without tenants caches as before), else one no other tenant's request can have (it
    starts with a NUL, which a client's salt may not contain)."""
    if tenant == DEFAULT_TENANT:
        return cache_salt
    digest = hashlib.sha256(f"{tenant}\0{cache_salt}".encode()).hexdigest()
    return f"\0tenant\0{digest[:32]}"


class RefusalReason(enum.Enum):
    """Why a tenant's request was refused."""

    CONCURRENCY = "max_concurrent_requests"
    TOKEN_RATE = "max_tokens_per_s"


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: RefusalReason
    message: str
    retry_after_s: int


@dataclass(slots=True)
class _Tenant:
    limits: TenantLimits
    num_inflight: int = 0
    tokens: float = 0.0  # the bucket's level: negative is debt
    stamp_s: float = field(default=0.0)


class TenantGate:
    """Admission by tenant (see the module). Event-loop only; tenants without limits cost a
    dictionary lookup. ``clock`` is injectable for tests."""

    def __init__(
        self,
        limits: Mapping[str, TenantLimits],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._limits = dict(limits)
        self._other = self._limits.pop(OTHER_TENANTS, None)
        self._clock = clock
        self._tenants: dict[str, _Tenant] = {}

    def _state(self, tenant: str) -> _Tenant | None:
        state = self._tenants.get(tenant)
        if state is None:
            limits = self._limits.get(tenant, self._other)
            if limits is None:
                return None
            burst = (limits.max_tokens_per_s or 0.0) * _BURST_S
            state = self._tenants[tenant] = _Tenant(limits, tokens=burst, stamp_s=self._clock())
        return state

    def priority(self, tenant: str) -> int:
        """``tenant``'s scheduling priority: its requests' default and best."""
        limits = self._limits.get(tenant, self._other)
        return 0 if limits is None else limits.priority

    def admit(self, tenant: str) -> Refusal | None:
        """None, counting the request in flight (``release`` it when it ends), or why the
        tenant may not start another request now."""
        state = self._state(tenant)
        if state is None:
            return None
        limits = state.limits
        cap = limits.max_concurrent_requests
        if cap is not None and state.num_inflight >= cap:
            return Refusal(
                RefusalReason.CONCURRENCY,
                f"tenant {tenant!r} has {state.num_inflight} requests in flight "
                f"(its max_concurrent_requests)",
                _CONCURRENCY_RETRY_AFTER_S,
            )
        rate = limits.max_tokens_per_s
        if rate is not None:
            self._refill(state, rate)
            if state.tokens < 0:
                retry_after_s = max(1, math.ceil(-state.tokens / rate))
                return Refusal(
                    RefusalReason.TOKEN_RATE,
                    f"tenant {tenant!r} is over its {rate:g} tokens per second "
                    f"(max_tokens_per_s); retry after {retry_after_s} s",
                    retry_after_s,
                )
        state.num_inflight += 1
        return None

    def charge(self, tenant: str, num_tokens: int) -> None:
        """``num_tokens`` more tokens of ``tenant``'s (prompt or generated)."""
        state = self._tenants.get(tenant)
        if state is None or state.limits.max_tokens_per_s is None:
            return
        self._refill(state, state.limits.max_tokens_per_s)
        state.tokens -= num_tokens

    def release(self, tenant: str) -> None:
        """An admitted request of ``tenant`` ended."""
        state = self._tenants.get(tenant)
        if state is not None:
            state.num_inflight -= 1

    def _refill(self, state: _Tenant, rate: float) -> None:
        now_s = self._clock()
        state.tokens = min(rate * _BURST_S, state.tokens + (now_s - state.stamp_s) * rate)
        state.stamp_s = now_s
