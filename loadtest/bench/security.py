"""What TLS, mutual TLS and API keys cost: the same load through a plaintext cluster and a
secured one (``--tls-dir`` on every service, ``--api-key-file`` on the router).

``python -m loadtest.bench.security --model smollm2-135m [--rounds 2] [--num-requests 24]
[--kv-transfer tcp]``
starts each cluster in turn with ``splitserve up``'s launcher (one prefill and one decode
worker, the cores split between them), warms it up, then sends ``--num-requests`` chat requests
(prompts seeded by ``--seed``: the same ones to both arms), ``--concurrency`` in flight; the
arms alternate ``--rounds`` times (plaintext, secured, plaintext, ...), so that machine drift
hits both alike.
Prints a Markdown table (TTFT p50 / p90, output tok/s, each arm's median over its rounds) and
writes ``security.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import secrets
import statistics
import tempfile
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.flags import add_flags, from_args
from loadtest.generator.backends import GrpcClient
from loadtest.generator.runner import closed_loop_summary
from loadtest.generator.sweep import served_model
from loadtest.generator.synthetic import WorkloadGenerator
from services.certs import write_cluster_certs
from services.launcher import LocalCluster

_ARMS = ("plaintext", "tls+keys")


def _start(
    engine: EngineConfig, arm: str, root: Path, kv_transfer: str
) -> tuple[LocalCluster, dict[str, str]]:
    """A started cluster and what a client needs to call it (api_key, ca_file)."""
    worker_flags = ("--kv-transfer", kv_transfer) if kv_transfer else ()
    if arm == "plaintext":
        cluster = LocalCluster(engine=engine, extra_worker_flags=worker_flags)
        cluster.start()
        return cluster, {"api_key": "", "ca_file": ""}
    data_key, admin_key = secrets.token_hex(24), secrets.token_hex(24)
    key_file = root / "api-keys"
    key_file.write_text(f"{data_key} data\n")
    cluster = LocalCluster(
        engine=engine,
        tls_dir=str(root / "certs"),
        admin_api_key=admin_key,
        extra_router_flags=("--api-key-file", str(key_file)),
        extra_worker_flags=worker_flags,
    )
    cluster.start()
    return cluster, {"api_key": data_key, "ca_file": str(root / "certs" / "ca.crt")}


def _measure(
    engine: EngineConfig, arm: str, root: Path, args: argparse.Namespace
) -> dict[str, float]:
    cluster, credentials = _start(engine, arm, root, args.kv_transfer)
    try:
        # Status needs an admin key on the secured arm: ask as the launcher does.
        served = served_model(
            cluster.router_address,
            api_key=cluster.admin_api_key,
            ca_file=credentials["ca_file"],
        )
        client = GrpcClient(cluster.router_address, **credentials)
        warmup = WorkloadGenerator("chat", list(served.vocab), served.max_model_len, seed=999)
        closed_loop_summary(client, [warmup.next() for _ in range(4)], 2)
        generator = WorkloadGenerator(
            "chat", list(served.vocab), served.max_model_len, seed=args.seed + 1
        )
        requests = [generator.next() for _ in range(args.num_requests)]
        summary = closed_loop_summary(client, requests, args.concurrency)
    finally:
        cluster.stop()
    return {
        "ttft_p50_ms": summary.ttft_ms["p50"],
        "ttft_p90_ms": summary.ttft_ms["p90"],
        "output_tokens_per_s": summary.output_tokens_per_s,
        "completed": summary.num_completed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flags(parser, EngineConfig)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("bench-out/security"))
    # tcp or ucx: the secured arm's KV transfers are mutual TLS too (nixl, the default when
    # installed, has no TLS).
    parser.add_argument("--kv-transfer", default="")
    args = parser.parse_args()
    engine = dataclasses.replace(from_args(EngineConfig, args), detokenize=False)
    rounds: dict[str, list[dict[str, float]]] = {arm: [] for arm in _ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_cluster_certs(root / "certs", ["localhost", "127.0.0.1"])
        for _ in range(args.rounds):
            for arm in _ARMS:
                rounds[arm].append(_measure(engine, arm, root, args))
    medians = {
        arm: {k: statistics.median(r[k] for r in results) for k in results[0]}
        for arm, results in rounds.items()
    }
    base, secured = medians["plaintext"], medians["tls+keys"]
    print("| arm | TTFT p50 ms | TTFT p90 ms | output tok/s | completed |")
    print("|---|---|---|---|---|")
    for arm, m in medians.items():
        print(
            f"| {arm} | {m['ttft_p50_ms']:.0f} | {m['ttft_p90_ms']:.0f} | "
            f"{m['output_tokens_per_s']:.1f} | {m['completed']:.0f} |"
        )
    ttft_change = secured["ttft_p50_ms"] / base["ttft_p50_ms"] - 1
    throughput_change = secured["output_tokens_per_s"] / base["output_tokens_per_s"] - 1
    print(f"TTFT p50 {ttft_change:+.1%}, output tok/s {throughput_change:+.1%}")
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"rounds": rounds, "medians": medians, "args": vars(args)}
    (args.out / "security.json").write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
