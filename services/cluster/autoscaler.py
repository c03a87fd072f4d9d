"""The planner's loop: every ``--planner-interval-s`` each planned pool's signals (latency
percentiles from the routers, load from the workers) decide its size (``PoolPlanner``); a new
size goes through the controller's ``scale``, as an operator's ``Scale`` would.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

from services.cluster.members import Pool
from services.cluster.planner import PlannerConfig, PoolPlanner
from services.cluster.probes import ClusterProbes
from services.common.roles import Role

logger = logging.getLogger(__name__)


class Autoscaler:
    """Sizes the ``roles`` pools of ``pools`` (the controller's, read live) with one
    ``PoolPlanner`` each; ``scale`` sets a pool's desired size."""

    def __init__(
        self,
        config: PlannerConfig,
        roles: tuple[Role, ...],
        pools: Mapping[Role, Pool],
        probes: ClusterProbes,
        scale: Callable[[Role, int], Awaitable[object]],
    ) -> None:
        self._config = config
        self._planners = {role: PoolPlanner(role, config) for role in roles}
        self._pools = pools
        self._probes = probes
        self._scale = scale

    async def run_forever(self) -> None:
        """Decide every interval until cancelled; a failed round is logged and retried."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._config.planner_interval_s)
            try:
                await self._decide(loop.time())
            except Exception:
                logger.exception("planner evaluation failed; retrying")

    async def _decide(self, now_s: float) -> None:
        planned = {role: self._pools[role] for role in self._planners}
        signals = await self._probes.signals(
            self._pools[Role.ROUTER].ready(),
            {role: (pool.desired, pool.ready()) for role, pool in planned.items()},
        )
        for role, planner in self._planners.items():
            size = planner.decide(signals[role], now_s)
            if size != self._pools[role].desired:
                logger.info("planner: %s pool %s", role, signals[role])
                await self._scale(role, size)
