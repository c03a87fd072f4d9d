"""What the OpenAI HTTP API costs against gRPC: the same load through both doors of one cluster.

``python -m loadtest.bench.http --model smollm2-135m [--rounds 3] [--concurrency 1,32]``
starts one cluster with ``splitserve up``'s launcher (one prefill and one decode worker, the
cores split between them), warms it up, then at each concurrency sends seeded requests
(``--prompt-tokens`` random token ids, ``--max-tokens`` each, greedy, ``ignore_eos``) through gRPC
``Generate`` and through ``POST /v1/completions`` with streaming. Each run gets prompts of its
own (a repeat would hit the prefix cache); the arms alternate within each round and take turns
going first, so that machine drift and prompt sets hit both alike.
Prints a Markdown table (each arm's median over its rounds of TTFT p50 / p90 and output
tok/s) and writes ``http.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.flags import add_flags, from_args
from loadtest.generator.backends import Backend, GrpcClient, LoadClient
from loadtest.generator.openai_http import OpenAIClient
from loadtest.generator.runner import closed_loop_summary
from loadtest.generator.sweep import ServedModel, served_model
from loadtest.generator.synthetic import LoadRequest
from services.launcher import LocalCluster

_ARMS = (Backend.GRPC, Backend.OPENAI_COMPLETIONS)


def fixed_requests(
    served: ServedModel, num: int, args: argparse.Namespace, seed: int
) -> list[LoadRequest]:
    """``num`` distinct prompts of ``--prompt-tokens`` random regular tokens: every run the same
    amount of work, so that TTFT differences are the API's, not the prompts'."""
    rng = random.Random(seed)
    return [
        LoadRequest(
            tuple(rng.choices(served.vocab, k=args.prompt_tokens)), args.max_tokens, "fixed"
        )
        for _ in range(num)
    ]


def _client(arm: Backend, cluster: LocalCluster, served: ServedModel) -> LoadClient:
    if arm is Backend.GRPC:
        return GrpcClient(cluster.router_address)
    return OpenAIClient(arm, cluster.http_url, served.name)


def measure(client: LoadClient, requests: list[LoadRequest], concurrency: int) -> dict[str, float]:
    """One complete closed-loop run's TTFT p50 / p90, ITL p50, output tok/s and count."""
    summary = closed_loop_summary(client, requests, concurrency)
    return {
        "ttft_p50_ms": summary.ttft_ms["p50"],
        "ttft_p90_ms": summary.ttft_ms["p90"],
        "itl_p50_ms": summary.itl_ms["p50"],
        "output_tokens_per_s": summary.output_tokens_per_s,
        "completed": summary.num_completed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flags(parser, EngineConfig)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", default="1,32", help="comma-separated stream counts")
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path("bench-out/http"))
    args = parser.parse_args()
    engine = dataclasses.replace(from_args(EngineConfig, args), detokenize=False)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    cluster = LocalCluster(engine=engine)
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    try:
        cluster.start()
        served = served_model(cluster.router_address)
        for arm in _ARMS:  # warm-up: compiled paths, connections, the tokenizer's caches
            measure(_client(arm, cluster, served), fixed_requests(served, 4, args, 10**6), 2)
        seed = 0  # run i's prompts come from seed i
        for concurrency in concurrencies:
            num = max(args.min_requests, args.requests_per_stream * concurrency)
            runs: dict[str, list[dict[str, float]]] = {arm.value: [] for arm in _ARMS}
            for round_index in range(args.rounds):
                order = _ARMS if round_index % 2 == 0 else _ARMS[::-1]
                for arm in order:
                    seed += 1
                    requests = fixed_requests(served, num, args, seed)
                    measured = measure(_client(arm, cluster, served), requests, concurrency)
                    runs[arm.value].append(measured)
            results[str(concurrency)] = runs
    finally:
        cluster.stop()
    _report(results, args)


def print_medians(
    results: dict[str, dict[str, list[dict[str, float]]]], arm_header: str
) -> dict[str, dict[str, dict[str, float]]]:
    """Print, and return, each arm's median over its rounds as a Markdown table."""
    columns = "TTFT p50 ms | TTFT p90 ms | ITL p50 ms | output tok/s | completed"
    print(f"| streams | {arm_header} | {columns} |")
    print("|---|---|---|---|---|---|---|")
    medians: dict[str, dict[str, dict[str, float]]] = {}
    for concurrency, runs in results.items():
        medians[concurrency] = {
            arm: {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
            for arm, rounds in runs.items()
        }
        for arm, m in medians[concurrency].items():
            print(
                f"| {concurrency} | {arm} | {m['ttft_p50_ms']:.1f} | {m['ttft_p90_ms']:.1f} | "
                f"{m['itl_p50_ms']:.1f} | {m['output_tokens_per_s']:.1f} | "
                f"{m['completed']:.0f} |"
            )
    return medians


def _report(
    results: dict[str, dict[str, list[dict[str, float]]]], args: argparse.Namespace
) -> None:
    medians = print_medians(results, "API")
    for concurrency, arms in medians.items():
        grpc, http = arms[Backend.GRPC.value], arms[Backend.OPENAI_COMPLETIONS.value]
        ttft_added_ms = http["ttft_p50_ms"] - grpc["ttft_p50_ms"]
        throughput_change = http["output_tokens_per_s"] / grpc["output_tokens_per_s"] - 1
        print(
            f"{concurrency} streams: HTTP TTFT p50 {ttft_added_ms:+.1f} ms, "
            f"output tok/s {throughput_change:+.1%}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"rounds": results, "medians": medians, "args": vars(args)}
    (args.out / "http.json").write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
