"""Every metric the shipped Grafana dashboard queries is exported by the cluster's processes
and moves under a short load: a Ray cluster (so that the orchestrator's pool sizes exist too)
whose KV cache is small enough for preemptions and a queue, a prefill worker killed once (a
restart), repeated prompts (prefix hits, routing predictions), a short one (a prefill on the
decode worker) and constant ones, whose greedy continuations on the tiny model repeat a token
(prompt-lookup drafts proposed and accepted)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import urllib.error
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from services.cluster.driver import RayCluster
from tests.services.cluster.conftest import router_client, wait_for_pools
from tests.services.conftest import greedy, scrape
from tests.waiting import wait_until

DASHBOARD = (
    Path(__file__).resolve().parents[3] / "deploy/helm/splitserve/dashboards/splitserve.json"
)
_METRIC = re.compile(r"(vllm:[a-z0-9_:]+|splitserve_[a-z0-9_]+)")
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# Gauges of a transient state: they must exist, and are nonzero only while a worker starts.
_TRANSIENT_GAUGES = {"splitserve_pool_starting_workers"}


def dashboard_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return {
        name
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        for name in _METRIC.findall(target["expr"])
    }


class Scraper:
    """Scrapes every member's /metrics in a loop; keeps each series' largest value."""

    def __init__(self, cluster: RayCluster) -> None:
        self._cluster = cluster
        self.peak: dict[str, float] = defaultdict(float)  # metric name -> max over series
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.scrape_all()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.scrape_all()

    def scrape_all(self) -> None:
        for member in self._cluster.members():
            try:
                samples = scrape(member.metrics_port)
            except (urllib.error.URLError, ConnectionError):  # a member starting or stopping
                continue
            for (name, _), value in samples.items():
                self.peak[name] = max(self.peak[name], value)


def test_every_dashboard_metric_is_exported_and_moves(start_ray_cluster):
    cluster = start_ray_cluster(
        num_prefill_workers=1,
        num_decode_workers=1,
        # 16 blocks of 16 tokens, 4 sequences: 6 long streams queue and preempt each other.
        engine_fields={"num_kv_blocks": 16, "max_model_len": 256, "max_num_seqs": 4},
        router_fields={"local_prefill_max_tokens": 8},
    )
    client = router_client(cluster)
    prefill = next(m for m in cluster.members() if m.role == "prefill")
    os.kill(prefill.pid, signal.SIGKILL)
    wait_for_pools(client, prefill=1, decode=1)

    shared = [(5 * j) % 400 + 3 for j in range(48)]
    prompts = [[*shared, i + 3] for i in range(6)] + [[7, 8, 9], [5] * 32, [7] * 16]

    def generate(prompt: list[int]) -> int:
        return len(
            client.generate(token_ids=prompt, sampling=greedy(100, ignore_eos=True)).token_ids
        )

    with Scraper(cluster) as scraper, ThreadPoolExecutor(len(prompts)) as pool:
        for _ in range(2):
            assert list(pool.map(generate, prompts)) == [100] * len(prompts)
        # The router asks the orchestrator for the pool sizes every 5 s.
        wait_until(
            lambda: scraper.peak["splitserve_pool_restarts_total"] >= 1, 30, "the restart counted"
        )

    missing, unmoved = [], []
    for name in sorted(dashboard_metrics()):
        if name not in scraper.peak:
            missing.append(name)
        elif scraper.peak[name] <= 0 and name not in _TRANSIENT_GAUGES:
            unmoved.append(name)
    assert not missing, f"queried by the dashboard, exported by no process: {missing}"
    assert not unmoved, f"queried by the dashboard, never above 0 under load: {unmoved}"
    names = dashboard_metrics()
    assert any(n.endswith(_HISTOGRAM_SUFFIXES) for n in names) and len(names) >= 20
    client.close()
