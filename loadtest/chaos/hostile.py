"""``python -m loadtest.chaos --hostile``: well-behaved load beside hostile HTTP clients.

Starts a ``--no-ray`` cluster of one router (its HTTP API on), one prefill and one decode
worker with the defaults a deployment gets, then runs two phases of ``--duration-s`` each:

1. ``baseline``: streamed chat requests over the HTTP API at ``--rate`` per second (fixed
   intervals, ``WELL_BEHAVED_MAX_TOKENS`` tokens each, greedy), each timed (TTFT, ITL) and
   checked to complete;
2. ``hostile``: the same load beside ``--hostile-connections`` hostile connections
   (``loadtest.chaos.hostile_clients``, in a process of its own so that it does not delay the
   well-behaved client's clock), spread over ``--hostile-kinds``, each reopened when it ends.

Each phase reports the processes' peak RSS, and each worker's step-time histogram read from
its ``/metrics`` before and after. The report and the targets: ``loadtest.chaos.hostile_report``.

The default model is a tiny random Llama with a 32k context, so that fan-outs of
``max_tokens`` 20000 are accepted as they would be by a long-context model; with ``--model``,
the hostile generations are capped to its context.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import enum
import json
import logging
import resource
import signal
import sys
import tempfile
import time
from pathlib import Path

from engine import EngineConfig
from loadtest.bench import step_histogram
from loadtest.bench.peak_rss import PeakRss, cluster_pids, cpu_seconds
from loadtest.chaos.hostile_clients import KindSummary
from loadtest.chaos.hostile_report import (
    Phase,
    PhaseName,
    Verdict,
    WellBehaved,
    markdown,
    targets,
)
from loadtest.chaos.hostile_requests import FANOUT_MAX_TOKENS, parse_kinds
from loadtest.fixtures.tiny_model import BENCH_SPEC, SENTENCES, make_tiny_model
from loadtest.generator.backends import Backend
from loadtest.generator.metrics import RequestRecord, summarize
from loadtest.generator.openai_http import ModelCard, OpenAIClient, wait_for_model
from loadtest.generator.runner import RunPlan, run
from loadtest.generator.synthetic import LoadRequest
from services.common.roles import Role
from services.launcher import LocalCluster
from services.startup import WaitMessages

logger = logging.getLogger(__name__)

WELL_BEHAVED_MAX_TOKENS = 64
_CONTEXT = 32768
_NUM_KV_BLOCKS = 2048  # 32k tokens of 16: one full-length sequence, or a few fan-outs
_REQUEST_TIMEOUT_S = 120.0  # a well-behaved request still open then has failed
_SLOWEST_SHOWN = 8  # the slowest first tokens the report lists, with when they were sent
_START_TIMEOUT_S = 300.0
_HOSTILE_READY_TIMEOUT_S = 120.0
_PROMPT_MARGIN = 64  # tokens left for the hostile prompts when capping to a model's context
# The clients' processes in the CPU table: they run on the cluster's cores.
_CLIENT = "loadtest (the well-behaved client)"
_HOSTILE_CLIENTS = "hostile clients"


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The hostile mode's flags on ``loadtest.chaos.matrix``'s parser."""
    group = parser.add_argument_group("hostile HTTP clients (--hostile)")
    group.add_argument(
        "--hostile",
        action="store_true",
        help="instead of the fault phases: a baseline load, then the same beside hostile "
        "HTTP clients, on 1 prefill + 1 decode worker",
    )
    group.add_argument(
        "--duration-s", type=float, default=300.0, help="each phase's length (default: %(default)s)"
    )
    group.add_argument(
        "--rate",
        type=float,
        default=2.0,
        help="well-behaved requests per second (default: %(default)s)",
    )
    group.add_argument("--hostile-connections", type=int, default=64, help="(default: %(default)s)")
    group.add_argument(
        "--hostile-kinds",
        help=f"comma-separated (default: all of {', '.join(k.value for k in parse_kinds(None))}; "
        "'reader' is the control for slow readers: the same tokens, read)",
    )
    group.add_argument(
        "--hostile-hold-s",
        type=float,
        default=120.0,
        help="longest a hostile connection stays open before it is reopened (default: %(default)s)",
    )
    group.add_argument(
        "--hostile-header-mb",
        type=float,
        default=64.0,
        help="the huge header's size (default: %(default)s)",
    )


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``parser.error`` for flags the hostile mode cannot honour."""
    if args.hosts or args.faults:
        parser.error("--hostile runs on this host without faults: drop --hosts and --faults")
    try:
        parse_kinds(args.hostile_kinds)
    except ValueError as exc:
        parser.error(f"--hostile-kinds: {exc}")
    if args.duration_s <= 0 or args.rate <= 0 or args.hostile_connections < 1:
        parser.error("--duration-s, --rate and --hostile-connections must be positive")


def main(args: argparse.Namespace) -> int:
    """Run both phases and print the report (JSON to ``--out``); 1 if a target fails."""
    with tempfile.TemporaryDirectory(prefix="splitserve-hostile-") as work_dir:
        model = args.model
        if model is None:
            spec = dataclasses.replace(
                BENCH_SPEC, vocab_size=2048, max_position_embeddings=_CONTEXT
            )
            model = str(make_tiny_model(Path(work_dir) / "tiny", "llama", args.seed, spec))
        engine = EngineConfig(model=model, dtype=args.dtype, num_kv_blocks=_NUM_KV_BLOCKS)
        cluster = LocalCluster(
            engine=engine, extra_worker_flags=("--kv-transfer", args.kv_transfer)
        )
        rss = PeakRss(lambda: cluster_pids(cluster))
        try:
            cluster.start(timeout_s=_START_TIMEOUT_S)
            phases = asyncio.run(_run_phases(cluster, rss, args))
        finally:
            rss.close()
            cluster.stop()
    results = targets(*phases)
    print(markdown(phases, results, args.rate))
    if args.out is not None:
        report = {
            "duration_s": args.duration_s,
            "rate": args.rate,
            "hostile_connections": args.hostile_connections,
            "phases": [dataclasses.asdict(p) for p in phases],
            "targets": [dataclasses.asdict(r) for r in results],
        }
        args.out.write_text(json.dumps(report, indent=2, default=_json_value))
    failed = [r.name for r in results if r.verdict is Verdict.FAIL]
    if failed:
        print(f"loadtest.chaos --hostile: targets missed: {failed}", file=sys.stderr)
        return 1
    return 0


def _json_value(value: object) -> object:
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"not JSON: {value!r}")


async def _run_phases(
    cluster: LocalCluster, rss: PeakRss, args: argparse.Namespace
) -> tuple[Phase, Phase]:
    messages = WaitMessages(sys.stderr)
    card = await wait_for_model(cluster.http_url, time.monotonic() + _START_TIMEOUT_S, messages)
    baseline = await _run_phase(PhaseName.BASELINE, cluster, card, rss, args)
    hostile = await _run_phase(PhaseName.HOSTILE, cluster, card, rss, args)
    return baseline, hostile


async def _run_phase(
    name: PhaseName,
    cluster: LocalCluster,
    card: ModelCard,
    rss: PeakRss,
    args: argparse.Namespace,
) -> Phase:
    logger.info("phase: %s (%.0f s)", name.value, args.duration_s)
    workers = _metrics_urls(cluster)
    before = await _scrape(workers)
    rss.reset()
    processes = cluster_pids(cluster)
    cpu_before = cpu_seconds(processes) | {_CLIENT: _own_cpu_seconds()}
    hostile_process = None
    if name is PhaseName.HOSTILE:
        hostile_process = await _start_hostile(cluster.http_url, card, args)
    start_s = time.monotonic()
    hostile_cpu: dict[str, float] = {}
    try:
        records = await _well_behaved(cluster.http_url, card, args)
    finally:
        hostile = None
        if hostile_process is not None:
            hostile_cpu = cpu_seconds({_HOSTILE_CLIENTS: hostile_process.pid})
            hostile = await _stop_hostile(hostile_process)
    duration_s = time.monotonic() - start_s
    peaks = rss.peaks()
    cpu_after = cpu_seconds(processes) | {_CLIENT: _own_cpu_seconds()}
    cpu = {k: cpu_after[k] - cpu_before[k] for k in cpu_after if k in cpu_before} | hostile_cpu
    engine_steps = {
        worker: [
            step_histogram.slow_steps(before[worker].get(name), buckets)
            for name, buckets in sorted(after.items())
        ]
        for worker, after in (await _scrape(workers)).items()
    }
    load = _well_behaved_summary(records)
    return Phase(name, duration_s, load, peaks, cpu, engine_steps, hostile)


def _own_cpu_seconds() -> float:
    """This process's CPU time alone (it is the cluster's parent: ``cpu_seconds`` would count
    the cluster too)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _scrape(workers: dict[str, str]) -> dict[str, dict[str, step_histogram.Buckets]]:
    """Each worker's step-time histograms (none for a worker whose ``/metrics`` does not
    answer: the report goes on without its steps)."""
    found = {}
    for worker, url in workers.items():
        try:
            found[worker] = await asyncio.to_thread(step_histogram.scrape, url)
        except OSError as exc:
            logger.warning("%s: %s", url, exc)
            found[worker] = {}
    return found


def _metrics_urls(cluster: LocalCluster) -> dict[str, str]:
    """Each worker's ``/metrics``, by ``role@address``."""
    return {
        f"{p.role}@{p.address}": f"http://{p.address.rsplit(':', 1)[0]}:{p.metrics_port}/metrics"
        for p in cluster.processes
        if p.role in (Role.PREFILL, Role.DECODE)
    }


async def _well_behaved(
    base_url: str, card: ModelCard, args: argparse.Namespace
) -> list[RequestRecord]:
    """``--rate`` streamed chat requests a second for ``--duration-s``, each prompt distinct."""
    num = int(args.duration_s * args.rate) + 1
    requests = [
        LoadRequest((), WELL_BEHAVED_MAX_TOKENS, "chat", f"{i}: {SENTENCES[i % 6]}")
        for i in range(num)
    ]
    plan = RunPlan(
        duration_s=args.duration_s,
        arrivals_s=tuple(i / args.rate for i in range(num)),
        timeout_s=_REQUEST_TIMEOUT_S,
    )
    client = OpenAIClient(Backend.OPENAI_CHAT, base_url, card.id)
    return await run(client, plan, requests, show_progress=False)


def _well_behaved_summary(records: list[RequestRecord]) -> WellBehaved:
    summary = summarize(records, None, None)
    gaps_s = [gap for r in records if r.ok for gap in r.itl_s()]
    return WellBehaved(
        sent=summary.num_sent,
        completed=summary.num_completed,
        errors=summary.errors,
        ttft_ms=summary.ttft_ms,
        itl_ms=summary.itl_ms,
        itl_max_ms=max(gaps_s, default=0.0) * 1000,
        slow_itl_gaps=sum(gap > step_histogram.SLOW_STEP_S for gap in gaps_s),
        slowest_ttft=_slowest_ttft(records),
    )


def _slowest_ttft(
    records: list[RequestRecord], num: int = _SLOWEST_SHOWN
) -> list[tuple[float, float]]:
    """The ``num`` slowest first tokens: (TTFT ms, when sent in s since the first request)."""
    if not records:
        return []
    start_s = min(r.sent_s for r in records)
    timed = [(r.ttft_s * 1000, r.sent_s - start_s) for r in records if r.ttft_s is not None]
    return sorted(timed, reverse=True)[:num]


async def _start_hostile(
    base_url: str, card: ModelCard, args: argparse.Namespace
) -> asyncio.subprocess.Process:
    """Start ``loadtest.chaos.hostile_clients`` and wait until each connection made its first
    try."""
    max_tokens = min(FANOUT_MAX_TOKENS, card.max_model_len - _PROMPT_MARGIN)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "loadtest.chaos.hostile_clients", "--url", base_url,
        "--connections", str(args.hostile_connections),
        "--max-tokens", str(max_tokens),
        "--header-mb", str(args.hostile_header_mb),
        "--hold-s", str(args.hostile_hold_s),
        *(("--kinds", args.hostile_kinds) if args.hostile_kinds else ()),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stdout is not None
    try:
        line = await asyncio.wait_for(process.stdout.readline(), _HOSTILE_READY_TIMEOUT_S)
    except TimeoutError:
        line = b""
    if line.strip() != b"ready":
        process.kill()
        await process.wait()
        raise RuntimeError(f"loadtest.chaos.hostile_clients did not start: {line!r}")
    return process


async def _stop_hostile(process: asyncio.subprocess.Process) -> dict[str, KindSummary]:
    """SIGTERM the hostile clients; how their attempts ended, by kind."""
    process.send_signal(signal.SIGTERM)
    out, _ = await process.communicate()
    return {kind: KindSummary(**summary) for kind, summary in json.loads(out).items()}
