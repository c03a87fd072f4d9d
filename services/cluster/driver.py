"""``splitserve up`` on Ray: start (or join) Ray, create the controller, serve until stopped."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from services.cluster.config import POOL_ROLES, ClusterConfig
from services.cluster.controller import HEAD_RESOURCE, ClusterController, MemberView
from services.cluster.planner import PlannerConfig
from services.common.worker_config import WorkerConfig
from services.router.config import RouterConfig

logger = logging.getLogger(__name__)

# A local Ray instance only carries control messages (KV moves over NIXL / TCP).
_LOCAL_OBJECT_STORE_BYTES = 256 * 2**20
_CONTROLLER_CHECK_S = 1.0


def init_ray(cluster: ClusterConfig, **local_options: Any) -> None:
    """Join ``cluster.ray_address``, or start a local instance whose node offers the
    ``prefill`` / ``decode`` resources of every worker a pool may grow to."""
    if ray.is_initialized():
        return
    if cluster.ray_address:
        ray.init(address=cluster.ray_address, log_to_driver=True)
        return
    slots = float(cluster.max_workers_per_pool)
    options: dict[str, Any] = {
        "num_cpus": os.cpu_count() or 1,
        "resources": dict.fromkeys(POOL_ROLES, slots),
        "include_dashboard": False,
        "object_store_memory": _LOCAL_OBJECT_STORE_BYTES,
        "log_to_driver": True,
    }
    options.update(local_options)
    ray.init(**options)


@dataclass(slots=True)
class RayCluster:
    """Routers and worker pools as Ray actors under one controller (Ray must be initialized).

    ``start`` returns the routers' addresses once everything serves; ``stop`` ends it all.
    """

    cluster: ClusterConfig
    worker: WorkerConfig
    router: RouterConfig
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    log_level: str = "WARNING"
    # Environment of the controller's process (e.g. KUBECONFIG off a Kubernetes pod).
    controller_env: dict[str, str] = field(default_factory=dict)
    controller: Any = field(default=None, init=False)

    def start(self, timeout_s: float = 600.0) -> list[str]:
        controller_class = ray.remote(ClusterController)
        self.controller = controller_class.options(
            num_cpus=0,
            resources={HEAD_RESOURCE: 0.001},
            runtime_env={"env_vars": self.controller_env} if self.controller_env else None,
        ).remote(self.cluster, self.worker, self.router, self.planner, self.log_level)
        ray.get(self.controller.start.remote())
        return ray.get(self.controller.wait_ready.remote(timeout_s))

    def controller_alive(self) -> bool:
        try:
            ray.get(self.controller.pools.remote(), timeout=_CONTROLLER_CHECK_S * 10)
        except ray.exceptions.RayActorError:
            return False
        except ray.exceptions.GetTimeoutError:
            logger.warning("the cluster controller is slow to answer")
        return True

    def members(self) -> list[MemberView]:
        return ray.get(self.controller.members.remote())

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop routers then workers gracefully, then end the controller."""
        if self.controller is None:
            return
        try:
            ray.get(self.controller.shutdown.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            logger.warning("the cluster controller was already gone")
        finally:
            ray.kill(self.controller)
            self.controller = None


def serve_on_ray(
    cluster: ClusterConfig,
    worker: WorkerConfig,
    router: RouterConfig,
    planner: PlannerConfig,
    log_level: str,
    report: Callable[[RayCluster, list[str], float], None],
) -> int:
    """Run the cluster until SIGINT / SIGTERM; ``report`` is called once it serves."""
    start_s = time.monotonic()
    init_ray(cluster)
    # After ray.init, which installs handlers of its own.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    ray_cluster = RayCluster(cluster, worker, router, planner, log_level)
    try:
        addresses = ray_cluster.start()
        report(ray_cluster, addresses, time.monotonic() - start_s)
        while not stop.wait(_CONTROLLER_CHECK_S):
            if not ray_cluster.controller_alive():
                # Its actors died with it; exit so that a supervisor (a pod) restarts us.
                logger.error("the cluster controller died; stopping")
                return 1
    finally:
        ray_cluster.stop()
        ray.shutdown()
    return 0
