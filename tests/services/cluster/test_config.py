"""``splitserve up``'s flags: the cluster's shape and what reaches every worker and router."""

from __future__ import annotations

import pytest

from services.cli import build_parser
from services.cluster.config import ClusterConfig
from services.up import configs_from_args


def test_pool_sizes_are_checked_with_clear_messages():
    config = ClusterConfig(max_workers_per_pool=4)
    config.check_pool_size("prefill", 0)
    config.check_pool_size("decode", 4)
    for role, size, message in [
        ("decode", 0, "at least 1"),
        ("prefill", 5, "max_workers_per_pool"),
        ("router", 1, "role must be one of"),
    ]:
        with pytest.raises(ValueError, match=message):
            config.check_pool_size(role, size)
    with pytest.raises(ValueError, match="colocated cluster has no prefill pool"):
        ClusterConfig(mode="colocated").check_pool_size("prefill", 1)
    with pytest.raises(ValueError, match="num_routers"):
        ClusterConfig(num_routers=0)


def test_up_flags_reach_the_worker_and_router_configs(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_PREFILL_LOAD_WEIGHT", "0.25")
    args = build_parser().parse_args(
        [
            "up", "--model", "m", "--num-prefill-workers", "3", "--num-decode-workers", "2",
            "--host", "0.0.0.0", "--port", "6000", "--lease-ttl-s", "7", "--kv-transfer", "tcp",
            "--prefill-policy", "random", "--max-num-seqs", "9", "--redis-url", "redis://r:1",
            "--drain-timeout-s", "12", "--no-ray", "--target-itl-ms", "80",
        ]
    )  # fmt: skip
    cluster, worker, router, planner = configs_from_args(args)
    assert (cluster.num_prefill_workers, cluster.num_decode_workers) == (3, 2)
    assert (cluster.drain_timeout_s, cluster.ray) == (12.0, False)
    assert (worker.host, worker.lease_ttl_s, worker.kv_transfer) == ("0.0.0.0", 7.0, "tcp")
    assert worker.engine.max_num_seqs == 9 and worker.engine.detokenize is False
    assert worker.engine.num_threads is not None  # the cores are split between the 5 engines
    assert (router.model, router.host, router.port) == ("m", "0.0.0.0", 6000)
    assert (router.prefill_policy, router.prefill_load_weight) == ("random", 0.25)
    assert worker.redis.redis_url == router.redis.redis_url == "redis://r:1"
    assert planner.target_itl_ms == 80.0 and not planner.autoscale
