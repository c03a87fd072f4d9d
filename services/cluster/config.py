"""Configuration of a Ray-orchestrated cluster: its shape and how the controller runs it."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from engine.flags import flag
from services.cluster.models import ModelSpec, parse_extra_models
from services.common.roles import MODES, POOL_ROLES, ClusterMode, Role
from services.common.tls import identity_tls_dir
from services.worker.config import WorkerConfig


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """Pool sizes, actor placement and the controller's timing (``splitserve up`` flags)."""

    num_prefill_workers: int = flag(1, "prefill workers at start (splitserve scale changes it)")
    num_decode_workers: int = flag(1, "decode workers at start (splitserve scale changes it)")
    num_routers: int = flag(
        1,
        "router replicas sharing the workers, on ports --port, --port+1, ... (above 1 needs "
        "--redis-url to share the prefix index and reservations)",
    )
    mode: ClusterMode = flag(
        ClusterMode.DISAGGREGATED,
        "disaggregated: prefill and decode pools; colocated: decode workers run whole requests",
        choices=MODES,
    )
    host: str = flag("127.0.0.1", "address every server binds (0.0.0.0 in a pod)")
    port: int = flag(50051, "first router's port")
    ray: bool = flag(True, "run every service as a Ray actor (--no-ray: plain local processes)")
    ray_address: str = flag(
        "", "Ray cluster to join (auto: the one this node belongs to; empty: start a local one)"
    )
    router_metrics_port: int = flag(
        0, "Prometheus port of the first router (the next ones: +1, +2, ...; 0: any free port)"
    )
    worker_metrics_port: int = flag(
        0,
        "Prometheus port of every worker (only where each node runs one worker, as in a "
        "Kubernetes pod; 0: any free port)",
    )
    prefill_num_gpus: float = flag(0.0, "GPUs each prefill worker actor reserves")
    decode_num_gpus: float = flag(0.0, "GPUs each decode worker actor reserves")
    prefill_worker_args: str = flag(
        "",
        "engine and worker flags of the prefill pool only, set over the shared ones, e.g. "
        "'--max-num-batched-tokens 8192' or '--engine vllm --vllm-args \"--block-size 32\"'",
    )
    decode_worker_args: str = flag(
        "",
        "engine and worker flags of the decode pool only, set over the shared ones, e.g. "
        "'--max-num-seqs 256 --kv-cache-memory-gb 16'",
    )
    extra_models: str = flag(
        "",
        "more models behind the same routers, each with its own pools, as a JSON list: "
        '[{"name": "b", "model": "org/b", "num_decode_workers": 2, "worker_args": '
        '"--max-model-len 512"}] (revision, num_prefill_workers, num_decode_workers, '
        "worker_args optional; see docs/multi-model.md)",
    )
    max_workers_per_pool: int = flag(64, "largest size splitserve scale accepts for a pool")
    kuberay_cluster: str = flag(
        "",
        "KubeRay RayCluster whose worker groups (prefill, decode) host the pools: scaling "
        "patches their replicas (set by the Helm chart; empty: not on Kubernetes)",
    )
    kuberay_namespace: str = flag("default", "namespace of --kuberay-cluster")
    worker_start_timeout_s: float = flag(
        600.0, "seconds a new worker may take to load its model and turn healthy"
    )
    drain_timeout_s: float = flag(
        300.0,
        "seconds a draining worker gets to finish its requests and have its KV leases "
        "released before it is stopped anyway (its requests then move to other workers)",
    )
    tls_dir: str = flag(
        "",
        "directory written by splitserve certs (one subdirectory per identity): every gRPC "
        "hop is mutual TLS, the routers' client ports serve TLS (empty: plaintext)",
    )
    reconcile_interval_s: float = flag(
        1.0, "seconds between the controller's liveness checks of every actor"
    )

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        # Given as its name (a test, a caller's literal): the member, so that `is` holds.
        object.__setattr__(self, "mode", ClusterMode(self.mode))
        if self.num_routers < 1:
            raise ValueError(f"num_routers must be >= 1, got {self.num_routers}")
        self.check_pool_size(Role.PREFILL, self.num_prefill_workers)
        self.check_pool_size(Role.DECODE, self.num_decode_workers)
        for name in ("worker_start_timeout_s", "drain_timeout_s", "reconcile_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.prefill_num_gpus < 0 or self.decode_num_gpus < 0:
            raise ValueError("prefill_num_gpus and decode_num_gpus must be >= 0")
        for role in POOL_ROLES:
            self.worker_args(role)
        for spec in self.extra_model_specs():
            self.check_pool_size(Role.PREFILL, self.num_workers(spec, Role.PREFILL))
            self.check_pool_size(Role.DECODE, self.num_workers(spec, Role.DECODE))

    def extra_model_specs(self, primary_name: str = "") -> tuple[ModelSpec, ...]:
        """``--extra-models``' entries (``ValueError`` naming the problem; ``primary_name``:
        the ``--model``'s served name, which no entry may take)."""
        return parse_extra_models(self.extra_models, primary_name)

    def num_workers(self, spec: ModelSpec | None, role: Role) -> int:
        """The size ``role``'s pool of a model starts at: the entry's, else the cluster's
        (``spec`` None: the ``--model``'s pools). A colocated cluster has no prefill pool."""
        if role is Role.PREFILL:
            if self.mode is ClusterMode.COLOCATED:
                return 0
            given = spec.num_prefill_workers if spec is not None else None
            return self.num_prefill_workers if given is None else given
        given = spec.num_decode_workers if spec is not None else None
        return self.num_decode_workers if given is None else given

    def check_pool_size(self, role: Role, num_workers: int) -> None:
        """Raise ``ValueError`` naming the problem if ``role``'s pool cannot have that size."""
        if role not in POOL_ROLES:
            raise ValueError(f"role must be one of {[r.value for r in POOL_ROLES]}, got {role!r}")
        if not 0 <= num_workers <= self.max_workers_per_pool:
            raise ValueError(
                f"num_workers: {role} pool size must be in [0, {self.max_workers_per_pool}] "
                f"(max_workers_per_pool), got {num_workers}"
            )
        if role == Role.DECODE and num_workers < 1:
            raise ValueError("num_workers: the decode pool needs at least 1 worker")
        if role == Role.PREFILL and num_workers > 0 and self.mode is ClusterMode.COLOCATED:
            raise ValueError("num_workers: a colocated cluster has no prefill pool")

    @property
    def pool_roles(self) -> tuple[Role, ...]:
        """The pools this cluster's mode has: no prefill pool when colocated."""
        if self.mode is ClusterMode.COLOCATED:
            return (Role.DECODE,)
        return POOL_ROLES

    def worker_args(self, role: Role) -> list[str]:
        """``role``'s pool flags (``--prefill-worker-args`` / ``--decode-worker-args``) as an
        argv; ``ValueError`` when the text does not split (an unclosed quote)."""
        text = self.prefill_worker_args if role == Role.PREFILL else self.decode_worker_args
        try:
            return shlex.split(text)
        except ValueError as exc:
            raise ValueError(f"{role}_worker_args: {exc}: {text!r}") from None

    def pool_worker_config(self, role: Role, shared: WorkerConfig) -> WorkerConfig:
        """The config ``role``'s workers start from: ``shared`` with the pool's flags set over
        it (``ValueError`` naming the pool's flag that does not apply)."""
        try:
            return shared.with_pool_flags(self.worker_args(role))
        except ValueError as exc:
            raise ValueError(f"{role}_worker_args: {exc}") from None

    def num_gpus(self, role: Role) -> float:
        return self.prefill_num_gpus if role == Role.PREFILL else self.decode_num_gpus

    def identity_tls_dir(self, identity: str) -> str:
        """The TLS directory of one identity (router, prefill, decode, controller) under
        ``tls_dir``; empty when TLS is off."""
        return identity_tls_dir(self.tls_dir, identity)
