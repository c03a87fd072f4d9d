"""The router's Prometheus metrics (served by ``start_metrics_server``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

REQUESTS = Counter(
    "splitserve_router_requests_total",
    "Generate calls by outcome: stop, length, abort, tool_calls, invalid, rejected, cancelled, "
    "error",
    ["outcome"],
)
INFLIGHT = Gauge("splitserve_router_inflight_requests", "Generate calls in flight")
TTFT = Histogram(
    "splitserve_router_time_to_first_token_seconds",
    "from receiving Generate to sending the first token",
    buckets=_LATENCY_BUCKETS_S,
)
E2E = Histogram(
    "splitserve_router_e2e_request_latency_seconds",
    "from receiving Generate to its last message",
    buckets=_LATENCY_BUCKETS_S,
)
ITL = Histogram(
    "splitserve_router_inter_token_latency_seconds",
    "time between two streamed tokens of a request (a message of n tokens counts n times)",
    buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
)
PROMPT_TOKENS = Counter("splitserve_router_prompt_tokens_total", "prompt tokens of served requests")
GENERATION_TOKENS = Counter("splitserve_router_generation_tokens_total", "tokens streamed")
PREFILL_FALLBACKS = Counter(
    "splitserve_router_prefill_fallbacks_total",
    "requests prefilled on their decode worker because the prefill worker failed",
)
DECODE_FAILOVERS = Counter(
    "splitserve_router_decode_failovers_total",
    "times a request moved to another decode worker after its worker failed",
)
PREFIX_HITS_PREDICTED = Counter(
    "splitserve_router_prefix_hit_blocks_predicted_total",
    "prompt blocks the prefix index said the chosen prefill worker caches",
)
PREFIX_HITS_REALIZED = Counter(
    "splitserve_router_prefix_hit_blocks_realized_total",
    "prompt blocks the chosen prefill worker reported as prefix-cache hits",
)
PREFIX_TIER_HITS_PREDICTED = Counter(
    "splitserve_router_prefix_tier_hit_blocks_predicted_total",
    "of the predicted hits, blocks the prefix index said are in the chosen worker's tier alone",
)
PREFIX_TIER_HITS_REALIZED = Counter(
    "splitserve_router_prefix_tier_hit_blocks_realized_total",
    "of the realized hits, blocks the chosen worker loaded back from its second tier",
)
PREFIX_INDEX_ERRORS = Counter(
    "splitserve_router_prefix_index_errors_total",
    "prefix index lookups that failed or timed out (routed on load alone)",
)
DECISION_SECONDS = Histogram(
    "splitserve_router_decision_seconds",
    "time to choose (and reserve) a request's prefill worker, prefix index lookup included",
    buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1),
)
LOCAL_PREFILLS = Counter(
    "splitserve_router_local_prefills_total",
    "requests prefilled on their decode worker by choice: short_uncached, saturated, "
    "no_prefill_worker",
    ["reason"],
)
PEER_PULLS = Counter(
    "splitserve_router_peer_pulls_total",
    "prefixes planned to be pulled from a peer's cache rather than computed, by outcome: "
    "pulled, not_cached, pin_failed, pull_failed (the last three computed them)",
    ["outcome"],
)
PEER_PULLED_BLOCKS = Counter(
    "splitserve_router_peer_pulled_blocks_total",
    "KV blocks prefill workers pulled from peers instead of computing them",
)
TENANT_TOKENS = Counter(
    "splitserve_router_tenant_tokens_total",
    "tokens of each tenant's requests: prompt, cached (prompt tokens served from a prefix "
    "cache) and generated",
    ["tenant", "kind"],
)
TENANT_REJECTED = Counter(
    "splitserve_router_tenant_rejected_total",
    "requests refused over their tenant's limit: max_concurrent_requests, max_tokens_per_s",
    ["tenant", "limit"],
)
