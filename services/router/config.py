"""Router configuration: every field is a flag with an env var (see ``engine.flags``)."""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass, field

from engine.flags import flag, from_args
from engine.sampling_params import MAX_LOGPROBS
from services.common.redis_config import RedisConfig
from services.common.roles import MODES, ClusterMode
from services.common.service_flags import parse_service_args, shared_configs
from services.common.tracing import TracingConfig
from services.router.openai.protocol import MAX_GENERATIONS
from services.router.request_prep import RequestBounds
from services.router.tenants import parse_tenant_limits
from services.router.tool_calls.parsers import FORMATS, ToolCallFormat

PREFILL_POLICIES = ("cost", "round_robin", "random")
# The longest uncached part whose prefill in the decode worker's batch did not stretch its
# running streams' p99 inter-token latency, measured on CPU with SmolLM2 (BENCHMARKS.md,
# "Conditional disaggregation"); GPUs prefill far faster and warrant a higher value.
LOCAL_PREFILL_MAX_TOKENS = 32


def _split_addresses(text: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in text.split(",") if a.strip())


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """How the router listens, which workers it drives, and its admission limits."""

    model: str = flag(
        help="model directory, .gguf file, alias or Hugging Face repo id (org/name; only its "
        "tokenizer files are fetched): the workers' --model, for the tokenizer"
    )
    revision: str | None = flag(
        None, "branch, tag or commit of a Hugging Face repo id --model (default: main)"
    )
    served_model_name: str | None = flag(
        None, "the model name clients see (Router.Status); default: --model"
    )
    host: str = flag("127.0.0.1", "address the gRPC server binds (0.0.0.0 in a pod)")
    port: int = flag(50051, "client-facing gRPC port")
    http: bool = flag(
        True, "serve the OpenAI-compatible HTTP API (/v1/chat/completions, ...; --no-http: off)"
    )
    http_port: int = flag(
        8000, "port of the OpenAI-compatible HTTP API, on --host (0: any free port)"
    )
    prefill_workers: str = flag(
        "", "comma-separated host:port of prefill workers (under Ray: set by the controller)"
    )
    decode_workers: str = flag(
        "", "comma-separated host:port of decode workers (under Ray: set by the controller)"
    )
    mode: ClusterMode = flag(
        ClusterMode.DISAGGREGATED,
        "disaggregated: prefill workers build the KV, decode workers pull it; "
        "colocated: decode workers run whole requests",
        choices=MODES,
    )
    max_inflight_requests: int = flag(1024, "requests in flight before RESOURCE_EXHAUSTED")
    max_prompt_bytes: int = flag(
        4 * 2**20, "largest prompt text, or sum of chat message contents, in UTF-8 bytes"
    )
    max_messages: int = flag(1024, "most chat messages in one request")
    max_n: int = flag(
        16,
        f"most choices (n) one HTTP request may ask for, 1 to {MAX_GENERATIONS} (a completions "
        f"request's prompts x n are at most {MAX_GENERATIONS} generations whatever this is)",
    )
    max_logprobs: int = flag(
        MAX_LOGPROBS,
        f"most logprobs (top alternatives per token) a request may ask for, through either API "
        f"(at most {MAX_LOGPROBS}, the engine's)",
    )
    tool_call_parser: ToolCallFormat | None = flag(
        None,
        "how the model writes tool calls that tool_choice auto parses (vLLM's "
        "--tool-call-parser): hermes (Qwen2.5/3, Hermes, SmolLM2), llama3_json (Llama 3.1-3.3), "
        "mistral; default: detected from the chat template (hermes for a template without tools, "
        "which then shows them in Hermes' form)",
        choices=FORMATS,
    )
    allow_runtime_lora_updating: bool = flag(
        False,
        "serve LoRA adapters loaded at run time (/v1/load_lora_adapter, Router.LoadLoraAdapter; "
        "vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): an admin names a path the workers read, so "
        "it is off unless asked for; adapters given to the workers at start (--lora-modules) "
        "are served either way",
    )
    max_request_output_tokens: int = flag(
        262144,
        "most tokens one HTTP request may generate over all its choices: generations x "
        "max_tokens, where a chat request without max_tokens counts the model's context length "
        "per generation; also the largest max_tokens of a gRPC request",
    )
    stream_idle_timeout_s: float = flag(
        60.0,
        "seconds a response (HTTP or gRPC) may stay unread (its send blocked, the client's "
        "buffers full) before the router cuts it off and cancels its generations",
    )
    http_max_header_bytes: int = flag(
        65536, "largest HTTP request head (request line and headers), in bytes (431 above)"
    )
    http_header_timeout_s: float = flag(
        10.0,
        "seconds a client has to send a whole HTTP request head, from its first byte (or from "
        "connecting); then the connection is closed (408)",
    )
    http_body_timeout_s: float = flag(
        60.0,
        "seconds a client has to send a whole HTTP request body, from the end of its head; "
        "then the connection is closed (408)",
    )
    http_keep_alive_timeout_s: float = flag(
        5.0, "seconds an idle HTTP connection is kept open for its next request"
    )
    http_max_connections: int = flag(
        4096, "most open HTTP connections; one more is answered 503 and closed"
    )
    http_send_buffer_bytes: int = flag(
        65536,
        "each HTTP connection's kernel send buffer (SO_SNDBUF; the kernel doubles it), in bytes: "
        "what a client that stops reading leaves buffered before its generations pause",
    )
    max_decode_retries: int = flag(
        2, "times a request moves to another decode worker when its worker fails"
    )
    decode_failover_wait_s: float = flag(
        30.0,
        "when a request's decode worker fails and no other one is routable: seconds the "
        "stream waits for one (a replacement starting, a worker back from a partition) before "
        "it ends UNAVAILABLE; bounded by the client's deadline",
    )
    worker_call_timeout_s: float = flag(
        3600.0,
        "deadline of each call to a worker when the client set none or a later one (a worker "
        "that runs past it is given up and the request continues elsewhere)",
    )
    health_check_interval_s: float = flag(0.5, "seconds between worker load/health polls")
    worker_fence_after_failed_polls: int = flag(
        2,
        "health polls in a row a worker may fail before the router fences it: its open calls "
        "are cancelled and their requests continue on other workers",
    )
    prefill_policy: str = flag(
        "cost",
        "cost: the cheapest worker by cache hits and load (colocated: the replica); "
        "round_robin, random: cache-blind "
        "baselines for comparison",
        choices=PREFILL_POLICIES,
    )
    prefill_cache_weight: float = flag(
        1.0, "prefill cost per prompt block the worker does not cache"
    )
    prefill_load_weight: float = flag(
        0.5,
        "prefill cost per block of prefill work queued (below the cache weight: queued work runs "
        "anyway, an uncached block is work added; BENCHMARKS.md)",
    )
    prefill_load_bound: float = flag(
        2.0,
        "bounded load: a prefill worker takes a new request only while its reserved requests "
        "stay within ceil(bound * (all reserved + 1) / workers), so a hot prefix spills onto a "
        "second worker (0: no bound)",
    )
    prefill_load_bound_slack: int = flag(
        8,
        "prefill requests a worker may always have in flight whatever the load bound (keeps a "
        "lightly loaded cluster from spreading prefixes for nothing)",
    )
    prefill_saturation_blocks: float = flag(
        1024.0,
        "when every prefill worker has this many blocks queued, the decode worker prefills "
        "(0: never)",
    )
    prefill_max_candidates: int = flag(
        32,
        "prefill workers one decision scores: in a larger pool, the holders of the prompt's "
        "longest prefixes (at most half) and a random sample of the others (0: every worker)",
    )
    local_prefill_max_tokens: int = flag(
        LOCAL_PREFILL_MAX_TOKENS,
        "the decode worker prefills a prompt itself when at most this many of its tokens are "
        "not cached there (0: always use the prefill pool when it has a healthy worker)",
    )
    priority_local_prefill_max_tokens: int = flag(
        1024,
        "the decode worker prefills a prompt itself, rather than have it wait behind the "
        "prefill in progress, when its priority is better than every prefill this router has "
        "on the chosen prefill worker, at most this many of its tokens are not cached there, "
        "and the decode worker runs --scheduling-policy priority (0: never)",
    )
    peer_pull_min_tokens: int = flag(
        16,
        "the prefill worker pulls a prompt's prefix from the worker (prefill or decode) that "
        "holds the most of it (cache or tier), instead of computing it, when that worker holds "
        "at least this many tokens more than the prefill worker (0: never pull from a peer; on "
        "a GPU, where a block computes in well under a millisecond, raise it)",
    )
    decode_load_weight: float = flag(1.0, "decode cost per request active on the worker")
    decode_move_weight: float = flag(
        0.05, "decode cost per prompt block the worker does not cache (to pull or compute)"
    )
    router_id: str = flag(
        "", "this router's id in Redis (default: router-<hostname>-<pid>-<random>)"
    )
    router_heartbeat_ttl_s: float = flag(
        3.0, "seconds a crashed router's prefill reservations keep counting in Redis"
    )
    prefix_index_timeout_s: float = flag(
        0.25,
        "seconds a prefill decision waits for Redis before it routes on load alone, blind to "
        "every cache (a busy router's own event loop counts: a decision under overload often "
        "takes tens of ms, and a blind one costs the prompt's whole recompute)",
    )
    api_key_file: str = flag(
        "",
        "file of the API keys clients must send ('authorization: Bearer KEY'): one per line, "
        "optionally followed by its role, data (Generate) or admin (also Scale, Status, "
        "Explain), and tenant=NAME; re-read on SIGHUP and within 5 s of a change. Without it "
        "and --admin-api-key, calls need no key",
    )
    admin_api_key: str = flag(
        "",
        "one admin API key, besides those of --api-key-file (set it through the env var)",
        secret=True,
    )
    tenant_limits: str = flag(
        "",
        "each tenant's limits on this router (a key's tenant is tenant=NAME in --api-key-file, "
        "else 'default'): 'NAME:max_concurrent_requests=N,max_tokens_per_s=R,priority=P;...', "
        "'*' for every tenant not named; over them a request gets RESOURCE_EXHAUSTED / 429 "
        "with retry-after; priority is the tenant's scheduling priority on the workers (lower "
        "first, with their --scheduling-policy priority), the best its requests may ask for. "
        "Empty: no limits",
    )
    tls_dir: str = flag(
        "",
        "directory of the router's TLS material (tls.crt, tls.key, ca.crt; see splitserve "
        "certs): the client port serves TLS, and calls to workers are mutual TLS (empty: "
        "plaintext)",
    )
    metrics_port: int = flag(0, "port of the Prometheus /metrics endpoint (0: off)")
    seed: int = flag(0, "seed of the router's tie-breaking")
    # The prefix index the workers publish to and the routers' reservations; without a URL, an
    # in-process index of this router's own choices.
    redis: RedisConfig = field(default_factory=RedisConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        # Given as its name (a test, a caller's literal): the member, so that `is` holds.
        object.__setattr__(self, "mode", ClusterMode(self.mode))
        if self.prefill_load_bound != 0 and self.prefill_load_bound < 1:
            raise ValueError(
                f"prefill_load_bound must be 0 (off) or >= 1, got {self.prefill_load_bound}"
            )
        for name in (
            "prefill_max_candidates",
            "local_prefill_max_tokens",
            "priority_local_prefill_max_tokens",
            "peer_pull_min_tokens",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if "|" in self.router_id:
            raise ValueError(f"router_id must not contain '|', got {self.router_id!r}")
        if self.router_heartbeat_ttl_s <= 0:
            raise ValueError(
                f"router_heartbeat_ttl_s must be > 0, got {self.router_heartbeat_ttl_s}"
            )
        if not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.max_inflight_requests < 1:
            raise ValueError(
                f"max_inflight_requests must be >= 1, got {self.max_inflight_requests}"
            )
        if not 1 <= self.max_n <= MAX_GENERATIONS:
            raise ValueError(f"max_n must be in [1, {MAX_GENERATIONS}], got {self.max_n}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"max_logprobs must be in [0, {MAX_LOGPROBS}], got {self.max_logprobs}"
            )
        try:
            parse_tenant_limits(self.tenant_limits)
        except ValueError as exc:
            raise ValueError(f"tenant_limits: {exc}") from None
        for name in (
            "max_request_output_tokens",
            "http_max_header_bytes",
            "http_max_connections",
            "http_send_buffer_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "stream_idle_timeout_s",
            "http_header_timeout_s",
            "http_body_timeout_s",
            "http_keep_alive_timeout_s",
            "prefix_index_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def served_name(self) -> str:
        """The model name clients see: ``served_model_name``, else ``model`` as given."""
        return self.served_model_name or self.model

    def request_bounds(self) -> RequestBounds:
        return RequestBounds(
            max_prompt_bytes=self.max_prompt_bytes,
            max_messages=self.max_messages,
            max_logprobs=self.max_logprobs,
            max_tokens=self.max_request_output_tokens,
        )

    def resolved_router_id(self) -> str:
        """``router_id``, else a fresh one (a new random suffix at every call: resolve it once
        per router and pass it on)."""
        return self.router_id or (
            f"router-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        )

    @property
    def prefill_address_list(self) -> tuple[str, ...]:
        return _split_addresses(self.prefill_workers)

    @property
    def decode_address_list(self) -> tuple[str, ...]:
        return _split_addresses(self.decode_workers)


def parse_router_args(argv: list[str] | None) -> RouterConfig:
    """Flags of ``python -m services.router``; configures logging (``--log-level``,
    ``--log-format``)."""
    parser, args = parse_service_args(
        "python -m services.router", "splitserve router", (RouterConfig,), argv
    )
    redis, tracing = shared_configs(args)
    config = from_args(RouterConfig, args, redis=redis, tracing=tracing)
    if not config.decode_address_list:
        # Only an orchestrator (services.cluster) starts a router with empty pools.
        parser.error("--decode-workers: at least one decode worker address is required")
    return config
