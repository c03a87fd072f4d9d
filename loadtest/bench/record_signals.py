"""Record the autoscaler's signals from a real cluster under a steady, noisy load.

``python -m loadtest.bench.record_signals [--model DIR] [--duration-s 90] [--window-s 2]
[--concurrency 6] --out tests/fixtures/planner_trace.json`` starts a local cluster (one prefill
and one decode worker; a tiny random Llama unless ``--model``), keeps ``--concurrency`` streams
of fresh random prompts (32-256 tokens, 16-64 output tokens) going, and every ``--window-s``
writes the window's p90 TTFT and ITL seen by the clients and the pools' queues and KV usage, as
``services.cluster.planner.PoolSignals`` fields. ``tests/services/cluster/test_planner.py``
replays the trace to check that the planner does not flap.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from engine.config import EngineConfig
from loadtest.fixtures.tiny_model import make_tiny_llama
from services.cluster.planner import percentile
from services.launcher import LocalCluster
from splitserve.v1 import router_pb2, router_pb2_grpc, worker_pb2

PREFILL, DECODE = worker_pb2.WORKER_ROLE_PREFILL, worker_pb2.WORKER_ROLE_DECODE


class Streams:
    """Closed-loop clients; each token's arrival time goes into the shared sample lists."""

    def __init__(self, address: str, concurrency: int, vocab_size: int) -> None:
        self.ttft_s: list[float] = []
        self.itl_s: list[float] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._run, args=(address, seed, vocab_size), daemon=True)
            for seed in range(concurrency)
        ]

    def _run(self, address: str, seed: int, vocab_size: int) -> None:
        rng = random.Random(seed)
        with grpc.insecure_channel(address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            while not self.stop.is_set():
                prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randrange(32, 257))]
                sampling = router_pb2.SamplingParams(
                    max_tokens=rng.randrange(16, 65), temperature=0.0, ignore_eos=True
                )
                last_s = time.perf_counter()
                request = router_pb2.GenerateRequest(token_ids=prompt, sampling=sampling)
                for i, _ in enumerate(stub.Generate(request, timeout=120)):
                    now_s = time.perf_counter()
                    with self.lock:
                        (self.ttft_s if i == 0 else self.itl_s).append(now_s - last_s)
                    last_s = now_s

    def take(self) -> tuple[list[float], list[float]]:
        with self.lock:
            taken = self.ttft_s, self.itl_s
            self.ttft_s, self.itl_s = [], []
        return taken


def _pool(status: router_pb2.StatusResponse, role: int, latency_s: float | None) -> dict:
    workers = [w for w in status.workers if w.role == role]
    num = max(len(workers), 1)
    queued = sum(
        w.load.num_waiting + (w.load.num_waiting_for_kv if role == DECODE else 0) for w in workers
    )
    return {
        "num_workers": len(workers),
        "latency_ms": round(latency_s * 1000, 3) if latency_s is not None else None,
        "queue_per_worker": queued / num,
        "kv_usage": round(sum(w.load.kv_usage for w in workers) / num, 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: a tiny Llama)")
    parser.add_argument("--duration-s", type=float, default=90.0)
    parser.add_argument("--window-s", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_tiny_llama(Path(tmp) / "tiny", vocab_size=2000))
        cluster = LocalCluster(
            engine=EngineConfig(model=model, dtype="float32", num_kv_blocks=512),
            extra_router_flags=("--local-prefill-max-tokens", "0"),
        )
        address = cluster.start()
        try:
            windows = _record(args, address)
        finally:
            cluster.stop()
    flags = " ".join(sys.argv[1:] if argv is None else argv)
    trace = {"command": f"python -m loadtest.bench.record_signals {flags}", "windows": windows}
    args.out.write_text(json.dumps(trace, indent=1) + "\n")
    print(f"{len(windows)} windows -> {args.out}")
    return 0


def _record(args: argparse.Namespace, address: str) -> list[dict]:
    streams = Streams(address, args.concurrency, vocab_size=1900)
    for thread in streams.threads:
        thread.start()
    windows = []
    with grpc.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        time.sleep(args.window_s)
        streams.take()  # warm-up
        end_s = time.monotonic() + args.duration_s
        while time.monotonic() < end_s:
            time.sleep(args.window_s)
            ttft_s, itl_s = streams.take()
            status = stub.Status(router_pb2.StatusRequest(), timeout=10)
            windows.append(
                {
                    "prefill": _pool(
                        status, worker_pb2.WORKER_ROLE_PREFILL, percentile(ttft_s, 0.9)
                    ),
                    "decode": _pool(status, worker_pb2.WORKER_ROLE_DECODE, percentile(itl_s, 0.9)),
                }
            )
    streams.stop.set()
    return windows


if __name__ == "__main__":
    raise SystemExit(main())
