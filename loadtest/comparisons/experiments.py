"""The headline comparisons, each arm a fresh local cluster on the same two cores.

``python -m loadtest.comparisons.experiments disaggregation --out DIR [--model smollm2-135m]
[--rates 0.3,0.5] [--duration 180] [--slo-ttft-ms T] [--slo-itl-ms I] [--slo-itl-percentile P]
[--engine-flags "..."]``
``python -m loadtest.comparisons.experiments prefix-routing --out DIR [...]``
``python -m loadtest.comparisons.experiments hosts --out DIR [...]`` (root: test hosts)
(``python -m loadtest.comparisons.vs_vllm`` runs the comparison against ``vllm serve``.)

- ``disaggregation``: 1 prefill + 1 decode worker against 2 colocated replicas (each runs whole
  requests) behind one router, on the ``long-mixed`` workload (long documents arriving among
  streaming chats). Targets: disaggregated p99 ITL <= 0.5x colocated at the same offered rate,
  and goodput >= 1.3x colocated under the SLOs.
- ``prefix-routing``: 2 colocated replicas behind a router choosing by prefix cache hits and
  load (``--prefill-policy cost``) against the cache-blind round-robin baseline, on the
  ``shared-prefix`` workload. Target: prefix-aware TTFT p50 <= 0.3x round-robin.
- ``hosts``: 1 prefill + 1 decode worker with the router, each on a test host of its own
  (``loadtest.fixtures.netns_hosts``; KV over nixl, UCX over TCP), against the same three
  processes on one host (loopback; UCX picks shared memory), on the ``chat`` workload: what
  crossing a network costs. Target: TTFT p50 and ITL p50 across hosts <= 1.1x one host.

Both arms of an experiment run the same engine flags, with each worker pinned to its own core
(``--cpu-cores``) on one torch thread, so that they use the same hardware; the router and the
load generator share the two cores in both. Every arm replays the same seeded requests at the
same send times after a short warm-up. Under ``--out``: one ``splitserve loadtest`` report per
arm (``<arm>/results.json``, ``report.md``, plots), then ``comparison.md``, ``comparison.json``
and ``comparison.png`` across arms.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.flags import add_flags, from_args
from loadtest.fixtures.netns_hosts import HostNetwork, ucx_across_hosts
from loadtest.generator.backends import GrpcClient
from loadtest.generator.metrics import Summary
from loadtest.generator.report import RunResult, write_reports
from loadtest.generator.sweep import (
    LoadSpec,
    load_runs,
    run_sweep,
    served_model,
    warm_up,
)
from services.common.roles import POOL_ROLES, Role
from services.launcher import LocalCluster, Placement

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Arm:
    """One cluster shape under test."""

    name: str
    mode: str
    num_prefill: int
    num_decode: int
    router_flags: tuple[str, ...] = ()
    worker_flags: tuple[str, ...] = ()
    hosts: bool = False  # each process on a test host of its own (root)

    @property
    def slug(self) -> str:
        return self.name.replace(" ", "-")


@dataclass(frozen=True, slots=True)
class Target:
    """``metric`` of the first arm over the second's must be ``<=`` (or ``>=``) ``ratio``."""

    metric: str  # a Summary field, optionally with a percentile: "itl_ms.p99"
    op: str
    ratio: float

    def value(self, summary: Summary) -> float:
        name, _, quantile = self.metric.partition(".")
        value = getattr(summary, name)
        return value[quantile] if quantile else value

    def holds(self, ratio: float) -> bool:
        return ratio <= self.ratio if self.op == "<=" else ratio >= self.ratio


@dataclass(frozen=True, slots=True)
class Experiment:
    """Two arms (the first is the one expected to win), a workload, and what it must show."""

    workload: str
    arms: tuple[Arm, Arm]
    targets: tuple[Target, ...]
    default_rates: tuple[float, ...]
    default_slo_ttft_ms: float
    default_slo_itl_ms: float
    default_slo_itl_percentile: float
    engine_flags: tuple[str, ...] = ()  # both arms'


_NIXL = ("--kv-transfer", "nixl")
EXPERIMENTS = {
    "disaggregation": Experiment(
        workload="long-mixed",
        arms=(
            Arm("disaggregated 1P+1D", "disaggregated", 1, 1),
            Arm("colocated 2x", "colocated", 0, 2),
        ),
        targets=(Target("itl_ms.p99", "<=", 0.5), Target("goodput_requests_per_s", ">=", 1.3)),
        default_rates=(0.3, 0.5, 0.7),
        # Loose on TTFT: a 3k-token document alone takes seconds to prefill on one core. Tight
        # on streaming: at most 1% of a request's gaps above 100 ms (no repeated stalls).
        default_slo_ttft_ms=10_000.0,
        default_slo_itl_ms=100.0,
        default_slo_itl_percentile=99.0,
        # A short prompt then shares a step with a long one instead of waiting for all of it.
        engine_flags=("--long-prefill-token-threshold", "512"),
    ),
    "prefix-routing": Experiment(
        workload="shared-prefix",
        arms=(
            Arm("prefix-aware", "colocated", 0, 2, ("--prefill-policy", "cost")),
            Arm("round-robin", "colocated", 0, 2, ("--prefill-policy", "round_robin")),
        ),
        targets=(Target("ttft_ms.p50", "<=", 0.3),),
        default_rates=(1.0, 1.5, 2.0),
        default_slo_ttft_ms=1_000.0,
        default_slo_itl_ms=100.0,
        default_slo_itl_percentile=90.0,
        # Each replica holds about 5 of the workload's 8 system prompts (32 blocks each): the
        # prompts one replica gets under prefix-aware routing fit, all of them do not.
        engine_flags=("--num-kv-blocks", "200", "--max-model-len", "3200"),
    ),
    "hosts": Experiment(
        workload="chat",
        arms=(
            Arm("1P+1D across hosts", "disaggregated", 1, 1, worker_flags=_NIXL, hosts=True),
            Arm("1P+1D on one host", "disaggregated", 1, 1, worker_flags=_NIXL),
        ),
        targets=(Target("ttft_ms.p50", "<=", 1.1), Target("itl_ms.p50", "<=", 1.1)),
        default_rates=(0.5,),
        default_slo_ttft_ms=2_000.0,
        default_slo_itl_ms=100.0,
        default_slo_itl_percentile=90.0,
    ),
}


def run_arm(
    arm: Arm, engine: EngineConfig, workload: str, spec: LoadSpec, cpu_cores: Sequence[str]
) -> list[RunResult]:
    """Start ``arm``'s cluster pinned to ``cpu_cores``, warm it up, run ``spec``, stop it."""
    network = None
    environment = contextlib.nullcontext()
    if arm.hosts:
        network = HostNetwork([role.value for role in (Role.ROUTER, *POOL_ROLES)]).create()
        environment = ucx_across_hosts()
    cluster = LocalCluster(
        engine=engine,
        num_prefill=arm.num_prefill,
        num_decode=arm.num_decode,
        mode=arm.mode,
        worker_cpu_cores=cpu_cores,
        extra_worker_flags=arm.worker_flags,
        extra_router_flags=arm.router_flags,
        placement=None if network is None else _host_per_role(network),
    )
    try:
        with environment:  # the processes take the environment they start with
            target = cluster.start()
        logger.info("%s: serving on %s", arm.name, target)
        served = served_model(target)
        client = GrpcClient(target)
        warm_up(client, served, workload, spec.seed)
        return run_sweep(client, spec, served, show_progress=sys.stderr.isatty())
    finally:
        cluster.stop()
        if network is not None:
            network.remove()


def _host_per_role(network: HostNetwork) -> Callable[[Role, int], Placement]:
    """Every process on the test host named after its role (one process per role)."""

    def place(role: Role, index: int) -> Placement:
        return network.placement(role.value)

    return place


def compare(experiment: Experiment, runs: dict[str, list[RunResult]]) -> list[dict[str, Any]]:
    """Per offered rate: each target's two values, their ratio and whether it holds (None
    when both values are 0, e.g. no goodput in either arm: nothing was shown)."""
    first, second = experiment.arms
    rows = []
    for ours, theirs in zip(runs[first.name], runs[second.name], strict=True):
        for target in experiment.targets:
            a, b = target.value(ours.summary), target.value(theirs.summary)
            ratio = a / b if b else (math.inf if a else math.nan)
            rows.append(
                {
                    "run": ours.label,
                    "metric": target.metric,
                    first.name: a,
                    second.name: b,
                    "ratio": ratio,
                    "target": f"{target.op} {target.ratio}",
                    "met": None if math.isnan(ratio) else target.holds(ratio),
                }
            )
    return rows


_VERDICTS = {True: "yes", False: "no", None: "n/a"}


def _fmt(value: float) -> str:
    return f"{value:.2f}" if math.isfinite(value) else "-"


def _fmt_ratio(ratio: float) -> str:
    return f"{ratio:.2f}x" if math.isfinite(ratio) else "-"


def comparison_markdown(
    experiment: Experiment,
    command: str,
    spec: LoadSpec,
    runs: dict[str, list[RunResult]],
    rows: list[dict[str, Any]],
) -> str:
    first, second = experiment.arms
    lines = [
        f"# {first.name} vs {second.name} ({experiment.workload})",
        "",
        f"Command: `{command}`",
        "",
        f"SLOs: TTFT <= {spec.slo_ttft_ms:g} ms and p{spec.slo_itl_percentile:g} of each "
        f"request's inter-token gaps <= {spec.slo_itl_ms:g} ms.",
        "",
        "| arm | run | done/sent | req/s | goodput req/s | prefix hits | TTFT p50/p99 ms "
        "| ITL p50/p99 ms | TPOT p50/p99 ms | E2E p50/p99 ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in experiment.arms:
        for result in runs[arm.name]:
            s = result.summary
            lines.append(
                f"| {arm.name} | {result.label} | {s.num_completed}/{s.num_sent} "
                f"| {_fmt(s.requests_per_s)} | {_fmt(s.goodput_requests_per_s)} "
                f"| {s.prefix_hit_rate:.1%} "
                f"| {s.ttft_ms['p50']:.0f} / {s.ttft_ms['p99']:.0f} "
                f"| {s.itl_ms['p50']:.0f} / {s.itl_ms['p99']:.0f} "
                f"| {s.tpot_ms['p50']:.0f} / {s.tpot_ms['p99']:.0f} "
                f"| {s.e2e_ms['p50']:.0f} / {s.e2e_ms['p99']:.0f} |"
            )
    lines += ["", f"| run | metric | {first.name} | {second.name} | ratio | target | met |"]
    lines.append("|---|---|---|---|---|---|---|")
    for row in rows:
        lines.append(
            f"| {row['run']} | {row['metric']} | {_fmt(row[first.name])} "
            f"| {_fmt(row[second.name])} | {_fmt_ratio(row['ratio'])} | {row['target']} "
            f"| {_VERDICTS[row['met']]} |"
        )
    return "\n".join(lines) + "\n"


def comparison_plot(experiment: Experiment, runs: dict[str, list[RunResult]], path: Path) -> None:
    """Left: the latency the experiment is about at the highest rate, per arm (ITL as the
    fraction of gaps above x, which shows the tail; TTFT as a CDF); then goodput and that
    latency's percentile against the offered rate, one line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_token = experiment.targets[0].metric.startswith("itl")
    name, quantile = ("ITL", "p99") if per_token else ("TTFT", "p50")
    fig, (cdf_axis, goodput_axis, tail_axis) = plt.subplots(1, 3, figsize=(16, 4.4))
    for arm in experiment.arms:
        results = runs[arm.name]
        done = [r for r in results[-1].records if r.ok]
        values_ms = sorted(
            [g * 1000 for r in done for g in r.itl_s()]
            if per_token
            else [r.ttft_s * 1000 for r in done if r.ttft_s is not None]
        )
        n = len(values_ms)
        fractions = [(n - i) / n if per_token else (i + 1) / n for i in range(n)]
        cdf_axis.plot(values_ms, fractions, label=arm.name)
        rates = [r.offered_rate_per_s for r in results]
        goodput_axis.plot(
            rates, [r.summary.goodput_requests_per_s for r in results], "o-", label=arm.name
        )
        metric = "itl_ms" if per_token else "ttft_ms"
        tail_axis.plot(
            rates, [getattr(r.summary, metric)[quantile] for r in results], "o-", label=arm.name
        )
    at = runs[experiment.arms[0].name][-1].label
    cdf_axis.set_xlabel("ms")
    cdf_axis.set_xscale("log")
    if per_token:
        cdf_axis.set_title(f"inter-token gaps above x, at {at}")
        cdf_axis.set_ylabel("fraction of gaps (log)")
        cdf_axis.set_yscale("log")
    else:
        cdf_axis.set_title(f"TTFT CDF at {at}")
        cdf_axis.set_ylabel("fraction of requests")
    goodput_axis.set_title("goodput (both SLOs met) vs offered rate")
    goodput_axis.set_ylabel("requests/s")
    tail_axis.set_title(f"{name} {quantile} vs offered rate")
    tail_axis.set_ylabel("ms")
    tail_axis.set_yscale("log")
    for axis in (goodput_axis, tail_axis):
        axis.set_xlabel("offered rate (requests/s)")
    for axis in (cdf_axis, goodput_axis, tail_axis):
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.comparisons.experiments", description=__doc__
    )
    parser.add_argument("experiment", choices=sorted(EXPERIMENTS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rates", help="offered requests/s, comma-separated (default per run)")
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of sending")
    parser.add_argument("--num-requests", type=int, default=1000, help="most requests per run")
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    parser.add_argument("--slo-itl-ms", type=float, default=None)
    parser.add_argument("--slo-itl-percentile", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine-flags",
        default="",
        help="engine flags for every worker of both arms, after the experiment's own",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="start nothing: judge the arms' results.json already under --out by these SLOs",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    experiment = EXPERIMENTS[args.experiment]
    cores = [str(c) for c in sorted(os.sched_getaffinity(0))[:2]]
    if len(cores) < 2 and not args.report_only:
        print("experiments need two CPU cores (one per worker)", file=sys.stderr)
        return 2
    spec = LoadSpec(
        workload=experiment.workload,
        rates=tuple(float(r) for r in args.rates.split(","))
        if args.rates
        else experiment.default_rates,
        num_requests=args.num_requests,
        duration_s=args.duration,
        slo_ttft_ms=args.slo_ttft_ms or experiment.default_slo_ttft_ms,
        slo_itl_ms=args.slo_itl_ms or experiment.default_slo_itl_ms,
        slo_itl_percentile=args.slo_itl_percentile or experiment.default_slo_itl_percentile,
        seed=args.seed,
    )
    engine_flags = [*experiment.engine_flags, *shlex.split(args.engine_flags)]
    engine = _engine_config(args.model, args.dtype, engine_flags)
    command = "python -m loadtest.comparisons.experiments " + shlex.join(argv)
    runs: dict[str, list[RunResult]] = {}
    for arm in experiment.arms:
        if args.report_only:
            config, runs[arm.name] = load_runs(args.out / arm.slug / "results.json", spec)
        else:
            runs[arm.name] = run_arm(arm, engine, experiment.workload, spec, cores)
            config = {
                "command": command,
                "target": arm.name,
                "workload": experiment.workload,
                "seed": spec.seed,
                "model": args.model,
                "burstiness": spec.burstiness,
            }
        write_reports(args.out / arm.slug, config, runs[arm.name])
    rows = compare(experiment, runs)
    markdown = comparison_markdown(experiment, command, spec, runs, rows)
    (args.out / "comparison.md").write_text(markdown)
    (args.out / "comparison.json").write_text(
        json.dumps({"command": command, "spec": _spec_json(spec), "targets": rows}, indent=1)
    )
    comparison_plot(experiment, runs, args.out / "comparison.png")
    print(markdown)
    return 0


def _spec_json(spec: LoadSpec) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in spec.__slots__}


def _engine_config(model: str, dtype: str, extra_flags: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_flags(parser, EngineConfig)
    flags = ["--model", model, "--dtype", dtype, "--num-threads", "1", *extra_flags]
    return from_args(EngineConfig, parser.parse_args(flags))


if __name__ == "__main__":
    sys.exit(main())
