"""What tracing costs: the same load on a cluster that traces every request and on one that
traces none.

``python -m loadtest.bench.tracing --model smollm2-135m [--rounds 4] [--concurrency 1,16]``
starts two clusters with ``splitserve up``'s launcher (each a router, one prefill and one decode
worker): one with ``--otlp-traces-endpoint`` pointed at an OTLP receiver in this process and
``--otlp-traces-sample-ratio 1.0``, one without tracing. Both stay up; at each concurrency the
arms alternate within each round and take turns going first, each run with prompts of its own
(``--prompt-tokens`` random token ids, ``--max-tokens`` each, greedy, ``ignore_eos``, through
gRPC). Prints a Markdown table (each arm's median over its rounds of TTFT p50 / p90 and output
tok/s, and the spans received) and writes ``tracing.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.flags import add_flags, from_args
from loadtest.bench.http import fixed_requests, measure, print_medians
from loadtest.fixtures.otlp_receiver import OtlpReceiver
from loadtest.generator.backends import GrpcClient
from loadtest.generator.sweep import served_model
from services.launcher import LocalCluster


class Arm(enum.Enum):
    OFF = "tracing off"
    ON = "tracing on (ratio 1.0)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flags(parser, EngineConfig)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--concurrency", default="1,16", help="comma-separated stream counts")
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path("bench-out/tracing"))
    args = parser.parse_args()
    engine = dataclasses.replace(from_args(EngineConfig, args), detokenize=False)
    receiver = OtlpReceiver()
    endpoint = receiver.start()
    traced = ("--otlp-traces-endpoint", endpoint, "--otlp-traces-sample-ratio", "1.0")
    clusters = {
        Arm.OFF: LocalCluster(engine=engine, http_port=None),
        Arm.ON: LocalCluster(
            engine=engine, http_port=None, extra_worker_flags=traced, extra_router_flags=traced
        ),
    }
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    try:
        for cluster in clusters.values():
            cluster.start()
        served = served_model(clusters[Arm.OFF].router_address)
        for cluster in clusters.values():  # warm-up: compiled paths, connections, caches
            measure(GrpcClient(cluster.router_address), fixed_requests(served, 4, args, 10**6), 2)
        seed = 0
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            num = max(args.min_requests, args.requests_per_stream * concurrency)
            runs: dict[str, list[dict[str, float]]] = {arm.value: [] for arm in Arm}
            for round_index in range(args.rounds):
                order = list(Arm) if round_index % 2 == 0 else list(Arm)[::-1]
                for arm in order:
                    seed += 1
                    requests = fixed_requests(served, num, args, seed)
                    client = GrpcClient(clusters[arm].router_address)
                    runs[arm.value].append(measure(client, requests, concurrency))
            results[str(concurrency)] = runs
    finally:
        for cluster in clusters.values():
            cluster.stop()
        receiver.stop()
    _report(results, len(receiver.spans()), args)


def _report(
    results: dict[str, dict[str, list[dict[str, float]]]], num_spans: int, args: argparse.Namespace
) -> None:
    medians = print_medians(results, "arm")
    for concurrency, arms in medians.items():
        off, on = arms[Arm.OFF.value], arms[Arm.ON.value]
        print(
            f"{concurrency} streams: tracing on: TTFT p50 "
            f"{on['ttft_p50_ms'] / off['ttft_p50_ms'] - 1:+.1%}, output tok/s "
            f"{on['output_tokens_per_s'] / off['output_tokens_per_s'] - 1:+.1%}"
        )
    print(f"spans received: {num_spans}")
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "rounds": results,
        "medians": medians,
        "spans_received": num_spans,
        "args": vars(args),
    }
    (args.out / "tracing.json").write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
