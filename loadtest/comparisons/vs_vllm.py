"""Online serving head to head: ``vllm serve`` against splitserve colocated and disaggregated.

``python -m loadtest.comparisons.vs_vllm --out DIR [--model smollm2-135m] [--rates 0.5,1,1.5]
[--duration 90] [--slo-ttft-ms 2000] [--slo-itl-ms 100] [--slo-itl-percentile 90]
[--vllm-python /opt/vllm-venv/bin/python]``

Four arms on the same two cores, each fed the same seeded open-loop ``chat`` workload through
the same load generator over the OpenAI HTTP API (``/v1/completions``, token-id prompts,
greedy, ``ignore_eos``, streamed):

- ``vllm serve`` (vLLM CPU in its own venv, its defaults; both cores bound to its OpenMP
  threads, ``VLLM_CPU_KVCACHE_SPACE`` 2 GiB like splitserve's default cache, tcmalloc and
  Intel OpenMP preloaded as vLLM asks);
- splitserve colocated: 2 replicas behind the router, each pinned to one core;
- splitserve disaggregated: 1 prefill + 1 decode worker, each pinned to one core;
- splitserve on both cores: one colocated worker with a torch thread per core, the shape
  vLLM runs in (every step on both cores).

Every arm runs its engine defaults at the same model dtype (``--dtype``, default the host
level's auto); the router and the load generator share the cores in every arm. Per rate:
TTFT and ITL p50/p99, output tok/s, goodput under the SLOs; then each splitserve arm's goodput
over vLLM's, and the highest rate at which each arm still meets the SLOs (goodput at least 90%
of its completed rate), over vLLM's. Under ``--out``: one report per arm
(``<arm>/results.json``, plots), and ``comparison.md``, ``comparison.json`` and
``comparison.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import shlex
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from engine.config import EngineConfig
from engine.cpu_isa import cpu_auto_dtype, host_isa
from loadtest.bench.engine import resolve_model_dir, vllm_ld_preload
from loadtest.generator.backends import Backend
from loadtest.generator.openai_http import OpenAIClient
from loadtest.generator.report import RunResult, write_reports
from loadtest.generator.sweep import (
    LoadSpec,
    ServedModel,
    load_runs,
    load_served_model,
    run_sweep,
    warm_up,
)
from services.launcher import LocalCluster
from services.service_process import PortReservation

logger = logging.getLogger(__name__)

WORKLOAD = "chat"
MAX_MODEL_LEN = 4096
_SLO_MET_SHARE = 0.9  # vLLM "meets the SLOs" at a rate where >= 90% of completions meet them


@dataclass(frozen=True, slots=True)
class ServingArm:
    """One server under test: vLLM's, or a splitserve cluster shape."""

    name: str
    num_prefill: int = 0
    num_decode: int = 0
    mode: str = ""  # splitserve's --mode; empty for vLLM
    shared_cores: bool = False  # one worker on every core (torch threads = cores), like vLLM

    @property
    def slug(self) -> str:
        return self.name.replace(" ", "-").replace("+", "")


ARMS = (
    ServingArm("vllm serve"),
    ServingArm("splitserve colocated 2x", 0, 2, "colocated"),
    ServingArm("splitserve 1P+1D", 1, 1, "disaggregated"),
    ServingArm("splitserve 1x on both cores", 0, 1, "colocated", shared_cores=True),
)


@contextmanager
def vllm_server(args: argparse.Namespace, model_dir: Path, cores: Sequence[str]) -> Iterator[str]:
    """``vllm serve`` on a free port, bound to ``cores``; yields its base URL once healthy."""
    reservation = PortReservation()  # held while vLLM binds it
    port = reservation.port
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="2",
        VLLM_CPU_OMP_THREADS_BIND=",".join(cores),
        OMP_NUM_THREADS=str(len(cores)),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    preload = vllm_ld_preload("auto", args.vllm_python)
    if preload:
        env["LD_PRELOAD"] = preload
    # The module, not the ``vllm`` CLI: the CLI looks up the ``vllm`` distribution's version,
    # and vLLM CPU installs as ``vllm-cpu``.
    argv = [
        args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", args.model, "--dtype", args.dtype, "--port", str(port),
        "--max-model-len", str(MAX_MODEL_LEN), "--seed", str(args.seed),
    ]  # fmt: skip
    log_path = args.out / "vllm-serve.log"
    args.out.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, args.start_timeout_s, log_path)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reservation.close()


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited ({proc.returncode}); see {log_path}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"vllm serve not healthy after {timeout_s:.0f} s; see {log_path}")


@contextmanager
def splitserve_server(arm: ServingArm, engine: EngineConfig, cores: Sequence[str]) -> Iterator[str]:
    """A local splitserve cluster of ``arm``'s shape, workers pinned one per core (or one worker
    on all of them); yields the router's HTTP base URL once every worker is routable."""
    if arm.shared_cores:
        engine = dataclasses.replace(engine, num_threads=len(cores))
        cores = [",".join(cores)]
    cluster = LocalCluster(
        engine=engine,
        num_prefill=arm.num_prefill,
        num_decode=arm.num_decode,
        mode=arm.mode,
        worker_cpu_cores=cores,
    )
    try:
        cluster.start()
        yield cluster.http_url
    finally:
        cluster.stop()


def run_arm(
    arm: ServingArm,
    args: argparse.Namespace,
    engine: EngineConfig,
    served: ServedModel,
    spec: LoadSpec,
    cores: Sequence[str],
) -> list[RunResult]:
    server = (
        vllm_server(args, args.model_dir, cores)
        if not arm.mode
        else splitserve_server(arm, engine, cores)
    )
    with server as url:
        logger.info("%s: serving on %s", arm.name, url)
        client = OpenAIClient(Backend.OPENAI_COMPLETIONS, url, served.name)
        warm_up(client, served, WORKLOAD, spec.seed)
        return run_sweep(client, spec, served, show_progress=sys.stderr.isatty())


def output_tokens_per_s(result: RunResult) -> float:
    done = [r for r in result.records if r.ok]
    if not done:
        return 0.0
    start = min(r.sent_s for r in result.records)
    end = max(r.sent_s + r.e2e_s for r in done if r.e2e_s is not None)
    return sum(r.output_tokens for r in done) / (end - start)


def highest_rate_meeting_slos(results: list[RunResult]) -> float | None:
    """The highest offered rate at which at least 90% of an arm's completions met the SLOs
    (the rate it sustains under them: DistServe's goodput), or None."""
    met = [
        r.offered_rate_per_s
        for r in results
        if r.summary.requests_per_s
        and r.summary.goodput_requests_per_s >= _SLO_MET_SHARE * r.summary.requests_per_s
    ]
    return max((rate for rate in met if rate is not None), default=None)


def comparison(runs: dict[str, list[RunResult]], spec: LoadSpec, command: str) -> tuple[str, dict]:
    vllm = runs[ARMS[0].name]
    lines = [
        f"# splitserve vs vllm serve ({WORKLOAD}, OpenAI HTTP)",
        "",
        f"Command: `{command}`",
        "",
        f"SLOs: TTFT <= {spec.slo_ttft_ms:g} ms and p{spec.slo_itl_percentile:g} of each "
        f"request's inter-token gaps <= {spec.slo_itl_ms:g} ms.",
        "",
        "| arm | run | done/sent | output tok/s | goodput req/s | TTFT p50/p99 ms "
        "| ITL p50/p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    rows: list[dict] = []
    for arm in ARMS:
        for result in runs[arm.name]:
            s = result.summary
            lines.append(
                f"| {arm.name} | {result.label} | {s.num_completed}/{s.num_sent} "
                f"| {output_tokens_per_s(result):.1f} | {s.goodput_requests_per_s:.2f} "
                f"| {s.ttft_ms['p50']:.0f} / {s.ttft_ms['p99']:.0f} "
                f"| {s.itl_ms['p50']:.0f} / {s.itl_ms['p99']:.0f} |"
            )
    lines += ["", "| run | arm | goodput / vLLM's | output tok/s / vLLM's |", "|---|---|---|---|"]
    for arm in ARMS[1:]:
        for ours, theirs in zip(runs[arm.name], vllm, strict=True):
            g_ours, g_theirs = (
                ours.summary.goodput_requests_per_s,
                theirs.summary.goodput_requests_per_s,
            )
            goodput_ratio = g_ours / g_theirs if g_theirs else math.inf
            tok_ratio = output_tokens_per_s(ours) / max(output_tokens_per_s(theirs), 1e-9)
            rows.append(
                {"run": ours.label, "arm": arm.name, "goodput_ratio": goodput_ratio,
                 "output_tok_ratio": tok_ratio}
            )  # fmt: skip
            shown = f"{goodput_ratio:.2f}x" if math.isfinite(goodput_ratio) else "- (vLLM 0)"
            lines.append(f"| {ours.label} | {arm.name} | {shown} | {tok_ratio:.2f}x |")
    sustained = {arm.name: highest_rate_meeting_slos(runs[arm.name]) for arm in ARMS}
    rate = sustained[ARMS[0].name]
    lines += ["", f"Highest rate at which vLLM meets the SLOs: {rate if rate else 'none'}."]
    lines += [
        "",
        "Highest offered rate at which each arm meets the SLOs (at least 90% of its completions):",
        "",
        "| arm | req/s | / vLLM's |",
        "|---|---|---|",
    ]
    for arm in ARMS:
        arm_rate = sustained[arm.name]
        ratio = f"{arm_rate / rate:.2f}x" if arm_rate and rate else "-"
        lines.append(f"| {arm.name} | {arm_rate if arm_rate else 'none'} | {ratio} |")
    summary = {"ratios": rows, "vllm_meets_slos_up_to": rate, "meets_slos_up_to": sustained}
    return "\n".join(lines) + "\n", summary


def comparison_plot(runs: dict[str, list[RunResult]], path: Path) -> None:
    """Goodput, TTFT p50 and ITL p99 against the offered rate, one line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    panels = (
        ("goodput (both SLOs met), req/s", lambda s: s.goodput_requests_per_s),
        ("TTFT p50, ms", lambda s: s.ttft_ms["p50"]),
        ("ITL p99, ms", lambda s: s.itl_ms["p99"]),
    )
    for axis, (title, value) in zip(axes, panels, strict=True):
        for arm in ARMS:
            results = runs[arm.name]
            rates = [r.offered_rate_per_s for r in results]
            axis.plot(rates, [value(r.summary) for r in results], "o-", label=arm.name)
        axis.set_title(title)
        axis.set_xlabel("offered rate (requests/s)")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.comparisons.vs_vllm")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default=cpu_auto_dtype(host_isa()))
    parser.add_argument("--rates", default="0.5,1,1.5")
    parser.add_argument("--duration", type=float, default=90.0, help="seconds of sending")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--slo-ttft-ms", type=float, default=2_000.0)
    parser.add_argument("--slo-itl-ms", type=float, default=100.0)
    parser.add_argument("--slo-itl-percentile", type=float, default=90.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-python", default="/opt/vllm-venv/bin/python")
    parser.add_argument("--start-timeout-s", type=float, default=600.0)
    parser.add_argument(
        "--arms",
        default=",".join(a.slug for a in ARMS),
        help="the arms to run (others are read back from --out), of: "
        + ", ".join(a.slug for a in ARMS),
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cores = [str(c) for c in sorted(os.sched_getaffinity(0))[:2]]
    if len(cores) < 2:
        print("vs-vllm needs two CPU cores", file=sys.stderr)
        return 2
    args.model_dir = resolve_model_dir(args.model)
    spec = LoadSpec(
        workload=WORKLOAD,
        rates=tuple(float(r) for r in args.rates.split(",")),
        num_requests=args.num_requests,
        duration_s=args.duration,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_itl_ms=args.slo_itl_ms,
        slo_itl_percentile=args.slo_itl_percentile,
        seed=args.seed,
    )
    engine = EngineConfig(
        model=args.model, dtype=args.dtype, num_threads=1, max_model_len=MAX_MODEL_LEN
    )
    served = load_served_model(args.model, args.model, MAX_MODEL_LEN)
    command = "python -m loadtest.comparisons.vs_vllm " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    wanted = set(args.arms.split(","))
    runs: dict[str, list[RunResult]] = {}
    for arm in ARMS:
        results_path = args.out / arm.slug / "results.json"
        if arm.slug not in wanted:
            _, runs[arm.name] = load_runs(results_path, spec)
            continue
        runs[arm.name] = run_arm(arm, args, engine, served, spec, cores)
        config = {
            "command": command,
            "target": arm.name,
            "workload": WORKLOAD,
            "seed": spec.seed,
            "model": args.model,
            "burstiness": spec.burstiness,
        }
        write_reports(args.out / arm.slug, config, runs[arm.name])
    markdown, summary = comparison(runs, spec, command)
    (args.out / "comparison.md").write_text(markdown)
    (args.out / "comparison.json").write_text(json.dumps({"command": command, **summary}, indent=1))
    comparison_plot(runs, args.out / "comparison.png")
    print(markdown)
    return 0
