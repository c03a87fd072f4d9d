"""``python -m loadtest.chaos``: a cluster under a fixed mixed load, one fault at a time.

Starts Redis and a ``--no-ray`` cluster (2 routers, 2 prefill, 2 decode workers), computes each
prompt's greedy tokens offline, then runs one phase per fault (``chaos_faults.FAULTS``): the
same load (half of it through each router) is sent, the fault is injected once it is under way,
and every request is classified: completed token-exact, completed but different, failed with a
clear status (by code), lost (ended with neither a finish reason nor a status) or hung (still
open at the client's deadline). Between phases the cluster recovers (the launcher restarts dead
workers; stopped processes are continued; a killed router is started again) and must serve
again with every worker healthy: an engine dead for good fails the run. Peak RSS per process is
sampled throughout.

With ``--hosts`` every process (and Redis) runs on a test host of its own
(``loadtest.fixtures.netns_hosts``: network namespaces, root only), KV moves over ``--kv-transfer``
between them, and the network faults join the phases: a host's link cut (decode, prefill,
Redis), the router cut from one decode host only, a whole decode host lost.

With ``--hostile`` it runs another mode instead: one router and one worker of each role under a
well-behaved HTTP load, first alone, then beside hostile HTTP clients (``loadtest.chaos.hostile``).

The default model is a tiny random Llama built offline (``--model`` takes any other); the
report is a Markdown table on stdout, and JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from engine import LLM, EngineConfig, SamplingParams
from loadtest.bench.peak_rss import PeakRss, cluster_pids
from loadtest.chaos import hostile
from loadtest.chaos.faults import FAULTS, Fault, PhaseResult, Target
from loadtest.fixtures import netns_hosts
from loadtest.fixtures.netns_hosts import UCX_ACROSS_HOSTS, HostNetwork
from loadtest.fixtures.redis_server import RedisServer
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.roles import Role
from services.launcher import LocalCluster, Placement
from services.service_process import ProcessState, ServiceProcess, wait_healthy
from splitserve.v1 import router_pb2, router_pb2_grpc

logger = logging.getLogger(__name__)

_MAX_TOKENS = 200
_MAX_MODEL_LEN = 1024
_DEADLINE_S = 120.0  # a request still open after this is hung
_RECOVER_TIMEOUT_S = 180.0
STREAM_IDLE_TIMEOUT_S = 3.0


class ChaosCluster:
    """The cluster under test and what the faults need to reach its processes."""

    def __init__(
        self,
        local: LocalCluster,
        redis: RedisServer,
        max_model_len: int,
        network: HostNetwork | None = None,
    ) -> None:
        self.local = local
        self.redis = redis
        self.network = network
        self.max_model_len = max_model_len
        self.stream_idle_timeout_s = STREAM_IDLE_TIMEOUT_S
        self._channels = [
            grpc.insecure_channel(r.address, options=CHANNEL_OPTIONS)
            for r in local.workers("router")
        ]
        self.rss = PeakRss(lambda: cluster_pids(local))

    def victim(self, target: Target) -> ServiceProcess:
        """The process a fault on ``target`` hits: always the last one of its role."""
        return self.local.workers(target.value)[-1]

    def victim_host(self, target: Target) -> str:
        """The test host of ``victim(target)`` (``--hosts`` only)."""
        return host_name(Role(target.value), len(self.local.workers(target.value)) - 1)

    def channel(self, router: int) -> grpc.Channel:
        return self._channels[router]

    def stub(self, router: int) -> router_pb2_grpc.RouterStub:
        return router_pb2_grpc.RouterStub(self._channels[router])

    def restart_router(self, process: ServiceProcess) -> None:
        self.local.restart(process)
        wait_healthy(process, time.monotonic() + _RECOVER_TIMEOUT_S)

    def recover(self) -> None:
        """Wait until every process serves again (the launcher restarting the workers that
        exited) and both routers see every worker healthy; raise if that does not happen."""
        deadline_s = time.monotonic() + _RECOVER_TIMEOUT_S
        while True:
            for failure in self.local.supervise():
                logger.info("%s %s: %s", failure.role, failure.worker, failure.error)
            exited = [p for p in self.local.processes if p.state is ProcessState.EXITED]
            if exited:
                raise RuntimeError(f"dead for good: {[p.address for p in exited]}")
            if self.local.serving() and all(self._all_healthy(i) for i in range(2)):
                return
            if time.monotonic() > deadline_s:
                raise RuntimeError("the cluster did not recover")
            time.sleep(0.5)

    def _all_healthy(self, router: int) -> bool:
        try:
            status = self.stub(router).Status(router_pb2.StatusRequest(), timeout=10)
        except grpc.RpcError:
            return False
        return all(w.healthy for w in status.workers)

    def close(self) -> None:
        self.rss.close()
        for channel in self._channels:
            channel.close()


@dataclasses.dataclass(frozen=True, slots=True)
class Load:
    """The fixed mixed load: prompts of many lengths and their reference greedy tokens."""

    prompts: list[list[int]]
    want: list[list[int]]


def host_name(role: Role, index: int) -> str:
    """The test host of the ``index``-th process of ``role`` under ``--hosts``."""
    return f"{role.value}{index}"


def make_load(engine: EngineConfig, num_requests: int, seed: int) -> Load:
    """``num_requests`` prompts of 8 to 300 tokens and their greedy tokens, computed offline."""
    llm = LLM(engine.model, dtype=engine.dtype, max_model_len=engine.max_model_len)
    vocab_size = llm.engine.vocab_size
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, vocab_size) for _ in range(rng.choice((8, 40, 120, 300)))]
        for _ in range(num_requests)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=_MAX_TOKENS, ignore_eos=True)
    return Load(prompts, [o.token_ids for o in llm.generate(prompts, params)])


def run_phase(cluster: ChaosCluster, load: Load, fault: Fault) -> PhaseResult:
    """Send the load, inject ``fault`` once a quarter of it streams, classify every request."""
    result = PhaseResult(fault.name, notes=fault.notes)
    first_tokens = threading.Semaphore(0)

    def send(i: int) -> tuple[str, list[int]]:
        request = router_pb2.GenerateRequest(
            token_ids=load.prompts[i],
            sampling=router_pb2.SamplingParams(
                max_tokens=_MAX_TOKENS, temperature=0.0, ignore_eos=True
            ),
        )
        tokens: list[int] = []
        finished = False
        try:
            for message in cluster.stub(i % 2).Generate(request, timeout=_DEADLINE_S):
                if not tokens and message.token_ids:
                    first_tokens.release()
                tokens.extend(message.token_ids)
                finished = finished or bool(message.finish_reason)
        except grpc.RpcError as exc:
            return exc.code().name, tokens
        return ("finished" if finished else "lost"), tokens

    num = len(load.prompts)
    start_s = time.monotonic()
    with ThreadPoolExecutor(max_workers=num + 1) as pool:
        futures = [pool.submit(send, i) for i in range(num)]
        side = pool.submit(fault.side_load, cluster) if fault.side_load else None
        for _ in range(max(num // 4, 1)):
            first_tokens.acquire(timeout=_DEADLINE_S)
        fault.inject(cluster)
        outcomes = [f.result() for f in futures]
        side_statuses = side.result() if side is not None else []
    result.sent = num
    for (outcome, tokens), want in zip(outcomes, load.want, strict=True):
        if outcome == "finished":
            if tokens == want:
                result.exact += 1
            else:
                result.wrong += 1
        elif outcome == "lost":
            result.lost += 1
        elif outcome == grpc.StatusCode.DEADLINE_EXCEEDED.name:
            result.hung += 1
        else:
            result.failed[outcome] = result.failed.get(outcome, 0) + 1
    for status in side_statuses:
        result.side[status] = result.side.get(status, 0) + 1
    result.load_s = time.monotonic() - start_s
    fault.recover(cluster)
    cluster.recover()
    result.recover_s = time.monotonic() - start_s - result.load_s
    return result


def report(results: list[PhaseResult], peak_rss_bytes: dict[str, int]) -> str:
    lines = [
        "| fault | sent | token-exact | wrong | failed (status) | lost | hung | fault's own "
        "requests | load s | recovery s |",
        "|---|---:|---:|---:|---|---:|---:|---|---:|---:|",
    ]
    for r in results:
        failed = ", ".join(f"{n} {code}" for code, n in sorted(r.failed.items())) or "0"
        side = ", ".join(f"{n} {code}" for code, n in sorted(r.side.items())) or "-"
        lines.append(
            f"| {r.fault} | {r.sent} | {r.exact} | {r.wrong} | {failed} | {r.lost} | {r.hung} "
            f"| {side} | {r.load_s:.1f} | {r.recover_s:.1f} |"
        )
    lines += ["", "| process | peak RSS (MiB) |", "|---|---:|"]
    lines += [f"| {k} | {v / 2**20:.0f} |" for k, v in sorted(peak_rss_bytes.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.chaos", description=__doc__)
    parser.add_argument("--model", help="model directory or name (default: a tiny random Llama)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-requests", type=int, default=16, help="requests per phase")
    parser.add_argument(
        "--faults", help="comma-separated (default: every fault this mode can inject)"
    )
    parser.add_argument(
        "--hosts",
        action="store_true",
        help="each process on a test host of its own (root), adding the network faults",
    )
    parser.add_argument(
        "--kv-transfer", default="tcp", help="the workers' KV transfer backend (tcp, nixl, ucx)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    hostile.add_flags(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.hostile:
        hostile.check_flags(parser, args)
        return hostile.main(args)
    known = [f.name for f in FAULTS if args.hosts or not f.needs_hosts]
    chosen = [f.strip() for f in (args.faults or ",".join(known)).split(",") if f.strip()]
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        parser.error(f"--faults: unknown {unknown}; known here: {', '.join(known)}")
    if args.hosts and (reason := netns_hosts.available()) is not None:
        parser.error(f"--hosts: {reason}")
    with tempfile.TemporaryDirectory(prefix="splitserve-chaos-") as work_dir:
        model = args.model
        if model is None:
            from loadtest.fixtures.tiny_model import make_tiny_llama

            model = str(make_tiny_llama(Path(work_dir) / "tiny", vocab_size=2048))
        results, peak_rss = _run(model, args, chosen, Path(work_dir))
    print(report(results, peak_rss))
    if args.out is not None:
        args.out.write_text(
            json.dumps(
                {
                    "hosts": args.hosts,
                    "kv_transfer": args.kv_transfer,
                    "phases": [dataclasses.asdict(r) for r in results],
                    "peak_rss_bytes": peak_rss,
                },
                indent=2,
            )
        )
    bad = [r.fault for r in results if r.lost or r.hung or r.wrong]
    if bad:
        print(f"loadtest.chaos: lost, hung or wrong requests under: {bad}", file=sys.stderr)
        return 1
    return 0


_REDIS_PASSWORD = "chaos"  # Redis refuses clients off loopback without one
_NUM = {Role.PREFILL: 2, Role.DECODE: 2, Role.ROUTER: 2}


def _run(
    model: str, args: argparse.Namespace, faults: list[str], work_dir: Path
) -> tuple[list[PhaseResult], dict[str, int]]:
    engine = EngineConfig(
        model=model, dtype=args.dtype, max_model_len=_MAX_MODEL_LEN, num_kv_blocks=256
    )
    load = make_load(engine, args.num_requests, args.seed)
    network = placement = None
    redis_host, redis_prefix = "127.0.0.1", ()
    if args.hosts:
        os.environ.update(UCX_ACROSS_HOSTS)  # for this run's processes, restarts included
        names = [host_name(role, i) for role, n in _NUM.items() for i in range(n)]
        network = HostNetwork([*names, "redis"]).create()
        redis_host, redis_prefix = network["redis"].address, tuple(network.argv("redis", []))

        def placement(role: Role, index: int) -> Placement:
            return network.placement(host_name(role, index))

    redis = RedisServer(work_dir, _REDIS_PASSWORD, host=redis_host, argv_prefix=redis_prefix)
    redis_flags = ("--redis-url", redis.url, "--redis-password", _REDIS_PASSWORD)
    local = LocalCluster(
        engine=engine,
        num_prefill=_NUM[Role.PREFILL],
        num_decode=_NUM[Role.DECODE],
        num_routers=_NUM[Role.ROUTER],
        placement=placement,
        extra_worker_flags=(
            *redis_flags,
            "--kv-transfer", args.kv_transfer,
            "--heartbeat-ttl-s", "1",
            "--shutdown-grace-s", "2",
            "--stream-idle-timeout-s", str(STREAM_IDLE_TIMEOUT_S),
        ),
        extra_router_flags=(*redis_flags, "--local-prefill-max-tokens", "0"),
    )  # fmt: skip
    cluster: ChaosCluster | None = None
    try:
        redis.start()
        local.start(timeout_s=_RECOVER_TIMEOUT_S)
        cluster = ChaosCluster(local, redis, _MAX_MODEL_LEN, network)
        results = []
        for fault in FAULTS:
            if fault.name in faults:
                logger.info("phase: %s", fault.name)
                results.append(run_phase(cluster, load, fault))
        return results, cluster.rss.peaks()
    finally:
        if cluster is not None:
            cluster.close()
        local.stop()
        redis.stop()
        if network is not None:
            network.remove()


if __name__ == "__main__":
    sys.exit(main())
