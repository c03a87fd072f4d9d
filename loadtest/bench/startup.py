"""How long ``splitserve up`` takes to serve, and a scale-up to add a worker.

``python -m loadtest.bench.startup --model smollm2-135m [--runs 3] [--cold]`` runs
``splitserve up`` (on Ray, then ``--no-ray``) as a user would and measures:

- ``ready_s``: from the command to the banner (every service healthy);
- ``first_token_s``: from the command to the first streamed token of a chat request sent right
  after the banner;
- ``scale_up_s`` (Ray only): from ``splitserve scale prefill 2`` to the new worker serving.

``--cold`` gives every run empty caches (converted model, compiled CPU kernel), as on a fresh
machine. Prints a Markdown table and writes ``startup.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from services.service_process import PortReservation
from splitserve.v1 import router_pb2, router_pb2_grpc, worker_pb2


def measure(model: str, ray: bool, cold: bool) -> dict[str, float]:
    env = dict(os.environ)
    # The port is held while `up` binds it (see PortReservation).
    with tempfile.TemporaryDirectory() as cache, PortReservation() as reservation:
        port = reservation.port
        if cold:
            env["SPLITSERVE_CACHE_DIR"] = str(Path(cache) / "models")
            env["TORCH_EXTENSIONS_DIR"] = str(Path(cache) / "torch_extensions")
        argv = [sys.executable, "-m", "services.cli", "up", "--model", model, "--port", str(port)]
        start_s = time.monotonic()
        proc = subprocess.Popen(
            [*argv, "--ray" if ray else "--no-ray"], stdout=subprocess.PIPE, text=True, env=env
        )
        try:
            assert proc.stdout is not None
            while "listening" not in (line := proc.stdout.readline()):
                if not line:
                    raise RuntimeError("splitserve up exited before serving")
            result = {"ready_s": time.monotonic() - start_s}
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                request = router_pb2.GenerateRequest(
                    messages=[router_pb2.ChatMessage(role="user", content="Hello!")],
                    sampling=router_pb2.SamplingParams(max_tokens=2, temperature=0.0),
                )
                next(iter(stub.Generate(request, timeout=120)))
                result["first_token_s"] = time.monotonic() - start_s
                if ray:
                    result["scale_up_s"] = _scale_up_s(stub)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
    return result


def _scale_up_s(stub: router_pb2_grpc.RouterStub) -> float:
    start_s = time.monotonic()
    stub.Scale(router_pb2.ScaleRequest(role=worker_pb2.WORKER_ROLE_PREFILL, num_workers=2))
    while True:
        pools = stub.Status(router_pb2.StatusRequest(), timeout=10).pools
        prefill = next(p for p in pools if p.role == worker_pb2.WORKER_ROLE_PREFILL)
        if prefill.num_ready == 2:
            return time.monotonic() - start_s
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="empty model and kernel caches")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    args = parser.parse_args(argv)
    rows: dict[str, list[dict[str, float]]] = {"ray": [], "no-ray": []}
    for _ in range(args.runs):
        for name in rows:
            rows[name].append(measure(args.model, name == "ray", args.cold))
            print(name, rows[name][-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "startup.json").write_text(json.dumps(rows, indent=2))
    caches = "cold caches" if args.cold else "warm caches"
    print(f"\n| launcher ({caches}) | ready (median) | first token | scale-up +1 prefill |")
    print("|---|---|---|---|")
    for name, runs in rows.items():
        cells = [
            f"{statistics.median(r[key] for r in runs):.1f} s" if key in runs[0] else "-"
            for key in ("ready_s", "first_token_s", "scale_up_s")
        ]
        print(f"| {name} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
