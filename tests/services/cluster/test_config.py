"""``splitserve up``'s flags: the cluster's shape and what reaches every worker and router."""

from __future__ import annotations

import re

import pytest

from engine.config import EngineKind
from services.cli import build_parser
from services.cluster.config import ClusterConfig
from services.common.roles import Role
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


def test_each_pool_starts_from_the_shared_flags_with_its_own_set_over_them():
    args = build_parser().parse_args(
        [
            "up", "--model", "m", "--max-num-seqs", "9", "--kv-transfer", "tcp",
            "--prefill-worker-args", "--max-num-batched-tokens 4096 --kv-io-timeout-s 3",
            "--decode-worker-args", "--engine vllm --vllm-args '--block-size 32'",
        ]
    )  # fmt: skip
    cluster, worker, _, _ = configs_from_args(args)
    prefill = cluster.pool_worker_config(Role.PREFILL, worker)
    decode = cluster.pool_worker_config(Role.DECODE, worker)
    assert (prefill.engine.max_num_batched_tokens, prefill.kv_io_timeout_s) == (4096, 3.0)
    assert prefill.engine.engine is EngineKind.NATIVE and prefill.engine.max_num_seqs == 9
    assert (decode.engine.engine, decode.engine.vllm_args) == (EngineKind.VLLM, "--block-size 32")
    assert decode.engine.max_num_batched_tokens == worker.engine.max_num_batched_tokens
    assert prefill.kv_transfer == decode.kv_transfer == "tcp"
    # Workers hand text to the router whatever a pool says.
    assert not prefill.engine.detokenize and not decode.engine.detokenize


@pytest.mark.parametrize(
    ("pool_args", "message"),
    [
        ("--port 7000", "prefill_worker_args: --port is set for each worker, not for a pool"),
        ("--worker-id=w", "prefill_worker_args: --worker-id is set for each worker"),
        ("--max-num-seq 3", "prefill_worker_args: unrecognized arguments: --max-num-seq"),
        ("--max-num-seqs many", "prefill_worker_args: argument --max-num-seqs: invalid int"),
        ("--lease-ttl-s 0", "prefill_worker_args: lease_ttl_s must be > 0"),
        ("--vllm-args '--block-size 32", "prefill_worker_args: No closing quotation"),
    ],
)
def test_a_bad_pool_flag_is_one_error_naming_the_pool(pool_args, message):
    args = build_parser().parse_args(["up", "--model", "m", f"--prefill-worker-args={pool_args}"])
    with pytest.raises(ValueError, match=re.escape(message)):
        configs_from_args(args)
