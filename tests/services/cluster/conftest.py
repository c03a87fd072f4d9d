"""A real local Ray instance and clusters of Ray actors on the tiny model."""

from __future__ import annotations

import dataclasses
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import pytest
import ray

from engine import LLM, SamplingParams
from services.cluster.config import ClusterConfig
from services.cluster.driver import RayCluster, init_ray
from services.cluster.planner import PlannerConfig
from services.common.redis_config import RedisConfig
from services.router.config import RouterConfig
from services.worker.config import WorkerConfig
from splitserve.v1 import router_pb2, worker_pb2
from tests.services.conftest import NUM_KV_BLOCKS, Client, greedy, tiny_engine_config
from tests.waiting import wait_until

ROLES = {"prefill": worker_pb2.WORKER_ROLE_PREFILL, "decode": worker_pb2.WORKER_ROLE_DECODE}


@pytest.fixture(scope="session")
def ray_instance(tmp_path_factory) -> Iterator[None]:
    """One local Ray instance for the session, bound to loopback, in its own temp dir."""
    init_ray(
        ClusterConfig(),
        _temp_dir=str(tmp_path_factory.mktemp("ray")),
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    yield
    ray.shutdown()


@pytest.fixture
def start_ray_cluster(ray_instance, tiny_llama_dir) -> Iterator[Callable[..., RayCluster]]:
    """Factory: ``start_ray_cluster(num_prefill_workers=1, num_decode_workers=1, ...)``
    returns a started cluster (stopped at the end of the test); with ``redis_url`` its workers
    and routers share that prefix index; ``engine_fields`` / ``router_fields`` override the
    engine's and the router's config."""
    started: list[RayCluster] = []

    def start(
        controller_env: dict[str, str] | None = None,
        planner: PlannerConfig | None = None,
        redis_url: str | None = None,
        engine_fields: dict | None = None,
        router_fields: dict | None = None,
        **cluster_fields,
    ) -> RayCluster:
        engine = dataclasses.replace(
            tiny_engine_config(tiny_llama_dir), detokenize=False, **(engine_fields or {})
        )
        redis = RedisConfig(redis_url)
        cluster = RayCluster(
            ClusterConfig(**{"port": 0, "reconcile_interval_s": 0.5, **cluster_fields}),
            WorkerConfig(engine=engine, port=0, redis=redis, heartbeat_ttl_s=1.0),
            # Every prompt through a prefill worker, as in the process-cluster tests.
            RouterConfig(
                model=str(tiny_llama_dir),
                port=0,
                http_port=0,
                **{"local_prefill_max_tokens": 0, **(router_fields or {})},
                redis=redis,
            ),
            planner=planner or PlannerConfig(),
            log_level="INFO",
            controller_env=controller_env or {},
        )
        started.append(cluster)
        cluster.start(timeout_s=240)
        return cluster

    yield start
    for cluster in started:
        cluster.stop()


def router_address(cluster: RayCluster) -> str:
    return next(m.address for m in cluster.members() if m.role == "router")


def router_client(cluster: RayCluster) -> Client:
    return Client(router_address(cluster))


def scale(client: Client, pool: str, num_workers: int) -> router_pb2.ScaleResponse:
    return client.stub.Scale(
        router_pb2.ScaleRequest(role=ROLES[pool], num_workers=num_workers), timeout=30
    )


def wait_for_pools(client: Client, timeout_s: float = 180.0, **sizes: int) -> None:
    """Poll Status until each named pool (prefill=N, decode=N) has exactly N ready workers,
    none starting or draining, and the router lists exactly those."""
    seen: list[router_pb2.StatusResponse | None] = [None]  # the last answer, for a failure

    def at_sizes() -> bool:
        try:
            status = client.status()
        except grpc.RpcError as exc:
            # Status has been seen to stall once while the controller replaces a hung actor.
            assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
            return False
        seen[0] = status
        pools = {p.role: p for p in status.pools}
        ok = True
        for pool, size in sizes.items():
            p = pools[ROLES[pool]]
            listed = [w for w in status.workers if w.role == ROLES[pool]]
            ok &= p.desired_workers == size and p.num_ready == size
            ok &= not p.num_starting and not p.num_draining
            ok &= len(listed) == size and all(w.healthy and not w.draining for w in listed)
        return ok

    wait_until(at_sizes, timeout_s, lambda: f"pools at {sizes} (last status: {seen[0]})", 0.2)


@dataclass(slots=True)
class LoadResult:
    prompt: list[int]
    token_ids: list[int]
    finish_reason: int


@dataclass
class Load:
    """Concurrent streams of fresh random prompts, each greedy, until ``stop``; every error is
    kept. ``check`` compares every output with the offline engine's."""

    address: str
    concurrency: int = 4
    max_tokens: int = 16
    seed: int = 0
    results: list[LoadResult] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Load:
        for i in range(self.concurrency):
            thread = threading.Thread(target=self._run, args=(self.seed * 1000 + i,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        client = Client(self.address)
        try:
            while not self._stop.is_set():
                prompt = [rng.randrange(3, 480) for _ in range(rng.randrange(20, 90))]
                try:
                    out = client.generate(
                        token_ids=prompt,
                        sampling=greedy(self.max_tokens, ignore_eos=True),
                        timeout_s=120,
                    )
                except grpc.RpcError as exc:
                    with self._lock:
                        self.errors.append(f"{exc.code().name}: {exc.details()}")
                    continue
                with self._lock:
                    self.results.append(LoadResult(prompt, out.token_ids, out.last.finish_reason))
        finally:
            client.close()

    def wait_for(self, num_results: int, timeout_s: float = 120.0) -> None:
        """Block until ``num_results`` more requests than now have completed."""
        target = len(self.results) + num_results

        def reached() -> bool:
            assert all(t.is_alive() for t in self._threads)
            return len(self.results) >= target

        wait_until(
            reached, timeout_s, lambda: f"{num_results} more results (errors: {self.errors[-3:]})"
        )

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=180)

    def check(self, offline: LLM) -> None:
        """No request failed, and every output is the offline engine's greedy output."""
        assert self.errors == []
        assert self.results
        prompts = [r.prompt for r in self.results]
        params = SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True)
        want = offline.generate(prompts, params)
        for result, expected in zip(self.results, want, strict=True):
            assert result.token_ids == expected.token_ids
            assert result.finish_reason == router_pb2.FINISH_REASON_LENGTH


@pytest.fixture(scope="module")
def offline(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)
