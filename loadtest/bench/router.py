"""Prefix-aware routing vs cache-blind baselines on a shared-prefix workload, plus the cost of
one routing decision.

``python -m loadtest.bench.router [--requests 512] [--system-prompts 16] [--rate R]``

For each prefill policy (``cost``, ``round_robin``, ``random``) a fresh local cluster (4 prefill
and 2 decode workers on the tiny random Llama of ``loadtest.fixtures.tiny_model``, every worker
on one thread, all publishing to one real ``redis-server``) serves the same requests: each is one of
``--system-prompts`` random system prompts of ``--system-tokens`` tokens plus a random user part
of 32-96 tokens (``--hot-fraction`` of them all on the first system prompt), 4 output tokens,
sent ``--concurrency`` at a time, or at ``--rate`` requests/s (Poisson arrivals). Prefill
workers hold about ``--prefill-cache-prompts`` system prompts each, so a cache-blind policy
keeps evicting.

Reported per policy: prefix hit rate (cached / prompt tokens), the same against an oracle that
knows every worker's cache (every request after the first of its system prompt hits the whole
system prompt: an upper bound no router can beat), prefill tokens computed, and the client's
TTFT p50/p99. After the ``cost`` run, against its index as its workers left it (their 4 ids
kept live; the worker processes stopped, so that they do not compete with the router for the
2 cores), one router's decision latency (hash the prompt, then the Lua select-and-reserve)
p50/p99 one at a time, and its decisions per second (each with its release) with 32 in
flight.

Prints Markdown tables and writes ``router.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import redis

from engine.block_hash import hash_block_tokens
from engine.config import EngineConfig
from loadtest.fixtures.redis_server import RedisServer
from loadtest.fixtures.tiny_model import make_tiny_llama
from services.common.redis_config import RedisConfig
from services.launcher import LocalCluster
from services.router.prefill_cost import CandidateLoad, PrefillWeights
from services.router.prefill_ledger import PrefillQuery, Selection
from services.router.redis_prefill_ledger import RedisPrefillLedger
from splitserve.v1 import router_pb2, router_pb2_grpc, worker_pb2

BLOCK_SIZE = 16
POLICIES = ("cost", "round_robin", "random")


@dataclass(frozen=True, slots=True)
class Request:
    system: int
    token_ids: list[int]


@dataclass(frozen=True, slots=True)
class PolicyResult:
    policy: str
    requests: int
    failed: int
    prompt_tokens: int
    cached_tokens: int
    oracle_cached_tokens: int
    ttft_p50_s: float
    ttft_p99_s: float
    wall_s: float

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens

    @property
    def vs_oracle(self) -> float:
        return self.cached_tokens / max(self.oracle_cached_tokens, 1)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def make_requests(args: argparse.Namespace, vocab_size: int) -> list[Request]:
    rng = random.Random(args.seed)
    systems = [
        [rng.randrange(100, vocab_size) for _ in range(args.system_tokens)]
        for _ in range(args.system_prompts)
    ]
    requests = []
    for _ in range(args.requests):
        hot = rng.random() < args.hot_fraction
        system = 0 if hot else rng.randrange(args.system_prompts)
        user = [rng.randrange(100, vocab_size) for _ in range(rng.randrange(32, 97))]
        requests.append(Request(system, systems[system] + user))
    return requests


def oracle_cached_tokens(requests: list[Request], system_tokens: int) -> int:
    """Every request whose system prompt came before hits all of its full blocks."""
    seen: set[int] = set()
    total = 0
    for request in requests:
        if request.system in seen:
            total += system_tokens // BLOCK_SIZE * BLOCK_SIZE
        seen.add(request.system)
    return total


def send(stub: router_pb2_grpc.RouterStub, request: Request) -> tuple[float, int] | None:
    """(TTFT, cached tokens) of one generation; None when it failed."""
    start_s = time.perf_counter()
    ttft_s = 0.0
    cached = 0
    try:
        for message in stub.Generate(
            router_pb2.GenerateRequest(
                token_ids=request.token_ids,
                sampling=router_pb2.SamplingParams(max_tokens=4, temperature=0.0),
            ),
            timeout=600,
        ):
            if not ttft_s and message.token_ids:
                ttft_s = time.perf_counter() - start_s
            if message.finish_reason:
                cached = message.usage.cached_tokens
    except grpc.RpcError:
        return None
    return ttft_s, cached


def run_policy(
    args: argparse.Namespace, model_dir: Path, redis_server: RedisServer, policy: str
) -> tuple[PolicyResult, dict[str, float]]:
    """Serve the workload under ``policy`` on a fresh cluster. For ``cost``, also measure the
    decision cost while the cluster (its workers' index entries live) is still up."""
    redis.Redis.from_url(redis_server.url).flushall()
    prefill_blocks = args.prefill_cache_prompts * (args.system_tokens // BLOCK_SIZE + 8)
    decode_blocks = args.concurrency * 2 * 80 + 256
    engine = EngineConfig(
        model=str(model_dir),
        dtype="bfloat16",
        num_threads=1,
        max_num_batched_tokens=2048,
        # The small caches are the point of the benchmark: requests stay far below this.
        max_model_len=BLOCK_SIZE * min(prefill_blocks, decode_blocks),
    )
    cluster = LocalCluster(
        engine=engine,
        num_prefill=args.prefill,
        num_decode=args.decode,
        extra_worker_flags=("--redis-url", redis_server.url, "--kv-transfer", args.kv_transfer),
        extra_role_flags={
            "prefill": ("--num-kv-blocks", str(prefill_blocks)),
            "decode": ("--num-kv-blocks", str(decode_blocks)),
        },
        extra_router_flags=(
            "--redis-url", redis_server.url, "--prefill-policy", policy,
            "--local-prefill-max-tokens", "0", *args.router_flags.split(),
        ),
    )  # fmt: skip
    try:
        address = cluster.start()
        stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(address))
        status = stub.Status(router_pb2.StatusRequest())
        vocab_size = min(w.info.vocab_size for w in status.workers)
        prefill_ids = [
            w.info.worker_id for w in status.workers if w.role == worker_pb2.WORKER_ROLE_PREFILL
        ]
        requests = make_requests(args, vocab_size)
        start_s = time.perf_counter()
        results = send_all(args, stub, requests)
        wall_s = time.perf_counter() - start_s
    finally:
        cluster.stop()
    decisions = {}
    if policy == "cost":
        # The index as the workers left it, kept live without their processes competing with
        # the router for the 2 cores (a router has its own in a deployment).
        client = redis.Redis.from_url(redis_server.url)
        for worker_id in prefill_ids:
            client.set(f"splitserve:alive:{worker_id}", b"1", ex=600)
        client.close()
        decisions = asyncio.run(decision_cost(args, redis_server, prefill_ids, requests))
    done = [r for r in results if r is not None]
    ttfts = [ttft for ttft, _ in done]
    return (
        PolicyResult(
            policy=policy,
            requests=len(requests),
            failed=len(requests) - len(done),
            prompt_tokens=sum(len(r.token_ids) for r in requests),
            cached_tokens=sum(cached for _, cached in done),
            oracle_cached_tokens=oracle_cached_tokens(requests, args.system_tokens),
            ttft_p50_s=statistics.median(ttfts),
            ttft_p99_s=percentile(ttfts, 0.99),
            wall_s=wall_s,
        ),
        decisions,
    )


def send_all(
    args: argparse.Namespace, stub: router_pb2_grpc.RouterStub, requests: list[Request]
) -> list[tuple[float, int] | None]:
    """Closed loop (``--concurrency`` at a time) or, with ``--rate``, Poisson arrivals."""
    if not args.rate:
        with ThreadPoolExecutor(args.concurrency) as pool:
            return list(pool.map(lambda r: send(stub, r), requests))
    rng = random.Random(args.seed + 1)
    arrivals_s = []
    at_s = 0.0
    for _ in requests:
        at_s += rng.expovariate(args.rate)
        arrivals_s.append(at_s)
    start_s = time.perf_counter()

    def timed_send(item: tuple[float, Request]) -> tuple[float, int] | None:
        time.sleep(max(item[0] - (time.perf_counter() - start_s), 0.0))
        return send(stub, item[1])

    with ThreadPoolExecutor(256) as pool:
        return list(pool.map(timed_send, zip(arrivals_s, requests, strict=True)))


async def decision_cost(
    args: argparse.Namespace,
    redis_server: RedisServer,
    worker_ids: list[str],
    requests: list[Request],
) -> dict[str, float]:
    """One router's decision latency and throughput against the populated Redis."""
    config = RedisConfig(redis_server.url)
    ledger = RedisPrefillLedger(config.client(), "bench-router", router_ttl_s=30)
    loads = [CandidateLoad(w, 0.0) for w in worker_ids]
    weights = PrefillWeights(load_bound=1.25)
    rng = random.Random(args.seed)
    prompts = [r.token_ids for r in requests[:64]]

    async def decide(i: int) -> Selection:
        block_hashes = hash_block_tokens(prompts[i % len(prompts)], BLOCK_SIZE)
        return await ledger.select(
            f"d{i}", PrefillQuery(block_hashes, loads, weights, rng.random())
        )

    async def release(selection: Selection) -> None:
        if selection.reservation is not None:
            await ledger.release(selection.reservation)

    for i in range(100):  # warm the connection and the script cache
        await release(await decide(i))
    gc.freeze()  # as the router does after startup
    latencies_s = []
    for i in range(args.decisions):
        start_s = time.perf_counter()
        selection = await decide(i)
        latencies_s.append(time.perf_counter() - start_s)
        await release(selection)  # off the decision's path, as in the router
    count = 0
    deadline_s = time.perf_counter() + 5.0

    async def worker(offset: int) -> None:
        nonlocal count
        i = offset
        while time.perf_counter() < deadline_s:
            await release(await decide(i))
            i += 32
            count += 1

    start_s = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(32)))
    elapsed_s = time.perf_counter() - start_s
    await ledger.close()
    return {
        "decision_p50_ms": percentile(latencies_s, 0.5) * 1e3,
        "decision_p99_ms": percentile(latencies_s, 0.99) * 1e3,
        "decisions_per_s": count / elapsed_s,
        "prompt_blocks": args.system_tokens // BLOCK_SIZE,
        "candidates": len(worker_ids),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--system-prompts", type=int, default=16)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--prefill", type=int, default=4)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--rate", type=float, default=0.0, help="requests/s, Poisson arrivals (0: closed loop)"
    )
    parser.add_argument("--prefill-cache-prompts", type=int, default=6)
    parser.add_argument(
        "--hot-fraction", type=float, default=0.0, help="share of requests on system prompt 0"
    )
    parser.add_argument("--kv-transfer", default="tcp")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--router-flags", default="", help="extra router flags, space-separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench-out/router"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.out / "tiny-llama"
    if not (model_dir / "config.json").exists():
        make_tiny_llama(model_dir)
    with tempfile.TemporaryDirectory() as redis_dir:
        redis_server = RedisServer(Path(redis_dir))
        redis_server.start()
        try:
            results = []
            decisions: dict[str, float] = {}
            for policy in args.policies.split(","):
                result, measured = run_policy(args, model_dir, redis_server, policy)
                results.append(result)
                decisions = decisions or measured
                print(f"{policy}: {result}", flush=True)
        finally:
            redis_server.stop()
    print_report(results, decisions)
    (args.out / "router.json").write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "policies": [
                    {**asdict(r), "hit_rate": r.hit_rate, "vs_oracle": r.vs_oracle} for r in results
                ],
                "decisions": decisions,
            },
            indent=2,
        )
    )


def print_report(results: list[PolicyResult], decisions: dict[str, float]) -> None:
    baseline = next((r for r in results if r.policy == "round_robin"), results[0])
    print("| policy | hit rate | vs oracle | prefill tokens computed | TTFT p50 | TTFT p99 "
          "| p50 vs round-robin | failed |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r.policy} | {r.hit_rate:.1%} | {r.vs_oracle:.1%} | "
            f"{r.prompt_tokens - r.cached_tokens:,} | {r.ttft_p50_s * 1e3:.0f} ms | "
            f"{r.ttft_p99_s * 1e3:.0f} ms | {r.ttft_p50_s / baseline.ttft_p50_s:.2f}x | "
            f"{r.failed} |"
        )
    print()
    if not decisions:
        return
    print(
        f"decision ({decisions['prompt_blocks']} blocks, {decisions['candidates']} candidates,"
        f" Redis): p50 {decisions['decision_p50_ms']:.2f} ms, p99 "
        f"{decisions['decision_p99_ms']:.2f} ms, {decisions['decisions_per_s']:.0f} decisions/s"
    )


if __name__ == "__main__":
    main()
