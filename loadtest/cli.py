"""``splitserve loadtest``: drive a running cluster and write reports.

``splitserve loadtest --target HOST:PORT --workload {chat,shared-prefix,long-mixed}
(--rate R[,R...] | --concurrency C) [--duration S] [--num-requests N] [--slo-ttft-ms T]
[--slo-itl-ms I] [--slo-itl-percentile P] [--burstiness B] [--seed S] --out DIR``. Several
rates run one after the other (a sweep) into the same reports. The workloads are described in
``loadtest.synthetic``, the metrics in ``loadtest.metrics``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import grpc

from loadtest.metrics import DEFAULT_SLO_ITL_PERCENTILE
from loadtest.report import write_reports
from loadtest.sweep import LoadSpec, run_sweep, served_model_of
from loadtest.synthetic import WORKLOADS
from services.common.router_channel import (
    add_router_credential_flags,
    open_router_channel,
    router_credentials,
)
from services.startup import ClusterNotReady, WaitMessages, wait_for_cluster
from splitserve.v1 import router_pb2_grpc


def configure(parser: argparse.ArgumentParser) -> None:
    """Declare ``loadtest``'s flags on its sub-parser."""
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
        "--slo-itl-percentile",
        type=float,
        default=DEFAULT_SLO_ITL_PERCENTILE,
        help="which percentile of a request's own inter-token gaps must stay within --slo-itl-ms",
    )
    parser.add_argument(
        "--burstiness", type=float, default=1.0, help="1: Poisson arrivals; below 1: burstier"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--model", default=None, help="tokenizer to build prompts with (default: the router's)"
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=300.0,
        help="deadline per request, and for a router and workers still starting to serve",
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for the reports")
    parser.add_argument("--no-progress", action="store_true")
    add_router_credential_flags(parser)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        spec = LoadSpec(
            workload=args.workload,
            rates=tuple(float(r) for r in args.rate.split(",")) if args.rate else (),
            concurrency=args.concurrency,
            num_requests=args.num_requests,
            duration_s=args.duration,
            slo_ttft_ms=args.slo_ttft_ms,
            slo_itl_ms=args.slo_itl_ms,
            slo_itl_percentile=args.slo_itl_percentile,
            burstiness=args.burstiness,
            seed=args.seed,
            timeout_s=args.timeout_s,
        )
    except ValueError as exc:
        print(f"splitserve loadtest: {exc}", file=sys.stderr)
        return 2
    with open_router_channel(args.target, **router_credentials(args)) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        deadline_s = time.monotonic() + args.timeout_s
        try:
            status = wait_for_cluster(stub, args.target, deadline_s, WaitMessages(sys.stderr))
        except ClusterNotReady as exc:
            print(
                f"splitserve loadtest: not serving after {args.timeout_s:g} s: {exc}",
                file=sys.stderr,
            )
            return 2
        except grpc.RpcError as exc:
            print(f"splitserve loadtest: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 2
    served = served_model_of(status, args.model)
    runs = run_sweep(
        args.target, spec, served, show_progress=not args.no_progress, **router_credentials(args)
    )
    for result in runs:
        summary = result.summary
        print(
            f"{result.label}: {summary.num_completed}/{summary.num_sent} done, "
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
        "model": served.name,
        "burstiness": args.burstiness,
    }
    for path in write_reports(args.out, config, runs):
        print(f"wrote {path}")
    return 0
