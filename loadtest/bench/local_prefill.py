"""Where prefilling on the decode worker stops paying: the crossover behind
``--local-prefill-max-tokens``.

``python -m loadtest.bench.local_prefill --model smollm2-135m [--lengths 16,32,...]``

One local cluster (one prefill and one decode worker, cores split between them) and two routers
in front of the same workers: one always uses the prefill worker (``--local-prefill-max-tokens
0``), the other always prefills on the decode worker. ``--background`` streams keep the decode
worker's batch busy, as in production. For each prompt length, fresh random prompts (no prefix
hits) go through the two routers in alternation, so machine noise hits both alike; each asks
for ``--output-tokens`` tokens. Reported per length and path: TTFT p50 and end-to-end latency
p50, and the background streams' inter-token latency p50 and p99 while the foreground requests
ran (a prefill in the decode worker's batch lengthens that step for every running stream).

Prints a Markdown table and writes ``local_prefill.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import threading
import time
from pathlib import Path

import grpc

from engine.config import EngineConfig
from engine.flags import add_flags, from_args, parse_flags
from services.launcher import LocalCluster
from services.service_process import PortReservation, ServiceProcess, wait_healthy
from splitserve.v1 import router_pb2, router_pb2_grpc

PATHS = ("remote", "local")


def timed(stub: router_pb2_grpc.RouterStub, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times (s after sending) of every token-carrying message."""
    start_s = time.perf_counter()
    stamps = []
    request = router_pb2.GenerateRequest(
        token_ids=prompt,
        sampling=router_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    for message in stub.Generate(request, timeout=600):
        stamps.extend([time.perf_counter() - start_s] * len(message.token_ids))
    return stamps


def local_router(cluster: LocalCluster) -> ServiceProcess:
    """A second router on the same workers that always prefills on the decode worker."""
    first = cluster.workers("router")[0]
    # Held until the cluster stops (it is one of its processes then).
    reservations = [PortReservation(), PortReservation()]
    port, metrics_port = (r.port for r in reservations)
    argv = list(first.argv)
    argv[argv.index("--port") + 1] = str(port)
    argv[argv.index("--metrics-port") + 1] = str(metrics_port)
    if "--http-port" in argv:  # the first router's port: this one needs no HTTP API
        http = argv.index("--http-port")
        argv[http : http + 2] = ["--no-http"]
    argv += ["--local-prefill-max-tokens", "1000000"]
    return ServiceProcess(
        "router", f"127.0.0.1:{port}", metrics_port, argv, reservations=reservations
    )


def run(args: argparse.Namespace) -> dict:
    engine = from_args(EngineConfig, args)
    cluster = LocalCluster(
        engine=engine, extra_router_flags=("--local-prefill-max-tokens", "0"), log_level="WARNING"
    )
    rng = random.Random(args.seed)
    results: dict[int, dict[str, dict[str, list[float]]]] = {}
    stop = threading.Event()
    itl_s: list[tuple[float, float]] = []  # (time, inter-token latency) of background tokens
    try:
        address = cluster.start()
        second = local_router(cluster)
        second.start(dict(os.environ))
        cluster.processes.append(second)
        wait_healthy(second, time.monotonic() + 120)
        stubs = {
            "remote": router_pb2_grpc.RouterStub(grpc.insecure_channel(address)),
            "local": router_pb2_grpc.RouterStub(grpc.insecure_channel(second.address)),
        }
        status = stubs["remote"].Status(router_pb2.StatusRequest())
        vocab_size = min(w.info.vocab_size for w in status.workers)

        def background(seed: int) -> None:
            local_rng = random.Random(seed)
            while not stop.is_set():
                prompt = [local_rng.randrange(100, vocab_size) for _ in range(32)]
                start_s = time.perf_counter()
                stamps = timed(stubs["remote"], prompt, args.background_tokens)
                itl_s.extend((start_s + b, b - a) for a, b in itertools.pairwise(stamps[1:]))

        threads = [
            threading.Thread(target=background, args=(i,), daemon=True)
            for i in range(args.background)
        ]
        for thread in threads:
            thread.start()
        time.sleep(2.0)
        for length in (int(x) for x in args.lengths.split(",")):
            per_path: dict[str, dict[str, list[float]]] = {
                p: {"ttft_s": [], "e2e_s": [], "windows": []} for p in PATHS
            }
            for i in range(args.warmup + args.requests):
                for path in PATHS if i % 2 == 0 else reversed(PATHS):
                    prompt = [rng.randrange(100, vocab_size) for _ in range(length)]
                    start_s = time.perf_counter()
                    stamps = timed(stubs[path], prompt, args.output_tokens)
                    if i >= args.warmup:
                        per_path[path]["ttft_s"].append(stamps[0])
                        per_path[path]["e2e_s"].append(stamps[-1])
                        per_path[path]["windows"].append((start_s, start_s + stamps[-1]))
            results[length] = per_path
        stop.set()
        for thread in threads:
            thread.join(60)
    finally:
        stop.set()
        cluster.stop()
    return summarize(results, itl_s)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def summarize(
    results: dict[int, dict[str, dict[str, list]]], itl_s: list[tuple[float, float]]
) -> dict:
    rows = []
    for length, per_path in results.items():
        row: dict[str, float] = {"prompt_tokens": length}
        for path, values in per_path.items():
            windows = values["windows"]
            during = [gap for at, gap in itl_s if any(a <= at <= b for a, b in windows)]
            row[f"{path}_ttft_p50_ms"] = statistics.median(values["ttft_s"]) * 1e3
            row[f"{path}_e2e_p50_ms"] = statistics.median(values["e2e_s"]) * 1e3
            row[f"{path}_background_itl_p50_ms"] = (
                statistics.median(during) * 1e3 if during else float("nan")
            )
            row[f"{path}_background_itl_p99_ms"] = (
                percentile(during, 0.99) * 1e3 if during else float("nan")
            )
        rows.append(row)
    return {"rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_flags(parser, EngineConfig)
    parser.add_argument("--lengths", default="16,32,64,128,256,512")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--background", type=int, default=4)
    parser.add_argument("--background-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench-out/local-prefill"))
    args = parse_flags(parser)
    args.out.mkdir(parents=True, exist_ok=True)
    report = run(args)
    report["args"] = {k: str(v) for k, v in vars(args).items()}
    (args.out / "local_prefill.json").write_text(json.dumps(report, indent=2))
    print(
        "| prompt tokens | TTFT remote | TTFT local | e2e remote | e2e local "
        "| background ITL p50 (remote / local) | background ITL p99 (remote / local) |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in report["rows"]:
        print(
            f"| {row['prompt_tokens']} | {row['remote_ttft_p50_ms']:.0f} ms | "
            f"{row['local_ttft_p50_ms']:.0f} ms | {row['remote_e2e_p50_ms']:.0f} ms | "
            f"{row['local_e2e_p50_ms']:.0f} ms | {row['remote_background_itl_p50_ms']:.0f} / "
            f"{row['local_background_itl_p50_ms']:.0f} ms | "
            f"{row['remote_background_itl_p99_ms']:.0f} / "
            f"{row['local_background_itl_p99_ms']:.0f} ms |"
        )


if __name__ == "__main__":
    main()
