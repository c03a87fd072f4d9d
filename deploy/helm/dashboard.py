"""Write ``splitserve/dashboards/splitserve.json``: the Grafana dashboard the chart ships.

Run ``python deploy/helm/dashboard.py`` after changing a panel; ``tests/deploy`` fails while the
committed JSON differs from what this produces, and
``tests/services/cluster/test_dashboard_metrics.py`` while a query names a metric that no
process exports or that a short load leaves unmoved.

Every panel is per pool (``router``: the client's view; ``prefill`` and ``decode``: each worker
pool's own), over the metrics of ``services/common/serving_metrics.py`` (vLLM's names) and the
``splitserve_*`` ones: latency quantiles, throughput, queue depth, KV usage, prefix hit rate,
the KV transfer's share of TTFT, routing accuracy (predicted vs realized prefix hits), the
draft acceptance rate of speculative decoding, pool sizes and the orchestrator's target (a step
is a planner decision or a ``Scale`` call).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parent / "splitserve" / "dashboards" / "splitserve.json"
_MODEL = 'model_name=~"$model_name"'
_RATE = "[$__rate_interval]"
_WIDTH = 24
_HEIGHT = 8


def _quantiles(metric: str) -> list[tuple[str, str]]:
    """p50 / p90 / p99 of histogram ``metric`` per pool."""
    return [
        (
            f"histogram_quantile({q}, sum by (le, pool) "
            f"(rate({metric}_bucket{{{_MODEL}}}{_RATE})))",
            f"{{{{pool}}}} p{round(q * 100)}",
        )
        for q in (0.5, 0.9, 0.99)
    ]


def _p90s(*metrics: tuple[str, str]) -> list[tuple[str, str]]:
    """The p90 of each ``(histogram, what)`` per pool, one query each."""
    queries = []
    for metric, what in metrics:
        expr, legend = _quantiles(metric)[1]
        queries.append((expr, legend.replace("p90", f"{what} p90")))
    return queries


def _per_pool_rate(metric: str, by: str = "pool") -> list[tuple[str, str]]:
    legend = " ".join(f"{{{{{label.strip()}}}}}" for label in by.split(","))
    return [(f"sum by ({by}) (rate({metric}{{{_MODEL}}}{_RATE}))", legend)]


# (row title, [(panel title, unit, [(expr, legend), ...]), ...])
_ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    (
        "Latency per pool",
        [
            ("Time to first token", "s", _quantiles("vllm:time_to_first_token_seconds")),
            ("Inter-token latency", "s", _quantiles("vllm:inter_token_latency_seconds")),
            ("End-to-end latency", "s", _quantiles("vllm:e2e_request_latency_seconds")),
            (
                "Time per output token",
                "s",
                _quantiles("vllm:request_time_per_output_token_seconds"),
            ),
            ("Queue time", "s", _quantiles("vllm:request_queue_time_seconds")),
            (
                "Prefill and decode time (p90)",
                "s",
                _p90s(
                    ("vllm:request_prefill_time_seconds", "prefill"),
                    ("vllm:request_decode_time_seconds", "decode"),
                ),
            ),
        ],
    ),
    (
        "Throughput",
        [
            (
                "Tokens per second",
                "short",
                [
                    (
                        f"sum by (pool) (rate(vllm:generation_tokens_total{{{_MODEL}}}{_RATE}))",
                        "{{pool}} generated",
                    ),
                    (
                        f"sum by (pool) (rate(vllm:prompt_tokens_total{{{_MODEL}}}{_RATE}))",
                        "{{pool}} prompt",
                    ),
                ],
            ),
            (
                "Finished requests per second",
                "reqps",
                _per_pool_rate("vllm:request_success_total", "pool, finished_reason"),
            ),
            (
                "Prompt and generation length (p90)",
                "short",
                _p90s(
                    ("vllm:request_prompt_tokens", "prompt"),
                    ("vllm:request_generation_tokens", "generated"),
                ),
            ),
        ],
    ),
    (
        "Load",
        [
            (
                "Requests running and waiting",
                "short",
                [
                    (f"sum by (pool) (vllm:num_requests_running{{{_MODEL}}})", "{{pool}} running"),
                    (f"sum by (pool) (vllm:num_requests_waiting{{{_MODEL}}})", "{{pool}} waiting"),
                ],
            ),
            (
                "KV cache usage",
                "percentunit",
                [
                    (f"avg by (pool) (vllm:kv_cache_usage_perc{{{_MODEL}}})", "{{pool}} mean"),
                    (f"max by (pool) (vllm:kv_cache_usage_perc{{{_MODEL}}})", "{{pool}} max"),
                ],
            ),
            ("Preemptions per second", "short", _per_pool_rate("vllm:num_preemptions_total")),
        ],
    ),
    (
        "Prefix cache, routing and KV transfer",
        [
            (
                "Prefix cache hit rate",
                "percentunit",
                [
                    (
                        f"sum by (pool) (rate(vllm:prefix_cache_hits_total{{{_MODEL}}}{_RATE})) / "
                        f"sum by (pool) (rate(vllm:prefix_cache_queries_total{{{_MODEL}}}{_RATE}))",
                        "{{pool}}",
                    )
                ],
            ),
            (
                "Routing accuracy: realized / predicted prefix hits",
                "percentunit",
                [
                    (
                        f"sum(rate(splitserve_router_prefix_hit_blocks_realized_total{_RATE})) / "
                        f"sum(rate(splitserve_router_prefix_hit_blocks_predicted_total{_RATE}))",
                        "realized / predicted",
                    )
                ],
            ),
            (
                "KV transfer share of TTFT",
                "percentunit",
                [
                    (
                        f"sum(rate(splitserve_kv_pull_seconds_sum{{{_MODEL}}}{_RATE})) / "
                        "sum(rate(vllm:time_to_first_token_seconds_sum"
                        f'{{{_MODEL}, pool="router"}}{_RATE}))',
                        "pull time / client TTFT",
                    )
                ],
            ),
            (
                "KV transfer bytes per second",
                "Bps",
                [
                    (
                        "sum by (backend) "
                        f"(rate(splitserve_kv_pulled_bytes_total{{{_MODEL}}}{_RATE}))",
                        "{{backend}}",
                    )
                ],
            ),
            (
                "Prefills on decode workers per second",
                "short",
                [
                    (
                        f"sum by (reason) (rate(splitserve_router_local_prefills_total{_RATE}))",
                        "{{reason}}",
                    )
                ],
            ),
        ],
    ),
    (
        "Speculative decoding",
        [
            (
                "Draft acceptance rate",
                "percentunit",
                [
                    (
                        "sum by (pool) "
                        f"(rate(vllm:spec_decode_num_accepted_tokens_total{{{_MODEL}}}{_RATE})) / "
                        "sum by (pool) "
                        f"(rate(vllm:spec_decode_num_draft_tokens_total{{{_MODEL}}}{_RATE}))",
                        "{{pool}} accepted / proposed",
                    )
                ],
            ),
            (
                "Draft tokens per second",
                "short",
                [
                    (
                        "sum by (pool) "
                        f"(rate(vllm:spec_decode_num_draft_tokens_total{{{_MODEL}}}{_RATE}))",
                        "{{pool}} proposed",
                    ),
                    (
                        "sum by (pool) "
                        f"(rate(vllm:spec_decode_num_accepted_tokens_total{{{_MODEL}}}{_RATE}))",
                        "{{pool}} accepted",
                    ),
                ],
            ),
        ],
    ),
    (
        "Pools",
        [
            (
                "Pool members by state",
                "short",
                [
                    (
                        f"sum by (pool, state) (splitserve_pool_workers{{{_MODEL}}})",
                        "{{pool}} {{state}}",
                    )
                ],
            ),
            (
                "Pool target size (planner and Scale decisions)",
                "short",
                [
                    (
                        f"max by (pool) (splitserve_pool_desired_workers{{{_MODEL}}})",
                        "{{pool}} desired",
                    ),
                    (
                        f"max by (pool) (splitserve_pool_starting_workers{{{_MODEL}}})",
                        "{{pool}} starting",
                    ),
                ],
            ),
            (
                "Worker restarts",
                "short",
                [(f"max by (pool) (splitserve_pool_restarts_total{{{_MODEL}}})", "{{pool}}")],
            ),
        ],
    ),
]


def _panel(panel_id: int, title: str, unit: str, queries: list[tuple[str, str]]) -> dict:
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "expr": expr,
                "legendFormat": legend,
            }
            for i, (expr, legend) in enumerate(queries)
        ],
    }


def dashboard() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model: a row per topic, three panels a line."""
    panels: list[dict[str, Any]] = []
    y = 0
    for row_title, row_panels in _ROWS:
        panels.append(
            {
                "id": len(panels) + 1,
                "type": "row",
                "title": row_title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": _WIDTH, "x": 0, "y": y},
                "panels": [],
            }
        )
        y += 1
        width = _WIDTH // 3
        for i, (title, unit, queries) in enumerate(row_panels):
            panel = _panel(len(panels) + 1, title, unit, queries)
            x = (i % 3) * width
            panel["gridPos"] = {"h": _HEIGHT, "w": width, "x": x, "y": y + (i // 3) * _HEIGHT}
            panels.append(panel)
        y += -(-len(row_panels) // 3) * _HEIGHT
    return {
        "uid": "splitserve",
        "title": "splitserve",
        "description": "Disaggregated serving per pool: latency, throughput, load, prefix "
        "cache, routing, KV transfer, speculative decoding, pool sizes "
        "(github.com/splitserve/splitserve).",
        "tags": ["splitserve", "llm", "vllm"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                },
                {
                    "name": "model_name",
                    "label": "Model",
                    "type": "query",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": "label_values(vllm:e2e_request_latency_seconds_count, model_name)",
                    "refresh": 2,
                    "includeAll": True,
                    "multi": True,
                    "current": {"text": "All", "value": "$__all"},
                },
            ]
        },
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    DASHBOARD.parent.mkdir(exist_ok=True)
    DASHBOARD.write_text(render())
