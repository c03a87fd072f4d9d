"""``splitserve up`` on Ray: start (or join) Ray, create the controller, serve until stopped.

SIGINT and SIGTERM stop it at any point: while Ray starts (once ``ray.init`` returns: abandoning
it half way would orphan the processes it started; but ``ray.init`` installs a SIGTERM handler
of its own, which exits at once), while the workers load or fail to start, and while it serves
(every wait polls at most ``_WAIT_POLL_S`` apart). Stopping takes the controller's graceful
shutdown (routers, then ready workers, each given ``actor_ops.STOP_GRACE_S``; starting ones
are killed at once), then ``ray.shutdown``.
"""

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

from services.cluster.actor_ops import HEAD_RESOURCE
from services.cluster.config import ClusterConfig
from services.cluster.controller import ClusterController
from services.cluster.members import MemberView
from services.cluster.planner import PlannerConfig
from services.common.roles import POOL_ROLES
from services.router.config import RouterConfig
from services.startup import WorkerFailure
from services.worker.config import WorkerConfig

logger = logging.getLogger(__name__)

# A local Ray instance only carries control messages (KV moves over NIXL / TCP).
_LOCAL_OBJECT_STORE_BYTES = 256 * 2**20
_CONTROLLER_CHECK_S = 1.0
_WAIT_POLL_S = 0.5


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
        "resources": {role.value: slots for role in POOL_ROLES},
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
    _num_failures_seen: int = field(default=0, init=False)

    def start(
        self,
        timeout_s: float = 600.0,
        stop: threading.Event | None = None,
        on_failure: Callable[[WorkerFailure], None] | None = None,
    ) -> list[str] | None:
        """Create the controller and wait until every pool and router serves; return the
        routers' addresses, or None once ``stop`` is set. Each failed start goes to
        ``on_failure`` as it happens. ``TimeoutError`` (naming what is missing and the last
        errors) after ``timeout_s``."""
        controller_class = ray.remote(ClusterController)
        self.controller = controller_class.options(
            num_cpus=0,
            resources={HEAD_RESOURCE: 0.001},
            runtime_env={"env_vars": self.controller_env} if self.controller_env else None,
        ).remote(self.cluster, self.worker, self.router, self.planner, self.log_level)
        self.controller.start.remote()
        ready = self.controller.wait_ready.remote(timeout_s)
        while True:
            done, _ = ray.wait([ready], timeout=_WAIT_POLL_S)
            if on_failure is not None:
                for failure in self.new_failures():
                    on_failure(failure)
            if done:
                try:
                    return ray.get(ready)
                except ray.exceptions.RayTaskError as exc:
                    if isinstance(exc.cause, TimeoutError):  # its message, not Ray's traceback
                        raise TimeoutError(str(exc.cause)) from None
                    raise
            if stop is not None and stop.is_set():
                return None

    def new_failures(self) -> list[WorkerFailure]:
        """The failed worker starts since the last call (see ``ClusterController``); none if
        the controller is slow to answer (they come with the next call)."""
        try:
            num_failures, failures = ray.get(
                self.controller.start_failures.remote(self._num_failures_seen),
                timeout=_CONTROLLER_CHECK_S * 10,
            )
        except ray.exceptions.GetTimeoutError:
            logger.warning("the cluster controller is slow to answer")
            return []
        self._num_failures_seen = num_failures
        return failures

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
    on_failure: Callable[[WorkerFailure], None],
    ready_timeout_s: float = 600.0,
) -> int:
    """Run the cluster until SIGINT / SIGTERM (then return 0); ``report`` is called once it
    serves, ``on_failure`` with each failed worker start. ``TimeoutError`` if it does not
    serve within ``ready_timeout_s``."""
    start_s = time.monotonic()
    stop = threading.Event()
    ray_cluster: RayCluster | None = None
    try:
        _stop_on_signals(stop)
        init_ray(cluster)
        # Again: ray.init replaces the SIGTERM handler (with one that exits at once).
        _stop_on_signals(stop)
        if stop.is_set():
            return 0
        ray_cluster = RayCluster(cluster, worker, router, planner, log_level)
        addresses = ray_cluster.start(ready_timeout_s, stop, on_failure)
        if addresses is None:
            return 0
        report(ray_cluster, addresses, time.monotonic() - start_s)
        while not stop.wait(_CONTROLLER_CHECK_S):
            if not ray_cluster.controller_alive():
                # Its actors died with it; exit so that a supervisor (a pod) restarts us.
                logger.error("the cluster controller died; stopping")
                return 1
            for failure in ray_cluster.new_failures():
                on_failure(failure)
        return 0
    finally:
        if ray_cluster is not None:
            ray_cluster.stop()
        ray.shutdown()


def _stop_on_signals(stop: threading.Event) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
