"""``loadtest.bench.control_plane`` end to end at a small size: its fleet fills a real Redis
through the workers' publishers, the router decides through ``PrefillChooser`` (whole and
sampled, matching in Redis and in its replica), and every figure it reports is consistent
with what it did."""

from __future__ import annotations

import argparse
import asyncio
import math

from loadtest.bench.control_plane import Fleet, measure_size
from loadtest.fixtures.redis_server import RedisServer


def test_a_small_sweep_reports_consistent_figures(tmp_path) -> None:
    args = argparse.Namespace(
        max_candidates="0,4",
        match_in="redis,replica",
        kv_event_stream_len=10_000,
        blocks_per_worker=80,
        system_prompts=4,
        system_blocks=8,
        systems_per_worker=2,
        user_blocks=2,
        decisions=40,
        in_flight=2,
        duration_s=0.5,
        event_rate=200.0,
        event_blocks=4,
        ingest_s=0.5,
        ingest_decision_rate=50.0,
        heartbeat_ttl_s=30.0,
        seed=0,
    )
    redis_server = RedisServer(tmp_path)
    redis_server.start()
    try:
        results = asyncio.run(measure_size(redis_server.url, 8, args))
    finally:
        redis_server.stop()
    fleet = Fleet.make(8, args)
    assert [(r.max_candidates, r.match_in) for r in results] == [
        (0, "redis"),
        (0, "replica"),
        (4, "redis"),
        (4, "replica"),
    ]
    for r in results:
        assert (r.workers, r.entries) == (8, 8 * 80)
        assert r.cached_blocks == fleet.num_blocks < r.entries  # system prompts are shared
        assert r.index_bytes_per_block > 0 and r.index_bytes_per_entry > 0
        assert 0 < r.decision_p50_ms <= r.decision_p99_ms
        assert r.decisions_per_s > 0 and r.router_cpu_us_per_decision > 0
        assert r.redis_commands_per_decision > 0
        assert r.ingest_events_per_s > 0 and not math.isnan(r.ingest_lag_p99_ms)
        assert r.republications == 0
        assert r.stream_mib > 0
        # (replica_bytes_per_entry, the process's RSS growth while the replica loads, is 0
        # when the heap already had room from earlier tests in this process: not asserted.)
        if r.match_in == "replica":  # the match left Redis: fewer commands per decision
            same = next(
                x for x in results if (x.max_candidates, x.match_in) == (r.max_candidates, "redis")
            )
            assert r.redis_commands_per_decision < same.redis_commands_per_decision
