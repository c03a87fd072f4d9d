"""A worker's KV pull metrics (served by ``start_metrics_server``), labelled with the
served ``model_name`` as the standard metrics are (``services.common.serving_metrics``)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

_PULL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)

KV_PULL_SECONDS = Histogram(
    "splitserve_kv_pull_seconds",
    "from starting a KV read to its end, by backend and outcome (done | failed)",
    ["model_name", "backend", "outcome"],
    buckets=_PULL_BUCKETS_S,
)
KV_PULLED_BLOCKS = Counter(
    "splitserve_kv_pulled_blocks_total",
    "KV blocks read from peers (a prefill worker's prompt, a peer's prefix)",
    ["model_name", "backend"],
)
KV_PULLED_BYTES = Counter(
    "splitserve_kv_pulled_bytes_total",
    "bytes of KV read from peers",
    ["model_name", "backend"],
)
