"""``splitserve status`` and ``splitserve scale``: a cluster's pools, workers and sizes.

Both talk to a router over gRPC (``Router.Status`` / ``Router.Scale``), the same address clients
use; on Ray the router forwards ``Scale`` to the cluster controller. Both wait for a router that
is still starting (``services.startup``); ``status`` then prints at once, saying why the cluster
does not serve yet if it does not.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator, Sequence

import grpc
from google.protobuf import json_format

from services.common.roles import POOL_ROLES, Role
from services.common.router_channel import (
    add_router_credential_flags,
    open_router_channel,
    router_credentials,
)
from services.startup import (
    ClusterNotReady,
    WaitMessages,
    router_answers,
    wait_for_cluster,
    why_not_serving,
    why_pool_not_at_size,
)
from splitserve.v1 import router_pb2, router_pb2_grpc


def configure_status(status: argparse.ArgumentParser) -> None:
    """Declare ``status``'s flags on its sub-parser."""
    status.add_argument("--target", default="127.0.0.1:50051", help="router host:port")
    status.add_argument("--json", action="store_true", help="print Router.Status as JSON")
    status.add_argument(
        "--timeout-s", type=float, default=10.0, help="how long to wait for a router to answer"
    )
    add_router_credential_flags(status)
    status.set_defaults(func=run_status)


def configure_scale(scale: argparse.ArgumentParser) -> None:
    """Declare ``scale``'s flags on its sub-parser."""
    scale.add_argument("pool", choices=[role.value for role in POOL_ROLES])
    scale.add_argument("num_workers", type=int)
    scale.add_argument(
        "--model", default="", help="the served model whose pool it is (default: the --model)"
    )
    scale.add_argument("--target", default="127.0.0.1:50051", help="router host:port")
    scale.add_argument(
        "--wait", action="store_true", help="return once the pool has that many ready workers"
    )
    scale.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="deadline of the command: waiting for a router still starting, then --wait",
    )
    add_router_credential_flags(scale)
    scale.set_defaults(func=run_scale)


def run_status(args: argparse.Namespace) -> int:
    deadline_s = time.monotonic() + args.timeout_s
    with _router(args, not_ready="") as stub:
        status = wait_for_cluster(
            stub, args.target, deadline_s, WaitMessages(sys.stderr), router_answers
        )
    if args.json:
        print(json_format.MessageToJson(status, preserving_proto_field_name=True))
    else:
        print(format_status(status))
    return 0


def run_scale(args: argparse.Namespace) -> int:
    if args.num_workers < 0:
        print("error: num_workers must be >= 0", file=sys.stderr)
        return 2
    request = router_pb2.ScaleRequest(
        role=Role(args.pool).to_proto(), num_workers=args.num_workers, model=args.model
    )
    deadline_s = time.monotonic() + args.timeout_s
    messages = WaitMessages(sys.stderr)
    with _router(args, not_ready=f"not done after {args.timeout_s:g} s: ") as stub:
        wait_for_cluster(stub, args.target, deadline_s, messages, router_answers)
        pools: Sequence[router_pb2.PoolStatus] = stub.Scale(request, timeout=30.0).pools
        if args.wait:
            why_not = why_pool_not_at_size(request.role, request.model)
            pools = wait_for_cluster(stub, args.target, deadline_s, messages, why_not).pools
    print(format_pools(pools))
    return 0


@contextlib.contextmanager
def _router(args: argparse.Namespace, not_ready: str) -> Iterator[router_pb2_grpc.RouterStub]:
    """A stub on the router at ``--target``. A failed call, or a cluster still not ready at
    the deadline (its reason after ``not_ready``), ends the command: one ``error:`` line on
    stderr and exit status 2."""
    with open_router_channel(args.target, **router_credentials(args)) as channel:
        try:
            yield router_pb2_grpc.RouterStub(channel)
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            raise SystemExit(2) from exc
        except ClusterNotReady as exc:
            print(f"error: {not_ready}{exc}", file=sys.stderr)
            raise SystemExit(2) from exc


def format_pools(pools: Sequence[router_pb2.PoolStatus]) -> str:
    rows = [
        ("MODEL", "POOL", "DESIRED", "READY", "STARTING", "DRAINING", "RESTARTS", "FAILED_STARTS")
    ]
    rows += [
        (
            p.model,
            Role.from_proto(p.role),
            str(p.desired_workers),
            str(p.num_ready),
            str(p.num_starting),
            str(p.num_draining),
            str(p.num_restarts),
            str(p.num_failed_starts),
        )
        for p in pools
    ]
    return _table(rows)


def format_status(status: router_pb2.StatusResponse) -> str:
    """The ``splitserve status`` table: the router, its pools, then one line per worker."""
    models = ", ".join(status.models) or status.model
    lines = [
        f"router: {status.mode}, model{'s' if len(status.models) > 1 else ''} {models}, "
        f"{status.num_inflight_requests} requests in flight"
    ]
    not_serving = why_not_serving(status)
    if not_serving is not None:
        lines.append(f"not serving: {not_serving}")
    if status.pools:
        lines += ["", format_pools(status.pools)]
    else:
        lines.append("pools: fixed (no orchestrator; splitserve up --no-ray)")
    rows = [
        ("MODEL", "ROLE", "ADDRESS", "WORKER_ID", "STATE", "RUNNING", "WAITING", "KV_LEASES",
         "KV_USAGE", "QUEUED_PREFILL_TOKENS", "DTYPE", "CPU"),
    ]  # fmt: skip
    for w in status.workers:
        state = "draining" if w.draining else "ready" if w.healthy else "unhealthy"
        rows.append(
            (
                w.info.served_model_name or "-",
                Role.from_proto(w.role),
                w.address,
                w.info.worker_id or "-",
                state,
                str(w.load.num_running),
                str(w.load.num_waiting + w.load.num_waiting_for_kv),
                str(w.load.num_kv_leases),
                f"{w.load.kv_usage:.1%}",
                str(w.load.num_queued_prefill_tokens),
                w.info.dtype or "-",
                w.info.cpu_isa or "-",
            )
        )
    lines += ["", _table(rows)]
    kernels = sorted({w.info.kernels for w in status.workers})
    if len(kernels) == 1:
        lines.append(f"kernels: {kernels[0]}")
    else:
        lines += [
            f"kernels of {w.address}: {w.info.kernels}" for w in status.workers if w.info.kernels
        ]
    several = len(status.models) > 1
    errors = [
        f"  {f'{p.model} ' if several else ''}{Role.from_proto(p.role)} pool, last failed start: "
        f"{p.last_error}"
        for p in status.pools
        if p.last_error
    ]
    errors += [f"  {w.address}: {w.last_error}" for w in status.workers if w.last_error]
    if errors:
        lines += ["", "last errors:", *errors]
    return "\n".join(lines)


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )
