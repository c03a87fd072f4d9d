"""``splitserve loadtest``: drive a running cluster and write reports.

``splitserve loadtest --target HOST:PORT --workload {chat,shared-prefix,long-mixed}
(--rate R[,R...] | --concurrency C) [--duration S] [--num-requests N] [--slo-ttft-ms T]
[--slo-itl-ms I] [--burstiness B] [--seed S] --out DIR``. Several rates run one after the
other (a sweep) into the same reports. The workloads are described in ``loadtest.synthetic``,
the metrics in ``loadtest.metrics``.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from pathlib import Path

import grpc

from engine.loader.models import resolve_model
from engine.tokenizer import Tokenizer
from loadtest.metrics import summarize
from loadtest.report import RunResult, write_reports
from loadtest.runner import RunPlan, run
from loadtest.synthetic import WORKLOADS, WorkloadGenerator, arrival_times_s, regular_token_ids
from services.common.grpc_server import CHANNEL_OPTIONS
from splitserve.v1 import router_pb2, router_pb2_grpc


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "loadtest", help="open-loop load against a running router; JSON, Markdown and PNG reports"
    )
    parser.add_argument("--target", default="127.0.0.1:50051", help="router host:port")
    parser.add_argument("--workload", choices=WORKLOADS, default="chat")
    load = parser.add_mutually_exclusive_group(required=True)
    load.add_argument(
        "--rate", help="offered requests/s, open loop; a comma-separated list runs a sweep"
    )
    load.add_argument("--concurrency", type=int, help="requests kept in flight (closed loop)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of sending per run")
    parser.add_argument("--num-requests", type=int, default=1000, help="most requests per run")
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    parser.add_argument("--slo-itl-ms", type=float, default=None)
    parser.add_argument(
        "--burstiness", type=float, default=1.0, help="1: Poisson arrivals; below 1: burstier"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--model", default=None, help="tokenizer to build prompts with (default: the router's)"
    )
    parser.add_argument("--timeout-s", type=float, default=300.0, help="deadline per request")
    parser.add_argument("--out", type=Path, required=True, help="directory for the reports")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=main)


def _router_model(target: str) -> tuple[str, int, int]:
    """The router's model, and the smallest vocabulary and max_model_len of its workers."""
    with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        status = stub.Status(router_pb2.StatusRequest(), timeout=30, wait_for_ready=True)
    infos = [w.info for w in status.workers if w.info.max_model_len]
    if not infos:
        raise RuntimeError(f"no worker behind {target} has answered yet")
    return (
        status.model,
        min(i.vocab_size for i in infos),
        min(i.max_model_len for i in infos),
    )


def main(args: argparse.Namespace) -> int:
    if args.concurrency is not None and args.concurrency < 1:
        print("splitserve loadtest: --concurrency must be >= 1", file=sys.stderr)
        return 2
    rates = [float(r) for r in args.rate.split(",")] if args.rate else [None]
    if any(r is not None and r <= 0 for r in rates):
        print("splitserve loadtest: --rate values must be > 0", file=sys.stderr)
        return 2
    model, vocab_size, max_model_len = _router_model(args.target)
    tokenizer = Tokenizer(resolve_model(args.model or model)).backend
    vocab = [i for i in regular_token_ids(tokenizer) if i < vocab_size]
    runs = []
    for i, rate in enumerate(rates):
        generator = WorkloadGenerator(args.workload, vocab, max_model_len, seed=args.seed)
        arrivals_s = (
            tuple(arrival_times_s(args.num_requests, rate, args.burstiness, args.seed + i))
            if rate is not None
            else None
        )
        plan = RunPlan(
            num_requests=args.num_requests,
            duration_s=args.duration,
            arrivals_s=arrivals_s,
            concurrency=args.concurrency,
            timeout_s=args.timeout_s,
        )
        records = asyncio.run(
            run(args.target, plan, generator.next, show_progress=not args.no_progress)
        )
        summary = summarize(records, args.slo_ttft_ms, args.slo_itl_ms)
        label = f"rate {rate:g}/s" if rate is not None else f"concurrency {args.concurrency}"
        runs.append(RunResult(label, rate, args.concurrency, summary, records))
        print(
            f"{label}: {summary.num_completed}/{summary.num_sent} done, "
            f"{summary.requests_per_s:.2f} req/s, goodput {summary.goodput_requests_per_s:.2f} "
            f"req/s, TTFT p50 {summary.ttft_ms['p50']:.0f} ms, "
            f"ITL p99 {summary.itl_ms['p99']:.0f} ms",
            flush=True,
        )
    config = {
        "command": "splitserve loadtest " + shlex.join(sys.argv[2:]),
        "target": args.target,
        "workload": args.workload,
        "seed": args.seed,
        "model": model,
        "burstiness": args.burstiness,
    }
    for path in write_reports(args.out, config, runs):
        print(f"wrote {path}")
    return 0
