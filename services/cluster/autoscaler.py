"""The planner's loop: every ``--planner-interval-s`` each planned pool's signals (latency
percentiles from the routers, of its own model; load from its workers) decide its size
(``PoolPlanner``); a new size goes through the controller's ``scale``, as an operator's
``Scale`` would. Each model's pools are planned apart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

from services.cluster.members import Pool, PoolKey
from services.cluster.planner import PlannerConfig, PoolPlanner
from services.cluster.probes import ClusterProbes
from services.common.roles import Role

logger = logging.getLogger(__name__)


class Autoscaler:
    """Sizes ``pools`` (the controller's planned ones, by (served model, role), read live) with
    one ``PoolPlanner`` each; ``routers`` give the latencies; ``scale`` sets a pool's desired
    size."""

    def __init__(
        self,
        config: PlannerConfig,
        pools: Mapping[PoolKey, Pool],
        routers: Pool,
        probes: ClusterProbes,
        scale: Callable[[str, Role, int], Awaitable[object]],
    ) -> None:
        self._config = config
        self._planners = {key: PoolPlanner(key[1], config) for key in pools}
        self._pools = pools
        self._routers = routers
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
        signals = await self._probes.signals(
            self._routers.ready(),
            {key: (pool.desired, pool.ready()) for key, pool in self._pools.items()},
        )
        for (model, role), planner in self._planners.items():
            size = planner.decide(signals[(model, role)], now_s)
            if size != self._pools[(model, role)].desired:
                logger.info("planner: %s %s pool %s", model, role, signals[(model, role)])
                await self._scale(model, role, size)
