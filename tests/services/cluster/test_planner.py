"""The autoscaler's decisions per pool: breaches grow, idleness shrinks, noise does nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
from pathlib import Path

from services.cluster.autoscaler import Autoscaler
from services.cluster.members import Pool
from services.cluster.planner import PlannerConfig, PoolPlanner, PoolSignals, percentile
from services.common.roles import Role

CONFIG = PlannerConfig(
    autoscale=True,
    target_ttft_ms=1000.0,
    target_itl_ms=100.0,
    breach_evaluations=2,
    idle_evaluations=3,
    scale_up_cooldown_s=30.0,
    scale_down_cooldown_s=120.0,
    max_prefill_workers=4,
    max_decode_workers=4,
)
QUIET_PREFILL = PoolSignals(num_workers=1, latency_ms=700.0, queue_per_worker=1.0)
QUIET_DECODE = PoolSignals(num_workers=1, latency_ms=70.0, queue_per_worker=1.0, kv_usage=0.6)


def run(role: str, trace: list[PoolSignals], interval_s: float = 10.0) -> list[int]:
    """Replay ``trace`` (each window's signals, sizes fed back) and return the size after
    each evaluation."""
    planner = PoolPlanner(role, CONFIG)
    size = trace[0].num_workers
    sizes = []
    for i, signals in enumerate(trace):
        fed_back = PoolSignals(size, signals.latency_ms, signals.queue_per_worker, signals.kv_usage)
        size = planner.decide(fed_back, now_s=i * interval_s)
        sizes.append(size)
    return sizes


def both_pools(prefill: list[PoolSignals], decode: list[PoolSignals]) -> dict[str, list[int]]:
    return {"prefill": run("prefill", prefill), "decode": run("decode", decode)}


def test_ttft_breach_grows_prefill_only():
    slow = PoolSignals(num_workers=1, latency_ms=2500.0, queue_per_worker=1.0)
    sizes = both_pools([QUIET_PREFILL, slow, slow, slow], [QUIET_DECODE] * 4)
    assert sizes["prefill"] == [1, 1, 2, 2]  # after two breaching windows, then cooldown
    assert sizes["decode"] == [1, 1, 1, 1]


def test_itl_breach_grows_decode_only():
    slow = PoolSignals(num_workers=1, latency_ms=180.0, queue_per_worker=1.0, kv_usage=0.6)
    sizes = both_pools([QUIET_PREFILL] * 4, [QUIET_DECODE, slow, slow, slow])
    assert sizes["decode"] == [1, 1, 2, 2]
    assert sizes["prefill"] == [1, 1, 1, 1]


def test_queue_and_kv_usage_breach_too():
    queued = PoolSignals(num_workers=2, latency_ms=None, queue_per_worker=20.0)
    assert run("prefill", [queued, queued]) == [2, 3]
    full = PoolSignals(num_workers=2, latency_ms=50.0, queue_per_worker=0.0, kv_usage=0.97)
    assert run("decode", [full, full]) == [2, 3]


def test_a_lasting_breach_grows_once_per_cooldown_up_to_the_maximum():
    slow = PoolSignals(num_workers=1, latency_ms=5000.0, queue_per_worker=50.0)
    sizes = run("prefill", [slow] * 20)  # 10 s windows, 30 s cooldown
    assert sizes[:6] == [1, 2, 2, 2, 3, 3]
    assert max(sizes) == CONFIG.max_prefill_workers and sizes[-1] == 4


def test_idle_pool_shrinks_slowly_and_never_below_its_minimum():
    idle = PoolSignals(num_workers=3, latency_ms=10.0, queue_per_worker=0.0, kv_usage=0.1)
    sizes = run("decode", [idle] * 40)
    assert sizes[:3] == [3, 3, 2]  # three idle windows
    assert sizes.count(2) >= 12  # then 120 s of cooldown before the next step
    assert min(sizes) == CONFIG.min_decode_workers == sizes[-1]
    no_traffic = PoolSignals(num_workers=1, latency_ms=None, queue_per_worker=0.0)
    assert run("prefill", [no_traffic] * 5) == [1, 1, 0, 0, 0]  # min_prefill_workers is 0
    assert run("decode", [idle] * 3)[-1] == 2


def test_between_the_thresholds_nothing_moves():
    # Under target but above scale_down_ratio of it: neither breach nor idle.
    middle = PoolSignals(num_workers=2, latency_ms=70.0, queue_per_worker=1.0, kv_usage=0.6)
    assert run("decode", [middle] * 30) == [2] * 30


def test_latency_percentile_is_nearest_rank():
    assert percentile([], 0.9) is None
    assert percentile([5.0], 0.9) == 5.0
    assert percentile([float(i) for i in range(1, 11)], 0.9) == 9.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0


def test_recorded_noisy_trace_does_not_flap():
    """A trace recorded from a real cluster under a steady load (``loadtest.bench.record_signals``),
    with the targets placed at its median latency, so the signal keeps crossing them."""
    path = Path(__file__).parents[2] / "fixtures" / "planner_trace.json"
    windows = json.loads(path.read_text())["windows"]
    for role, target_name in (("prefill", "target_ttft_ms"), ("decode", "target_itl_ms")):
        latencies = sorted(w[role]["latency_ms"] for w in windows if w[role]["latency_ms"])
        median = latencies[len(latencies) // 2]
        config = PlannerConfig(
            autoscale=True,
            **{target_name: median},
            target_queue_per_worker=1e9,
            target_kv_usage=1.0,
            planner_interval_s=2.0,
            scale_up_cooldown_s=30.0,
            scale_down_cooldown_s=120.0,
        )
        planner = PoolPlanner(role, config)
        size, sizes = 2, []
        for i, window in enumerate(windows):
            signals = PoolSignals(size, window[role]["latency_ms"], 0.0, window[role]["kv_usage"])
            size = planner.decide(signals, now_s=i * config.planner_interval_s)
            sizes.append(size)
        changes = [b - a for a, b in itertools.pairwise(sizes) if b != a]
        # Never a step back against the previous one (up then down, or down then up).
        assert all(a == b for a, b in itertools.pairwise(changes)), (role, sizes)
        assert len(changes) <= len(windows) * config.planner_interval_s / 30.0


class _Probes:
    """Hands the autoscaler fixed signals per pool, as the routers and workers would."""

    def __init__(self, signals: dict) -> None:
        self.signals_by_pool = signals
        self.asked: list[set] = []

    async def signals(self, routers, pools):
        self.asked.append(set(pools))
        return {
            key: dataclasses.replace(self.signals_by_pool[key], num_workers=desired)
            for key, (desired, _) in pools.items()
        }


def test_each_models_pools_are_planned_apart():
    """Two models' decode pools: only the one whose own ITL breaches grows."""
    slow = PoolSignals(num_workers=1, latency_ms=180.0, queue_per_worker=1.0, kv_usage=0.6)
    pools = {(m, Role.DECODE): Pool(Role.DECODE, 1, model=m) for m in ("a", "b")}
    probes = _Probes({("a", Role.DECODE): QUIET_DECODE, ("b", Role.DECODE): slow})
    scaled: list[tuple[str, Role, int]] = []

    async def scale(model: str, role: Role, num_workers: int) -> None:
        scaled.append((model, role, num_workers))
        pools[(model, role)].desired = num_workers

    autoscaler = Autoscaler(CONFIG, pools, Pool(Role.ROUTER, 1), probes, scale)  # type: ignore[arg-type]
    for now_s in (0.0, 10.0, 20.0):
        asyncio.run(autoscaler._decide(now_s))
    assert scaled == [("b", Role.DECODE, 2)]
    assert probes.asked == [set(pools)] * 3
