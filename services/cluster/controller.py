"""The cluster controller: a Ray actor that keeps each pool at its desired size.

Every ``reconcile_interval_s`` (and at once after ``scale``) it:

1. pings every actor; a dead one is dropped from the routers' pools and replaced;
2. starts workers a pool lacks (routable once their ``start`` returns, i.e. serving), and
   picks the ones a smaller pool must lose: still-starting ones first, then those with the
   least work (``members.pick_victims``);
3. drains those: the routers stop choosing them at once (``RouterActor.set_pool``), the worker
   finishes its requests and has its KV leases pulled, then it is removed from the routers and
   stopped;
4. keeps ``num_routers`` routers, each on its own port, and sends them every pool's members
   (at once on a change, and every round so that a router that missed one catches up).

The controller owns every actor it creates: when it dies (the ``splitserve up`` driver exits),
Ray ends them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from typing import TYPE_CHECKING

import ray

from services.cluster.actor_ops import (
    ActorFactory,
    alive,
    error_line,
    push_pools_to,
    stop,
)
from services.cluster.actors import Endpoint
from services.cluster.autoscaler import Autoscaler
from services.cluster.config import ClusterConfig
from services.cluster.members import (
    Member,
    MemberState,
    MemberView,
    Pool,
    PoolKey,
    pick_victims,
)
from services.cluster.planner import PlannerConfig
from services.cluster.probes import ClusterProbes
from services.common.background import BackgroundTasks
from services.common.logs import configure_logging
from services.common.roles import POOL_ROLES, ClusterMode, Role
from services.common.tls import read_tls_dir
from services.router.config import RouterConfig
from services.router.scaler import PoolSize
from services.startup import FailureLog, WorkerFailure
from services.worker.config import WorkerConfig

if TYPE_CHECKING:
    from services.cluster.kuberay import KubeRayGroups

logger = logging.getLogger(__name__)

_DRAIN_POLL_S = 0.25
# A drained worker must look idle this many polls in a row (a routing decision made just
# before the pool change may still be on its way to it).
_DRAIN_QUIET_POLLS = 2
# Failed starts kept for ``start_failures`` (the driver fetches them every second).
_FAILURES_KEPT = 100
# The routers' pool's key: they serve every model.
_ROUTERS: PoolKey = ("", Role.ROUTER)


class ClusterController:
    """Reconciles router replicas and the prefill and decode pools (see the module doc).

    ``worker`` and ``router`` are the configs every new actor starts from (its id, ports and
    pools are filled in per actor).
    """

    def __init__(
        self,
        cluster: ClusterConfig,
        worker: WorkerConfig,
        router: RouterConfig,
        planner: PlannerConfig | None = None,
        log_level: str = "INFO",
    ) -> None:
        configure_logging(log_level)
        self._cluster = cluster
        self._planner = planner or PlannerConfig()
        self._groups: KubeRayGroups | None = None
        if cluster.kuberay_cluster:
            from services.cluster.kuberay import KubeRayGroups

            self._groups = KubeRayGroups(cluster.kuberay_cluster, cluster.kuberay_namespace)
        self._router_config = router
        self._log_level = log_level
        # Each served model's worker config, the --model's first; its pools are keyed by
        # (served name, role), the routers' by ("", router).
        self._primary = worker.engine.served_model_name or worker.engine.model
        specs = cluster.extra_model_specs(self._primary)
        self._workers = {self._primary: worker} | {
            spec.name: spec.worker_config(worker) for spec in specs
        }
        self._pools = {_ROUTERS: Pool(Role.ROUTER, cluster.num_routers)}
        for name, spec in [(self._primary, None), *((spec.name, spec) for spec in specs)]:
            for role in POOL_ROLES:
                desired = cluster.num_workers(spec, role)
                self._pools[(name, role)] = Pool(role, desired, model=name)
        self._failures = FailureLog(_FAILURES_KEPT)
        self._names = itertools.count()
        self._token = secrets.token_hex(2)
        self._actors = ActorFactory(cluster, self._workers, router, log_level, self._token)
        self._probes = ClusterProbes(read_tls_dir(cluster.identity_tls_dir("controller")))
        self._wakeup = asyncio.Event()
        self._push_lock = asyncio.Lock()
        self._background = BackgroundTasks()
        self._loop_task: asyncio.Task[None] | None = None
        self._planner_task: asyncio.Task[None] | None = None
        self._closed = False

    # ----------------------------------------------------------------------------- API
    async def start(self) -> None:
        """Begin reconciling (returns at once; see ``wait_ready``)."""
        if self._loop_task is None:
            loop = asyncio.get_running_loop()
            self._loop_task = loop.create_task(self._run())
            if self._planner.autoscale:
                roles = (
                    POOL_ROLES
                    if self._cluster.mode is ClusterMode.DISAGGREGATED
                    else (Role.DECODE,)
                )
                planned = {key: pool for key, pool in self._pools.items() if key[1] in roles}
                routers = self._pools[_ROUTERS]
                autoscaler = Autoscaler(self._planner, planned, routers, self._probes, self.scale)
                self._planner_task = loop.create_task(autoscaler.run_forever())

    async def wait_ready(self, timeout_s: float) -> list[str]:
        """Wait until every pool and router is at its size with nothing starting or draining,
        and every router routes to every worker; return the routers' addresses.
        ``TimeoutError`` names what is missing."""
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + timeout_s
        while not (self._converged() and await self._routers_route_all()):
            if loop.time() > deadline_s:
                errors = "; ".join(
                    f"{_pool_name(pool)}: {pool.last_error}"
                    for pool in self._pools.values()
                    if pool.last_error
                )
                raise TimeoutError(
                    f"cluster not ready after {timeout_s:.0f} s: {self._sizes()}"
                    + (f"; last errors: {errors}" if errors else "")
                )
            await asyncio.sleep(0.1)
        routers = self._pools[_ROUTERS].members
        return [m.address for m in sorted(routers, key=lambda m: m.slot)]

    async def scale(self, model: str, role: Role, num_workers: int) -> list[PoolSize]:
        """Set served model ``model``'s ``role`` pool's desired size (``ValueError`` for a
        model not served or a size the pool cannot have); reconciles at once and returns
        every pool's size."""
        if model not in self._workers:
            served = ", ".join(f"`{name}`" for name in self._workers)
            raise ValueError(f"model: `{model[:128]}` is not served (served: {served})")
        self._cluster.check_pool_size(role, num_workers)
        pool = self._pools[(model, role)]
        if self._groups is not None:
            # The pods first: new actors wait for them; a smaller group shrinks pod by pod as
            # its workers are drained (``_drain``). One group hosts a role's pools of every model.
            num_pods = num_workers + self._num_role_workers(role, but=pool)
            if num_workers > pool.desired:
                await asyncio.to_thread(self._groups.set_replicas, role, num_pods)
            else:
                await asyncio.to_thread(self._groups.check_replicas, role, num_pods)
        if pool.desired != num_workers:
            logger.info("%s pool: %d -> %d workers", _pool_name(pool), pool.desired, num_workers)
        pool.desired = num_workers
        self._wakeup.set()
        return self._sizes()

    async def pools(self) -> list[PoolSize]:
        return self._sizes()

    async def start_failures(self, after: int) -> tuple[int, list[WorkerFailure]]:
        """How many starts have failed in all, and those after the first ``after`` (at most the
        last ``_FAILURES_KEPT``), oldest first."""
        return self._failures.since(after)

    async def members(self) -> list[MemberView]:
        return [m.view() for pool in self._pools.values() for m in pool.members]

    async def shutdown(self) -> None:
        """Stop the routers, then every worker (gracefully), and kill their actors."""
        self._closed = True
        for task in (self._loop_task, self._planner_task):
            if task is not None:
                task.cancel()
        for pool in self._pools.values():
            for member in pool.members:
                if member.task is not None:
                    member.task.cancel()
        routers, self._pools[_ROUTERS].members = self._pools[_ROUTERS].members, []
        await asyncio.gather(*(stop(m) for m in routers))
        workers = [m for pool in self._worker_pools() for m in pool.members]
        for pool in self._worker_pools():
            pool.members = []
        await asyncio.gather(*(stop(m) for m in workers))

    # ----------------------------------------------------------------------------- loop
    def _worker_pools(self) -> list[Pool]:
        """Every served model's prefill and decode pools (not the routers)."""
        return [pool for key, pool in self._pools.items() if key != _ROUTERS]

    def _num_role_workers(self, role: Role, but: Pool) -> int:
        """How many workers ``role``'s pools of the other models want."""
        return sum(p.desired for p in self._worker_pools() if p.role is role and p is not but)

    def _sizes(self) -> list[PoolSize]:
        return [pool.size() for pool in self._worker_pools()]

    def _converged(self) -> bool:
        if len(self._pools[_ROUTERS].ready()) != self._cluster.num_routers:
            return False
        return all(
            s.num_ready == s.desired_workers and not s.num_starting and not s.num_draining
            for s in self._sizes()
        )

    async def _routers_route_all(self) -> bool:
        workers = {m.address for pool in self._worker_pools() for m in pool.ready()}
        return await self._probes.route_all(self._ready_routers(), workers)

    async def _run(self) -> None:
        while not self._closed:
            try:
                await self._reconcile()
            except Exception:
                logger.exception("reconcile failed; retrying")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), self._cluster.reconcile_interval_s)
            self._wakeup.clear()

    async def _reconcile(self) -> None:
        await self._reap_dead()
        draining: list[Member] = []
        for pool in self._worker_pools():
            if len(pool.ready()) >= pool.desired:
                # At its size (e.g. scaled down past a failing start): nothing is failing.
                pool.start_succeeded()
            live = pool.live()
            missing = pool.desired - len(live)
            if missing > 0:
                for _ in range(missing):
                    self._launch(pool)
            elif missing < 0:
                busy = await self._busy([m for m in live if m.state is MemberState.READY])
                for victim in pick_victims(live, busy, -missing):
                    if victim.state is MemberState.STARTING:
                        self._forget(victim)
                        self._background.spawn(stop(victim))
                    else:
                        victim.state = MemberState.DRAINING
                        draining.append(victim)
        self._note_shortages()
        used_slots = {m.slot for m in self._pools[_ROUTERS].members}
        for slot in range(self._cluster.num_routers):
            if slot not in used_slots:
                self._launch(self._pools[_ROUTERS], slot)
        # Every round, changed or not: a router that missed an update (a timeout) catches up.
        await self._push_pools()
        # Only once every router stopped choosing them (the push above).
        for member in draining:
            logger.info("draining %s %s (%s)", member.role, member.name, member.address)
            member.task = asyncio.get_running_loop().create_task(self._drain(member))

    def _note_shortages(self) -> None:
        """Say, in each pool's status, when the Ray cluster's live nodes cannot hold all its
        live members (a node lost, none added yet): those beyond the slots wait for a node.
        Asks Ray only while a worker is starting: placed workers fit by definition. A role's
        slots are shared by its pools of every model: a pool gets those the others leave."""
        pools = self._worker_pools()
        starting = any(m.state is MemberState.STARTING for pool in pools for m in pool.members)
        slots = ray.cluster_resources() if starting else {}
        for pool in pools:
            others = sum(len(p.live()) for p in pools if p.role is pool.role and p is not pool)
            num_slots = int(slots.get(pool.role.value, 0.0)) - others
            pool.note_shortage(max(num_slots, 0) if starting else len(pool.live()))

    # ----------------------------------------------------------------------------- start
    def _launch(self, pool: Pool, slot: int = 0) -> None:
        loop = asyncio.get_running_loop()
        if loop.time() < pool.retry_at_s:
            return
        role = pool.role
        name = f"{role}-{next(self._names)}-{self._token}"
        pools = {r: self._addresses(r) for r in POOL_ROLES}
        actor = self._actors.create(role, name, slot, pools, pool.model)
        member = Member(name, role, actor, slot, model=pool.model)
        pool.members.append(member)
        member.task = loop.create_task(self._start(member))

    async def _start(self, member: Member) -> None:
        role = member.role
        pool = self._pool_of(member)
        try:
            endpoint: Endpoint = await asyncio.wait_for(
                member.actor.start.remote(), self._cluster.worker_start_timeout_s
            )
        except Exception as exc:
            error = error_line(exc, self._cluster.worker_start_timeout_s)
            backoff_s = pool.start_failed(error, asyncio.get_running_loop().time())
            failures = pool.num_failed_starts
            self._failures.add(WorkerFailure(role, member.name, error, failures, backoff_s))
            # `splitserve up` prints each failure on its console (without repeating an error):
            # one line here, the whole traceback only at DEBUG.
            logger.info(
                "%s %s failed to start (attempt %d, retrying in %.0f s): %s",
                role,
                member.name,
                failures,
                backoff_s,
                error,
            )
            logger.debug("%s %s: failed start", role, member.name, exc_info=exc)
            self._forget(member)
            self._background.spawn(stop(member))
            return
        member.address = endpoint.address
        member.metrics_port = endpoint.metrics_port
        member.pid = endpoint.pid
        member.hostname = endpoint.hostname
        member.state = MemberState.READY
        member.task = None
        pool.start_succeeded()
        logger.info("%s %s ready at %s (pid %d)", role, member.name, member.address, member.pid)
        await self._push_pools()

    # ----------------------------------------------------------------------------- failures
    async def _reap_dead(self) -> None:
        """Forget every actor that no longer answers (the caller then updates the routers)."""
        watched = [
            m
            for pool in self._pools.values()
            for m in pool.members
            if m.state is not MemberState.STARTING
        ]
        answers = await asyncio.gather(*(alive(m) for m in watched))
        for member, ok in zip(watched, answers, strict=True):
            if ok or member not in self._pool_of(member).members:
                continue
            logger.warning(
                "%s %s (%s, pid %d) died or hangs; replacing it",
                member.role,
                member.name,
                member.address,
                member.pid,
            )
            if member.state is MemberState.READY:
                self._pool_of(member).num_restarts += 1
            if member.task is not None:
                member.task.cancel()
            self._forget(member)
            self._background.spawn(stop(member))

    # ----------------------------------------------------------------------------- drain
    async def _drain(self, member: Member) -> None:
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + self._cluster.drain_timeout_s
        quiet_polls = 0
        while quiet_polls < _DRAIN_QUIET_POLLS:
            if loop.time() > deadline_s:
                logger.warning(
                    "%s %s still busy after %.0f s of draining; stopping it anyway",
                    member.role,
                    member.name,
                    self._cluster.drain_timeout_s,
                )
                break
            await asyncio.sleep(_DRAIN_POLL_S)
            busy = await self._busy([member])
            quiet_polls = quiet_polls + 1 if busy[member.name] == 0 else 0
        self._forget(member)
        await self._push_pools()
        await stop(member)
        logger.info("%s %s drained and removed", member.role, member.name)
        if self._groups is not None:
            num_pods = sum(len(p.members) for p in self._worker_pools() if p.role is member.role)
            try:
                await asyncio.to_thread(
                    self._groups.set_replicas, member.role, num_pods, [member.hostname]
                )
            except Exception:
                logger.exception("could not shrink the %s worker group", member.role)

    async def _busy(self, members: list[Member]) -> dict[str, int]:
        return await self._probes.busy(members, self._ready_routers())

    # ----------------------------------------------------------------------------- membership
    def _pool_of(self, member: Member) -> Pool:
        return self._pools[_ROUTERS if member.role is Role.ROUTER else (member.model, member.role)]

    def _ready_routers(self) -> list[Member]:
        return self._pools[_ROUTERS].ready()

    def _addresses(self, role: Role) -> list[str]:
        """The ready workers of ``role``'s pools, every model's."""
        return [m.address for p in self._worker_pools() if p.role is role for m in p.ready()]

    def _forget(self, member: Member) -> None:
        self._pool_of(member).forget(member)
        self._probes.forget(member.address)
        self._wakeup.set()

    async def _push_pools(self) -> None:
        """Tell every ready router each role's members (address -> draining), every model's
        in one pool: the routers tell models apart by what each worker reports serving."""
        async with self._push_lock:
            pools = {
                role: {
                    m.address: m.state is MemberState.DRAINING
                    for p in self._worker_pools()
                    if p.role is role
                    for m in p.members
                    if m.state is not MemberState.STARTING
                }
                for role in POOL_ROLES
            }
            routers = self._ready_routers()
            await asyncio.gather(*(push_pools_to(r, pools) for r in routers))


def _pool_name(pool: Pool) -> str:
    """How logs and errors name a pool: "decode", or "<model> decode" for a model's."""
    return f"{pool.model} {pool.role}" if pool.model else str(pool.role)
