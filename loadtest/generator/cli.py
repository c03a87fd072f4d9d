"""``splitserve loadtest``: drive a running cluster and write reports.

``splitserve loadtest [--backend grpc|openai-chat|openai-completions] [--target HOST:PORT |
--base-url URL] [--workload {chat,shared-prefix,long-mixed} | --dataset {jsonl,sharegpt}
--dataset-path FILE [--output-len N]] (--rate R[,R...] | --concurrency C) [--duration S]
[--num-requests N] [--slo-ttft-ms T] [--slo-itl-ms I] [--slo-itl-percentile P] [--burstiness B]
[--seed S] --out DIR``. Several rates run one after the other (a sweep) into the same reports.
``--users U`` instead replays multi-turn conversations (``conversation_load``: ``--turns``,
``--think-time-s``, ...; synthetic, or ``--dataset sharegpt``) through ``--backend openai-chat``,
each turn's prompt the whole history, and reports per turn.
``grpc`` calls the router's ``Generate`` at ``--target``; the ``openai-*`` backends its HTTP API
at ``--base-url`` (``loadtest.generator.openai_http``). The workloads are described in
``loadtest.generator.synthetic``, the datasets in ``loadtest.generator.datasets``, the metrics in
``loadtest.generator.metrics``. Bad flags or a malformed dataset: one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from loadtest.generator.backends import Backend, GrpcClient, LoadClient
from loadtest.generator.conversation_load import (
    add_conversation_flags,
    conversation_report,
    conversations_of,
    write_conversation_report,
)
from loadtest.generator.conversations import ConversationPlan, run_conversations
from loadtest.generator.datasets import Dataset, DatasetKind, load_dataset
from loadtest.generator.metrics import DEFAULT_SLO_ITL_PERCENTILE
from loadtest.generator.openai_http import OpenAIClient, ServerRefused, wait_for_model
from loadtest.generator.report import write_reports
from loadtest.generator.sweep import (
    LoadSpec,
    ServedModel,
    load_served_model,
    run_sweep,
    served_model_of,
)
from loadtest.generator.synthetic import WORKLOADS
from services.common.router_channel import (
    add_router_credential_flags,
    open_router_channel,
    router_credentials,
)
from services.startup import ClusterNotReady, WaitMessages, wait_for_cluster
from splitserve.v1 import router_pb2_grpc

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_WORKLOAD = "chat"
DEFAULT_OUTPUT_LEN = 128


def configure(parser: argparse.ArgumentParser) -> None:
    """Declare ``loadtest``'s flags on its sub-parser."""
    parser.add_argument(
        "--backend",
        choices=[b.value for b in Backend],
        default=Backend.GRPC.value,
        help="the router API to load: gRPC Generate, or the OpenAI HTTP chat or completions API",
    )
    parser.add_argument(
        "--target", metavar="HOST:PORT", help=f"router, gRPC (default {DEFAULT_TARGET})"
    )
    parser.add_argument(
        "--base-url",
        metavar="URL",
        help=f"router HTTP API, openai-* backends (default {DEFAULT_BASE_URL})",
    )
    parser.add_argument(
        "--dataset",
        choices=[d.value for d in DatasetKind],
        default=DatasetKind.SYNTHETIC.value,
        help="synthetic: --workload; jsonl, sharegpt: the requests of --dataset-path",
    )
    parser.add_argument(
        "--dataset-path", type=Path, metavar="FILE", help="the jsonl or sharegpt file"
    )
    parser.add_argument(
        "--workload", choices=WORKLOADS, help=f"synthetic workload (default {DEFAULT_WORKLOAD})"
    )
    parser.add_argument(
        "--output-len",
        type=int,
        metavar="N",
        help=f"output tokens of jsonl entries that give none (default {DEFAULT_OUTPUT_LEN})",
    )
    load = parser.add_mutually_exclusive_group(required=True)
    load.add_argument(
        "--rate", help="offered requests/s, open loop; a comma-separated list runs a sweep"
    )
    load.add_argument("--concurrency", type=int, help="requests kept in flight (closed loop)")
    load.add_argument(
        "--users",
        type=int,
        help="multi-turn: this many users at once, each replaying a conversation turn by turn "
        "(--backend openai-chat)",
    )
    add_conversation_flags(parser)
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
    parser.add_argument("--seed", type=int, default=0, help="prompts, dataset order, send times")
    parser.add_argument(
        "--model",
        default=None,
        help="tokenizer to build and count prompts with (default: the one the workers loaded)",
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


@dataclass(frozen=True, slots=True)
class Source:
    """Where the load goes (``address``: a gRPC target or an HTTP base URL) and what it is."""

    backend: Backend
    address: str
    dataset: DatasetKind
    dataset_path: Path | None
    workload: str
    output_len: int


def source_of(args: argparse.Namespace) -> Source:
    """The flags that choose the API and the requests, checked together (``ValueError`` naming
    the flag) and defaulted."""
    backend, dataset = Backend(args.backend), DatasetKind(args.dataset)
    if backend is Backend.GRPC:
        if args.base_url is not None:
            raise ValueError("--base-url is for the openai-* backends; gRPC takes --target")
        address = args.target or DEFAULT_TARGET
    else:
        if args.target is not None:
            raise ValueError(f"--target is for --backend grpc; {backend.value} takes --base-url")
        address = (args.base_url or DEFAULT_BASE_URL).rstrip("/")
        if not address.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {address!r}")
    if dataset is DatasetKind.SYNTHETIC:
        if args.dataset_path is not None:
            raise ValueError("--dataset-path needs --dataset jsonl or sharegpt")
    else:
        if args.dataset_path is None:
            raise ValueError(f"--dataset {dataset.value} needs --dataset-path FILE")
        if args.workload is not None:
            raise ValueError("--workload is for --dataset synthetic")
    if args.output_len is not None:
        if dataset is not DatasetKind.JSONL:
            raise ValueError("--output-len is for --dataset jsonl")
        if args.output_len < 1:
            raise ValueError(f"--output-len must be >= 1, got {args.output_len}")
    return Source(
        backend=backend,
        address=address,
        dataset=dataset,
        dataset_path=args.dataset_path,
        workload=args.workload or DEFAULT_WORKLOAD,
        output_len=args.output_len or DEFAULT_OUTPUT_LEN,
    )


def _fail(message: str) -> int:
    print(f"splitserve loadtest: {message}", file=sys.stderr)
    return 2


def main(args: argparse.Namespace) -> int:
    try:
        source = source_of(args)
        if args.users is not None:
            _check_conversation_source(source, args)
            return _with_served_model(source, args, _replay_conversations)
        dataset = (
            load_dataset(source.dataset, source.dataset_path, source.output_len)
            if source.dataset_path is not None
            else None
        )
        spec = LoadSpec(
            workload=source.workload if dataset is None else source.dataset.value,
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
        return _fail(str(exc))
    return _with_served_model(
        source, args, lambda source, args, served: _sweep(source, args, served, spec, dataset)
    )


def _with_served_model(
    source: Source,
    args: argparse.Namespace,
    run: Callable[[Source, argparse.Namespace, ServedModel], int],
) -> int:
    """``run`` once the cluster serves (its exit status); a cluster that does not: exit 2."""
    deadline_s = time.monotonic() + args.timeout_s
    try:
        served = _served_model(source, args, deadline_s)
    except ClusterNotReady as exc:
        return _fail(f"not serving after {args.timeout_s:g} s: {exc}")
    except grpc.RpcError as exc:
        return _fail(f"{exc.code().name}: {exc.details()}")
    except (ServerRefused, ValueError, OSError) as exc:
        return _fail(str(exc))
    return run(source, args, served)


def _sweep(
    source: Source,
    args: argparse.Namespace,
    served: ServedModel,
    spec: LoadSpec,
    dataset: Dataset | None,
) -> int:
    client: LoadClient = (
        GrpcClient(source.address, **router_credentials(args))
        if source.backend is Backend.GRPC
        else OpenAIClient(source.backend, source.address, served.name, **router_credentials(args))
    )
    runs = run_sweep(client, spec, served, dataset, show_progress=not args.no_progress)
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
        "backend": source.backend.value,
        "target": source.address,
        "dataset": source.dataset.value,
        "dataset_path": str(source.dataset_path) if source.dataset_path is not None else None,
        "workload": spec.workload,
        "seed": args.seed,
        "model": served.name,
        "burstiness": args.burstiness,
    }
    for path in write_reports(args.out, config, runs):
        print(f"wrote {path}")
    return 0


def _check_conversation_source(source: Source, args: argparse.Namespace) -> None:
    """``ValueError`` naming the flag unless ``--users`` can replay conversations."""
    if source.backend is not Backend.OPENAI_CHAT:
        raise ValueError(
            "--users replays conversations through the chat API: --backend openai-chat"
        )
    if args.users < 1:
        raise ValueError(f"--users must be >= 1, got {args.users}")
    if args.workload is not None or source.dataset is DatasetKind.JSONL:
        raise ValueError("--users replays synthetic conversations or --dataset sharegpt")


def _replay_conversations(source: Source, args: argparse.Namespace, served: ServedModel) -> int:
    try:
        conversations = conversations_of(args, served.tokenizer, args.users, source.dataset_path)
    except ValueError as exc:  # a DatasetError too
        return _fail(str(exc))
    client = OpenAIClient(source.backend, source.address, served.name, **router_credentials(args))
    plan = ConversationPlan(
        num_users=args.users,
        max_tokens=args.reply_tokens,
        think_time_s=args.think_time_s,
        timeout_s=args.timeout_s,
        seed=args.seed,
    )
    records = asyncio.run(run_conversations(client, plan, conversations))
    config = {
        "command": "splitserve loadtest " + shlex.join(sys.argv[2:]),
        "target": source.address,
        "dataset": source.dataset.value,
        "dataset_path": str(source.dataset_path) if source.dataset_path is not None else None,
        "model": served.name,
        "users": args.users,
        "turns": args.turns,
        "think_time_s": args.think_time_s,
        "reply_tokens": args.reply_tokens,
        "seed": args.seed,
    }
    report = conversation_report(records, args.turns)
    for line in write_conversation_report(args.out, config, report):
        print(line)
    return 0


def _served_model(source: Source, args: argparse.Namespace, deadline_s: float) -> ServedModel:
    """Wait (until ``deadline_s``, ``time.monotonic()``) for the cluster to serve, then ask it
    what it serves; prompts use ``--model``'s tokenizer, else the one its workers loaded."""
    credentials = router_credentials(args)
    if source.backend is not Backend.GRPC:
        card = asyncio.run(
            wait_for_model(source.address, deadline_s, WaitMessages(sys.stderr), **credentials)
        )
        return load_served_model(card.id, args.model or card.root, card.max_model_len)
    with open_router_channel(source.address, **credentials) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        status = wait_for_cluster(stub, source.address, deadline_s, WaitMessages(sys.stderr))
    return served_model_of(status, args.model)
