"""Workers as the router's choosers see them, without a process or a channel.

``W`` describes one worker's state (what a ``GetInfo`` / ``GetLoad`` poll would have set); its
``build`` gives a real ``WorkerHandle`` whose channel and stub are never used (the choosers only
read ``healthy``, ``draining``, ``info``, ``load`` and ``num_inflight``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

from services.common.roles import Role
from services.router.worker_pool import WorkerHandle, WorkerPool
from splitserve.v1 import worker_pb2

PREFILL = Role.PREFILL
DECODE = Role.DECODE
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class W:
    """One worker's last polled state; its ``worker_id`` is its address."""

    address: str
    running: int = 0
    waiting: int = 0
    waiting_for_kv: int = 0
    inflight: int = 0
    kv_usage: float = 0.0
    queued_prefill_tokens: int = 0
    healthy: bool = True
    draining: bool = False
    shutting_down: bool = False
    block_size: int = BLOCK_SIZE
    # Its KV cache's compat_hash; None: its engine's KV cannot move (a vLLM worker's today).
    kv_layout: str | None = "fake"
    model: str = "m"  # the served model it reports
    lora_adapters: tuple[str, ...] = ()
    max_model_len: int = 256
    scheduling_policy: str = "fcfs"

    def build(self, role: Role) -> WorkerHandle:
        return WorkerHandle(
            address=self.address,
            role=role,
            channel=cast(Any, None),  # no channel: nothing here calls the worker
            stub=cast(Any, None),
            healthy=self.healthy,
            info=worker_pb2.WorkerInfo(
                worker_id=self.address,
                role=role.to_proto(),
                served_model_name=self.model,
                model=f"/models/{self.model}",
                max_model_len=self.max_model_len,
                scheduling_policy=self.scheduling_policy,
                vocab_size=100,
                block_size=self.block_size,
                kv_peer=(
                    None
                    if self.kv_layout is None
                    else worker_pb2.KVPeerInfo(backend="tcp", compat_hash=self.kv_layout)
                ),
            ),
            load=worker_pb2.WorkerLoad(
                num_running=self.running,
                num_waiting=self.waiting,
                num_waiting_for_kv=self.waiting_for_kv,
                kv_usage=self.kv_usage,
                num_queued_prefill_tokens=self.queued_prefill_tokens,
                shutting_down=self.shutting_down,
                lora_adapters=[
                    worker_pb2.LoraAdapterInfo(name=name, block_key=f"{name}@key")
                    for name in self.lora_adapters
                ],
            ),
            num_inflight=self.inflight,
            draining=self.draining,
        )


def make_pool(role: Role, workers: Iterable[W]) -> WorkerPool:
    """A pool holding ``workers`` (built with no channel: the pool opens none for them)."""
    pool = WorkerPool(role, ())
    pool.workers = [w.build(role) for w in workers]
    return pool
