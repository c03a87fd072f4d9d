"""Pools of Ray actors resized, and actors killed, under a live load of streams.

Everything is real: a local Ray instance, the controller and router actors, worker actors
serving the tiny model, gRPC clients. Every output is checked against the offline engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading

import grpc
import pytest
import redis

from engine import SamplingParams
from services.cluster.config import ClusterConfig
from services.cluster.planner import PlannerConfig
from services.service_process import PortReservation
from splitserve.v1 import router_pb2
from tests.services.cluster.conftest import (
    ROLES,
    Load,
    router_address,
    router_client,
    scale,
    wait_for_pools,
)
from tests.services.conftest import NUM_KV_BLOCKS, Client, greedy, scrape
from tests.waiting import wait_until


def test_scale_prefill_1_3_1_and_decode_1_2_1_under_load(start_ray_cluster, offline):
    cluster = start_ray_cluster(num_prefill_workers=1, num_decode_workers=1)
    client = router_client(cluster)
    load = Load(router_address(cluster), concurrency=4).start()
    try:
        load.wait_for(8)
        reply = scale(client, "prefill", 3)
        assert {p.role: p.desired_workers for p in reply.pools} == {
            ROLES["prefill"]: 3,
            ROLES["decode"]: 1,
        }
        wait_for_pools(client, prefill=3, decode=1)
        load.wait_for(24)
        # Added workers are routed to: fresh prompts cache nowhere, so load decides.
        busy = [
            w
            for w in client.status().workers
            if w.role == ROLES["prefill"] and w.load.num_cached_blocks + w.load.num_used_blocks
        ]
        assert len(busy) >= 2
        scale(client, "prefill", 1)
        wait_for_pools(client, prefill=1, decode=1)
        load.wait_for(8)
        scale(client, "decode", 2)
        wait_for_pools(client, prefill=1, decode=2)
        load.wait_for(16)
        scale(client, "decode", 1)
        wait_for_pools(client, prefill=1, decode=1)
        load.wait_for(8)
    finally:
        load.stop()
    load.check(offline)
    pools = {p.role: p for p in client.status().pools}
    assert pools[ROLES["prefill"]].num_restarts == pools[ROLES["decode"]].num_restarts == 0
    # Drained, not cut off: no request had to fall back or move to another worker.
    router = next(m for m in cluster.members() if m.role == "router")
    metrics = scrape(router.metrics_port)
    assert metrics[("splitserve_router_prefill_fallbacks_total", ())] == 0
    assert metrics[("splitserve_router_decode_failovers_total", ())] == 0
    assert len([m for m in cluster.members() if m.role != "router"]) == 2
    client.close()


def test_scaling_decode_up_and_down_leaves_no_index_entries_of_removed_workers(
    start_ray_cluster, offline, redis_server
):
    cluster = start_ray_cluster(
        num_prefill_workers=1, num_decode_workers=1, redis_url=redis_server.url
    )
    client = router_client(cluster)
    load = Load(router_address(cluster), concurrency=3).start()
    index = redis.Redis.from_url(redis_server.url)
    try:
        for _ in range(5):
            scale(client, "decode", 2)
            wait_for_pools(client, prefill=1, decode=2)
            load.wait_for(4)
            scale(client, "decode", 1)
            wait_for_pools(client, prefill=1, decode=1)
            load.wait_for(4)
    finally:
        load.stop()
    load.check(offline)

    def indexed() -> set[str]:
        prefix = "splitserve:worker:"
        return {k.decode()[len(prefix) :] for k in index.scan_iter(f"{prefix}*")}

    live = {m.name for m in cluster.members() if m.role != "router"}
    wait_until(
        lambda: not indexed() - live,
        30,
        lambda: f"no index entries of removed workers (left: {indexed() - live})",
        0.2,
    )
    index.close()
    client.close()


class Streams:
    """Long greedy streams, one thread each; ``progress[i]`` holds the tokens stream ``i``
    received so far (or the error that ended it)."""

    def __init__(self, client: Client, prompts: list[list[int]], max_tokens: int) -> None:
        self.prompts = prompts
        self.max_tokens = max_tokens
        self.progress: dict[int, list[int] | Exception] = {}
        self.threads = [
            threading.Thread(target=self._run, args=(client, i)) for i in range(len(prompts))
        ]
        for thread in self.threads:
            thread.start()

    def _run(self, client: Client, i: int) -> None:
        request = router_pb2.GenerateRequest(
            token_ids=self.prompts[i], sampling=greedy(self.max_tokens, ignore_eos=True)
        )
        tokens: list[int] = []
        try:
            for message in client.stub.Generate(request, timeout=120):
                tokens.extend(message.token_ids)
                self.progress[i] = list(tokens)
        except grpc.RpcError as exc:
            self.progress[i] = exc

    def wait_until_each_has(self, num_tokens: int) -> None:
        wait_until(
            lambda: all(
                isinstance(self.progress.get(i), list) and len(self.progress[i]) >= num_tokens
                for i in range(len(self.prompts))
            ),
            60,
            lambda: f"{num_tokens} tokens on each stream (progress: {self.progress})",
            0.005,
        )

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def check(self, offline) -> None:
        """Every stream ended with exactly the offline engine's greedy tokens."""
        for thread in self.threads:
            thread.join(timeout=120)
        params = SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True)
        for i, expected in enumerate(offline.generate(self.prompts, params)):
            assert self.progress[i] == expected.token_ids, f"stream {i}: {self.progress[i]!r:.200}"


def test_decode_actor_killed_mid_stream_requests_finish_elsewhere(start_ray_cluster, offline):
    cluster = start_ray_cluster(num_prefill_workers=1, num_decode_workers=2)
    client = router_client(cluster)
    prompts = [[(7 * i + 11 * j) % 470 + 3 for j in range(24 + 5 * i)] for i in range(6)]
    streams = Streams(client, prompts, max_tokens=400)
    streams.wait_until_each_has(3)
    status = client.status()
    victim = max(
        (w for w in status.workers if w.role == ROLES["decode"]), key=lambda w: w.load.num_running
    )
    assert victim.load.num_running > 0
    pid = next(m.pid for m in cluster.members() if m.address == victim.address)
    os.kill(pid, signal.SIGKILL)
    streams.check(offline)
    router = next(m for m in cluster.members() if m.role == "router")
    failovers = scrape(router.metrics_port)[("splitserve_router_decode_failovers_total", ())]
    assert failovers >= 1
    # The pool is back at its size, with a new worker.
    wait_for_pools(client, decode=2)
    pools = {p.role: p for p in client.status().pools}
    assert pools[ROLES["decode"]].num_restarts == 1
    assert victim.address not in {w.address for w in client.status().workers}
    client.close()


def test_decode_actor_hung_mid_stream_is_fenced_then_replaced(start_ray_cluster, offline):
    """SIGSTOP, not a crash: the routers fence it and its streams finish elsewhere; the
    controller replaces it once it has missed 3 pings."""
    cluster = start_ray_cluster(num_prefill_workers=1, num_decode_workers=2)
    client = router_client(cluster)
    prompts = [[(5 * i + 13 * j) % 470 + 3 for j in range(20 + 4 * i)] for i in range(4)]
    streams = Streams(client, prompts, max_tokens=300)
    streams.wait_until_each_has(3)
    victim = max(
        (w for w in client.status().workers if w.role == ROLES["decode"]),
        key=lambda w: w.load.num_running,
    )
    pid = next(m.pid for m in cluster.members() if m.address == victim.address)
    os.kill(pid, signal.SIGSTOP)
    try:
        streams.check(offline)
        wait_until(
            lambda: victim.address not in {m.address for m in cluster.members()},
            120,
            "the replacement of the hung actor",
            0.5,
        )
        wait_for_pools(client, decode=2)
    finally:
        with contextlib.suppress(ProcessLookupError):  # Ray killed it
            os.kill(pid, signal.SIGCONT)
    pools = {p.role: p for p in client.status().pools}
    assert pools[ROLES["decode"]].num_restarts == 1
    client.close()


def test_prefill_actor_killed_pool_restored_no_failed_request(start_ray_cluster, offline):
    cluster = start_ray_cluster(num_prefill_workers=2, num_decode_workers=1)
    client = router_client(cluster)
    load = Load(router_address(cluster), concurrency=4, seed=1).start()
    try:
        load.wait_for(8)
        victim = next(m for m in cluster.members() if m.role == "prefill")
        os.kill(victim.pid, signal.SIGKILL)
        load.wait_for(8)
        wait_for_pools(client, prefill=2, decode=1)
        load.wait_for(8)
    finally:
        load.stop()
    load.check(offline)
    pools = {p.role: p for p in client.status().pools}
    assert pools[ROLES["prefill"]].num_restarts == 1
    assert victim.address not in {w.address for w in client.status().workers}
    client.close()


def test_scale_rejects_sizes_the_cluster_cannot_have(start_ray_cluster):
    cluster = start_ray_cluster(num_prefill_workers=0, num_decode_workers=1)
    client = router_client(cluster)
    too_many = ClusterConfig().max_workers_per_pool + 1
    for pool, size, message in [
        ("decode", 0, "at least 1"),
        ("prefill", too_many, "max_workers_per_pool"),
    ]:
        with pytest.raises(grpc.RpcError) as info:
            scale(client, pool, size)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in info.value.details() and "Traceback" not in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        client.stub.Scale(router_pb2.ScaleRequest(role=0, num_workers=1), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Nothing changed.
    wait_for_pools(client, prefill=0, decode=1)
    client.close()


def test_scale_down_drains_a_busy_worker_before_removing_it(start_ray_cluster, offline):
    cluster = start_ray_cluster(num_prefill_workers=1, num_decode_workers=2)
    client = router_client(cluster)
    prompts = [[(13 * i + 5 * j) % 470 + 3 for j in range(30)] for i in range(4)]
    streams = Streams(client, prompts, max_tokens=600)
    streams.wait_until_each_has(3)
    decode = [w for w in client.status().workers if w.role == ROLES["decode"]]
    assert all(w.load.num_running for w in decode), decode
    scale(client, "decode", 1)

    def seen_draining_busy() -> bool:
        assert streams.running, "the streams ended before a draining worker was seen streaming"
        return any(w.draining and w.load.num_running > 0 for w in client.status().workers)

    # The worker picked to go keeps streaming while draining: listed, draining, still running.
    wait_until(seen_draining_busy, 120, "a draining worker still streaming", 0.02)
    streams.check(offline)
    wait_for_pools(client, decode=1)
    router = next(m for m in cluster.members() if m.role == "router")
    assert scrape(router.metrics_port)[("splitserve_router_decode_failovers_total", ())] == 0
    client.close()


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *argv], capture_output=True, text=True, timeout=300
    )


def test_scale_and_status_commands_add_a_prefill_pool_at_run_time(start_ray_cluster, offline):
    # The prefill pool's own flags (--prefill-worker-args) reach the workers scaled in later.
    cluster = start_ray_cluster(
        num_prefill_workers=0, num_decode_workers=1, prefill_worker_args="--num-kv-blocks 64"
    )
    address = router_address(cluster)
    client = router_client(cluster)
    prompt = list(range(3, 70))
    request = router_pb2.GenerateRequest(token_ids=prompt, sampling=greedy(8))
    assert client.stub.Explain(request, timeout=10).prefill_place == "no_prefill_worker"

    scaled = _cli("scale", "prefill", "1", "--wait", "--target", address)
    assert scaled.returncode == 0, scaled.stderr
    header, prefill_row, decode_row = scaled.stdout.split("\n")[:3]
    assert header.split() == [
        "MODEL", "POOL", "DESIRED", "READY", "STARTING", "DRAINING", "RESTARTS", "FAILED_STARTS",
    ]  # fmt: skip
    model = client.status().model
    assert prefill_row.split() == [model, "prefill", "1", "1", "0", "0", "0", "0"]
    assert decode_row.split() == [model, "decode", "1", "1", "0", "0", "0", "0"]

    table = _cli("status", "--target", address)
    assert table.returncode == 0, table.stderr
    worker_rows = [line.split() for line in table.stdout.splitlines() if ":" in line]
    roles_states = sorted((row[1], row[4]) for row in worker_rows if row[1] in ROLES)
    assert roles_states == [("decode", "ready"), ("prefill", "ready")]
    status = json.loads(_cli("status", "--json", "--target", address).stdout)
    assert {p["role"]: p["num_ready"] for p in status["pools"]} == {
        "WORKER_ROLE_PREFILL": 1,
        "WORKER_ROLE_DECODE": 1,
    }
    blocks = {w.role: w.load.num_total_blocks for w in client.status().workers}
    assert blocks == {ROLES["prefill"]: 64, ROLES["decode"]: NUM_KV_BLOCKS}

    # The new pool takes prompts at once, with the same output.
    assert client.stub.Explain(request, timeout=10).prefill_place == "prefill_worker"
    out = client.generate(token_ids=prompt, sampling=greedy(8))
    want = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert out.token_ids == want.token_ids
    bad = _cli("scale", "decode", "0", "--target", address)
    assert bad.returncode == 2 and "INVALID_ARGUMENT" in bad.stderr
    client.close()


def test_router_actor_killed_is_replaced_on_its_port(start_ray_cluster, offline):
    reservation = PortReservation()  # held while the router actors bind it
    port = reservation.port
    cluster = start_ray_cluster(num_prefill_workers=1, num_decode_workers=1, port=port)
    router = next(m for m in cluster.members() if m.role == "router")
    assert router.address == f"127.0.0.1:{port}"
    os.kill(router.pid, signal.SIGKILL)

    def replaced() -> list:
        routers = [m for m in cluster.members() if m.role == "router" and m.state == "ready"]
        return routers if routers and routers[0].pid != router.pid else []

    routers = wait_until(
        replaced, 120, lambda: f"a new router ready (members: {cluster.members()})", 0.2
    )
    assert routers[0].address == router.address
    # The new router knows the pools at once and serves on the same address.
    client = Client(router.address)
    prompt = list(range(5, 60))
    out = client.generate(token_ids=prompt, sampling=greedy(6))
    want = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6))[0]
    assert out.token_ids == want.token_ids
    assert len(client.status().workers) == 2
    client.close()
    reservation.close()


def test_planner_grows_the_prefill_pool_on_a_ttft_breach_and_leaves_decode(
    start_ray_cluster, offline
):
    # Any TTFT breaches its target; ITL, queues and KV usage never do.
    planner = PlannerConfig(
        autoscale=True,
        planner_interval_s=0.5,
        target_ttft_ms=0.001,
        target_itl_ms=1e6,
        target_queue_per_worker=1e6,
        target_kv_usage=1.0,
        breach_evaluations=2,
        scale_up_cooldown_s=0.0,
        max_prefill_workers=2,
    )
    cluster = start_ray_cluster(num_prefill_workers=1, num_decode_workers=1, planner=planner)
    client = router_client(cluster)
    load = Load(router_address(cluster), concurrency=2, seed=2).start()
    try:
        wait_for_pools(client, prefill=2, decode=1, timeout_s=120)
        load.wait_for(4)
    finally:
        load.stop()
    load.check(offline)
    pools = {p.role: p.desired_workers for p in client.status().pools}
    assert pools == {ROLES["prefill"]: 2, ROLES["decode"]: 1}
    client.close()
