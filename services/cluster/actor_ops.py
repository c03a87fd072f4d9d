"""The controller's calls to the actors it owns: create one, ping it, push the pools to a
router, stop it; and a failed start's error in one line.

Each call is bounded (``CALL_TIMEOUT_S``, ``_PING_TIMEOUT_S``): a hung actor costs the
controller a timeout, never its loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray

from services.cluster.actors import ACTOR_CLASSES
from services.cluster.config import ClusterConfig
from services.cluster.members import Member, MemberState
from services.cluster.probes import CALL_TIMEOUT_S
from services.common.roles import Role
from services.router.config import RouterConfig
from services.startup import last_line
from services.worker.config import WorkerConfig

logger = logging.getLogger(__name__)

# Ray's resource of the head node: routers and the controller live there (the chart's Service
# targets the head pod).
HEAD_RESOURCE = "node:__internal_head__"
_PING_TIMEOUT_S = 10.0
# Pings in a row an actor may miss before it counts as hung and is replaced (a worker whose
# engine thread holds the GIL for a long step may miss one).
_MAX_MISSED_PINGS = 3
STOP_GRACE_S = 5.0


@dataclass(frozen=True, slots=True)
class ActorFactory:
    """Creates the cluster's actors from the configs every new one starts from (a worker's
    pool flags are set over its model's config in ``workers``, by served name; its id, ports,
    TLS directory and, for a router, the pools are filled in per actor). ``token`` tells this
    controller's actors from another's."""

    cluster: ClusterConfig
    workers: Mapping[str, WorkerConfig]
    router: RouterConfig
    log_level: str
    token: str
    classes: dict[Role, Any] = dataclasses.field(
        default_factory=lambda: {role: ray.remote(cls) for role, cls in ACTOR_CLASSES.items()}
    )

    def create(
        self, role: Role, name: str, slot: int, pools: dict[Role, list[str]], model: str = ""
    ) -> Any:
        """Start actor ``name`` (Ray places it: a router on the head node, in router ``slot``'s
        ports; a worker of served model ``model`` on a node with a free ``role`` slot);
        ``pools`` are a new router's workers. Returns its handle."""
        actor_class = self.classes[role]
        cluster = self.cluster
        if role is Role.ROUTER:
            router = self.router
            router_config = dataclasses.replace(
                router,
                port=cluster.port + slot if cluster.port else 0,
                metrics_port=(
                    cluster.router_metrics_port + slot if cluster.router_metrics_port else 0
                ),
                http_port=router.http_port + slot if router.http_port else 0,
                router_id=f"{router.router_id or 'router'}-{slot}-{self.token}",
                prefill_workers=",".join(pools[Role.PREFILL]),
                decode_workers=",".join(pools[Role.DECODE]),
            )
            handle = ray.get_runtime_context().current_actor
            return actor_class.options(num_cpus=0, resources={HEAD_RESOURCE: 0.001}).remote(
                router_config, handle, self.log_level
            )
        config = dataclasses.replace(
            cluster.pool_worker_config(role, self.workers[model]),
            worker_id=name,
            metrics_port=cluster.worker_metrics_port,
            tls_dir=cluster.identity_tls_dir(role.value),
        )
        return actor_class.options(
            num_cpus=0, num_gpus=cluster.num_gpus(role), resources={role.value: 1}
        ).remote(config, self.log_level)


async def alive(member: Member) -> bool:
    """Ping ``member``: False for a dead actor, and for a hung one (``_MAX_MISSED_PINGS`` in a
    row; each miss is counted on ``member``)."""
    try:
        await asyncio.wait_for(member.actor.ping.remote(), _PING_TIMEOUT_S)
    except ray.exceptions.RayActorError:
        return False
    except TimeoutError:
        member.num_missed_pings += 1
        logger.warning(
            "%s %s did not answer a ping in %.0f s (%d in a row)",
            member.role,
            member.name,
            _PING_TIMEOUT_S,
            member.num_missed_pings,
        )
        return member.num_missed_pings < _MAX_MISSED_PINGS
    member.num_missed_pings = 0
    return True


async def push_pools_to(router: Member, pools: dict[Role, dict[str, bool]]) -> None:
    """Set each pool's members (address -> draining) on ``router``; a failure is logged."""
    try:
        for role, members in pools.items():
            await asyncio.wait_for(router.actor.set_pool.remote(role, members), CALL_TIMEOUT_S)
    except Exception as exc:  # the reaper replaces a dead router, which starts up to date
        logger.warning("router %s: pool update failed (%r)", router.name, exc)


async def stop(member: Member) -> None:
    """Stop the service gracefully if it still answers, then end the actor. A starting one
    has nothing to finish: it is ended at once (its model load may hold its loop)."""
    if member.state is MemberState.STARTING:
        ray.kill(member.actor)
        return
    try:
        await asyncio.wait_for(
            member.actor.stop.remote(STOP_GRACE_S), STOP_GRACE_S + CALL_TIMEOUT_S
        )
    except Exception as exc:
        logger.debug("%s %s: no graceful stop (%r)", member.role, member.name, exc)
    ray.kill(member.actor)


def error_line(exc: BaseException, timeout_s: float) -> str:
    """What a failed start raised, in one line: the last line of the worker's own exception
    (not Ray's wrapping with the remote traceback)."""
    if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None:
        exc = exc.cause
    elif isinstance(exc, TimeoutError):
        return f"not serving after {timeout_s:g} s (--worker-start-timeout-s)"
    elif isinstance(exc, ray.exceptions.RayError):
        # e.g. ActorDiedError: the first line says what happened, the rest are ids.
        return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    return last_line("".join(traceback.format_exception_only(exc)))
