"""How the router's ``Scale`` and ``Status`` reach an orchestrator without depending on one.

A router started as a plain process has no scaler (``Scale`` answers FAILED_PRECONDITION); the
Ray actor wrapping it passes one that forwards to the cluster controller
(``services.cluster``). Pool membership itself reaches the router through
``RouterServicer.set_pool``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

from services.common.convert import field_values
from services.common.logs import rate_limited
from services.common.roles import Role
from splitserve.v1 import router_pb2

logger = logging.getLogger(__name__)

# How long Status and the pool-size metrics wait for the orchestrator's answer.
_SCALER_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class PoolSize:
    """Desired and actual size of one worker pool: ``model``'s (a served model name) of
    ``role``."""

    model: str
    role: Role
    desired_workers: int
    num_ready: int
    num_starting: int
    num_draining: int
    num_restarts: int
    # Why the pool's last worker start failed, and how many failed in a row (see PoolStatus).
    last_error: str = ""
    num_failed_starts: int = 0

    def to_proto(self) -> router_pb2.PoolStatus:
        """The message names every field alike; the role is its enum there."""
        fields = field_values(self, PoolSize)
        return router_pb2.PoolStatus(**{**fields, "role": self.role.to_proto()})


class PoolScaler(Protocol):
    """An orchestrator that sizes the worker pools."""

    async def scale(self, model: str, role: Role, num_workers: int) -> list[PoolSize]:
        """Set the desired size of ``model``'s ``role`` pool; return every pool's size. Raises
        ``ValueError`` for a model not served or a size the cluster cannot have."""
        ...

    async def pools(self) -> list[PoolSize]:
        """Every pool's desired and actual size."""
        ...


async def reported_pool_sizes(scaler: PoolScaler | None) -> list[PoolSize]:
    """Each pool's size from the orchestrator; none without one, or when it does not answer
    within ``_SCALER_TIMEOUT_S`` (logged, rate-limited)."""
    if scaler is None:
        return []
    try:
        return await asyncio.wait_for(scaler.pools(), _SCALER_TIMEOUT_S)
    except TimeoutError:
        logger.warning(
            "the orchestrator did not report pool sizes in %.0f s",
            _SCALER_TIMEOUT_S,
            extra=rate_limited("scaler"),
        )
        return []
