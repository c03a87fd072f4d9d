"""The control plane at fleet size: the prefix index and one router's decision against 16 to
1,024 workers.

``python -m loadtest.bench.control_plane [--workers 16,64,256,512,1024]
[--max-candidates 0,32] [--match-in redis,replica] [--blocks-per-worker 1024] [--out DIR]``

For each fleet size, against one real ``redis-server`` (emptied between sizes), two processes:

- **the fleet**: one ``KVEventPublisher`` per simulated worker (the workers' own code: its
  heartbeat, its first republication, its event batches, each on its own Redis connection).
  Every worker's cache holds ``--systems-per-worker`` of ``--system-prompts`` shared system
  prompts (``--system-blocks`` blocks each) and private blocks up to ``--blocks-per-worker``.
- **the router**: ``PrefillChooser.choose`` on a pool of the fleet's workers (healthy and
  idle as the router's polls would report them; never called) over a ``RedisPrefillLedger``,
  as a router decides a prefill: hash the prompt, the Lua match-score-reserve (with more workers
  than ``--prefill-max-candidates``, first the match alone, then a sample), the Python scoring
  of its reply; each reservation released afterwards, as the router does. Once per value of
  ``--max-candidates`` (0: every worker is scored, as before that flag) and of ``--match-in``
  (``replica``: the router matches in its ``PrefixIndexReplica``, and every writer of the index,
  the fleet's publishers included, appends to its change stream of ``--kv-event-stream-len``
  entries). A prompt is one of the system prompts plus ``--user-blocks`` blocks of its own.

Reported per fleet size:

- **index memory** per cached block (a hash held by at least one worker) and per entry (a
  block held by one worker): Redis's ``used_memory`` less its clients' buffers and the
  change stream, against the empty server; the stream's memory after the fleet's first
  publication; the replica's (the router's RSS growth over its first snapshot, per entry);
- **decisions** one at a time (p50, p99) and ``--in-flight`` at a time (decisions per second,
  and the share of them over the router's 50 ms wait for Redis, which it takes on load alone),
  the router process's CPU per decision, and per decision the Redis commands, bytes in and
  out, and Redis CPU (the fleet's idle heartbeats measured alone and subtracted);
- **KV-event ingest** while the router decides ``--ingest-decision-rate`` times a second, one
  at a time: the fleet submits
  ``--event-rate`` ``BlockStored`` events a second (``--event-blocks`` new blocks each, spread
  over its workers) for ``--ingest-s``; the lag is from an event's submission to its
  publisher's index write returning; the decisions' p99 during it is reported beside.

The fleet, the router and Redis share this machine's cores, which no deployment does: the
publishers heartbeat with ``--heartbeat-ttl-s`` (30 s; the workers' default is 3 s) so that
the router's flat-out phase does not starve them into lapses, and every republication after
the first (a lapse) is counted; their 30 s reconciliation is off, so that the idle window
measured for the per-decision Redis figures holds only heartbeats.

Prints a Markdown table and writes ``control_plane.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

import psutil
import redis
import redis.asyncio
from prometheus_client import REGISTRY

from engine.block_hash import BlockHash, hash_block_tokens
from engine.block_pool import BlockStored, KVCacheEvent, KVMedium
from loadtest.fixtures.redis_server import RedisServer
from services.common.kv_event_stream import stream_key
from services.common.prefix_index import RedisPrefixIndex
from services.common.roles import Role
from services.router.prefill_choice import PrefillChooser
from services.router.prefill_cost import PrefillWeights
from services.router.prefix_replica import PrefixIndexReplica
from services.router.redis_prefill_ledger import RedisPrefillLedger
from services.router.worker_pool import WorkerHandle, WorkerPool
from services.worker.kv_events import KVEventPublisher
from splitserve.v1 import worker_pb2

BLOCK_SIZE = 16
_VOCAB = 32_000
_IDLE_S = 2.0


@dataclass(frozen=True, slots=True)
class Fleet:
    """The simulated fleet's caches, a function of the arguments and the fleet size only (the
    fleet's process and the router's build the same one)."""

    worker_ids: list[str]
    caches: list[list[BlockHash]]
    system_prompts: list[list[int]]

    @classmethod
    def make(cls, num_workers: int, args: argparse.Namespace) -> Fleet:
        rng = random.Random(args.seed)
        tokens = args.system_blocks * BLOCK_SIZE
        system_prompts = [
            [rng.randrange(_VOCAB) for _ in range(tokens)] for _ in range(args.system_prompts)
        ]
        system_hashes = [hash_block_tokens(p, BLOCK_SIZE) for p in system_prompts]
        caches = []
        for _ in range(num_workers):
            chosen = rng.sample(range(args.system_prompts), args.systems_per_worker)
            cache = [h for s in chosen for h in system_hashes[s]]
            cache += [rng.randbytes(32) for _ in range(args.blocks_per_worker - len(cache))]
            caches.append(cache)
        worker_ids = [f"prefill-{i:04d}" for i in range(num_workers)]
        return cls(worker_ids, caches, system_prompts)

    @property
    def num_entries(self) -> int:
        return sum(len(c) for c in self.caches)

    @property
    def num_blocks(self) -> int:
        return len({h for c in self.caches for h in c})


@dataclass(frozen=True, slots=True)
class SizeResult:
    """One fleet size's figures (see the module's docstring)."""

    workers: int
    max_candidates: int
    # Where the router matched prompts: "redis" (the index's Lua walk) or "replica" (its own
    # copy, following the index's change stream).
    match_in: str
    cached_blocks: int
    entries: int
    index_bytes_per_block: float
    index_bytes_per_entry: float
    # The change stream's memory in Redis after the fleet's first publication (0: no stream).
    stream_mib: float
    # The router's replica: its process's RSS growth over the first snapshot, per entry.
    replica_bytes_per_entry: float
    decision_p50_ms: float
    decision_p99_ms: float
    decisions_per_s: float
    # Decisions over the router's 50 ms Redis wait (queued behind the others in flight),
    # which it then takes on load alone.
    decisions_on_load_alone: float
    router_cpu_us_per_decision: float
    redis_commands_per_decision: float
    redis_bytes_in_per_decision: float
    redis_bytes_out_per_decision: float
    redis_cpu_us_per_decision: float
    ingest_events_per_s: float
    ingest_lag_p50_ms: float
    ingest_lag_p99_ms: float
    decision_p99_ms_during_ingest: float
    republications: int  # full republications after the first: heartbeats that lapsed


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else float("nan")


class _LagRecordingIndex(RedisPrefixIndex):
    """The publisher's index, recording each event's lag from ``submitted_s`` to its write."""

    def __init__(
        self,
        client: Any,
        submitted_s: dict[int, float],
        lags_s: list[float],
        stream_max_len: int,
    ) -> None:
        super().__init__(client, stream_max_len=stream_max_len)
        self._submitted_s = submitted_s
        self._lags_s = lags_s

    async def apply(self, worker_id: str, events: Sequence[KVCacheEvent]) -> None:
        await super().apply(worker_id, events)
        now_s = time.perf_counter()
        for event in events:
            submitted_s = self._submitted_s.pop(id(event), None)
            if submitted_s is not None:
                self._lags_s.append(now_s - submitted_s)


def run_fleet(url: str, num_workers: int, args: argparse.Namespace, conn: Connection) -> None:
    """The fleet's process: publish every cache, say "ready", then on "ingest" submit events
    for ``args.ingest_s`` and send back the lags and the rate achieved; exits on "stop"."""
    asyncio.run(_fleet(url, num_workers, args, conn))


async def _fleet(url: str, num_workers: int, args: argparse.Namespace, conn: Connection) -> None:
    fleet = Fleet.make(num_workers, args)
    submitted_s: dict[int, float] = {}
    lags_s: list[float] = []
    publishers = []
    for worker_id, cache in zip(fleet.worker_ids, fleet.caches, strict=True):

        async def snapshot(cache: list[BlockHash] = cache) -> dict[BlockHash, KVMedium]:
            return dict.fromkeys(cache, KVMedium.CACHE)

        index = _LagRecordingIndex(
            redis.asyncio.Redis.from_url(url), submitted_s, lags_s, _stream_len(args)
        )
        publishers.append(
            KVEventPublisher(
                index, worker_id, snapshot, args.heartbeat_ttl_s, reconcile_interval_s=1e9
            )
        )
    for publisher in publishers:
        publisher.start()
    parent = multiprocessing.parent_process()
    while any(p.num_republished == 0 for p in publishers):
        if parent is not None and not parent.is_alive():
            return
        await asyncio.sleep(0.05)
    conn.send("ready")
    loop = asyncio.get_running_loop()
    while await loop.run_in_executor(None, conn.recv) != "stop":
        lags_s.clear()
        rng = random.Random(args.seed + 1)
        interval_s = 1.0 / args.event_rate
        start_s = time.perf_counter()
        sent = 0
        while (now_s := time.perf_counter()) - start_s < args.ingest_s:
            due = int((now_s - start_s) / interval_s) + 1
            for _ in range(due - sent):
                event = BlockStored(
                    tuple(rng.randbytes(32) for _ in range(args.event_blocks)), None, BLOCK_SIZE
                )
                submitted_s[id(event)] = time.perf_counter()
                rng.choice(publishers).submit([event])
            sent = due
            await asyncio.sleep(interval_s)
        while submitted_s and time.perf_counter() - start_s < args.ingest_s + 10:
            await asyncio.sleep(0.01)
        republished = sum(p.num_republished for p in publishers) - len(publishers)
        conn.send((list(lags_s), sent / (time.perf_counter() - start_s), republished))


class _Router:
    """One router's prefill decisions over the fleet: ``PrefillChooser.choose`` on a pool of
    the fleet's workers (healthy, idle, never called), each reservation released after."""

    def __init__(
        self,
        url: str,
        fleet: Fleet,
        max_candidates: int,
        match_in: str,
        args: argparse.Namespace,
    ) -> None:
        pool = WorkerPool(Role.PREFILL, ())
        pool.workers = [_handle(worker_id) for worker_id in fleet.worker_ids]
        rng = random.Random(args.seed + 2)
        stream_len = _stream_len(args)
        self.replica = (
            PrefixIndexReplica(redis.asyncio.Redis.from_url(url)) if match_in == "replica" else None
        )
        self.chooser = PrefillChooser(
            pool,
            RedisPrefillLedger(
                redis.asyncio.Redis.from_url(url), "r0", 30.0, stream_max_len=stream_len
            ),
            local_index=None,
            weights=PrefillWeights(load_bound=2.0, load_bound_slack=8),
            router_id="r0",
            rng=rng,
            max_candidates=max_candidates,
            replica=self.replica,
        )
        self.prompts = [
            rng.choice(fleet.system_prompts)
            + [rng.randrange(_VOCAB) for _ in range(args.user_blocks * BLOCK_SIZE)]
            for _ in range(256)
        ]
        self.count = 0

    async def start(self) -> None:
        """Start the chooser; with a replica, wait for its first snapshot."""
        self.chooser.start()
        while self.replica is not None and not self.replica.ready:
            await asyncio.sleep(0.01)

    async def decide(self) -> None:
        """One decision, timed from the prompt's tokens; its reservation released after."""
        self.count += 1
        prompt = self.prompts[self.count % len(self.prompts)]
        choice = await self.chooser.choose(f"d{self.count}", hash_block_tokens(prompt, BLOCK_SIZE))
        assert choice.worker is not None, "no prefill worker chosen"
        if choice.reservation is not None:
            await choice.ledger.release(choice.reservation)

    async def latencies_s(self, num: int) -> list[float]:
        latencies_s = []
        for _ in range(num):
            start_s = time.perf_counter()
            await self.decide()
            latencies_s.append(time.perf_counter() - start_s)
        return latencies_s

    async def throughput(self, in_flight: int, duration_s: float) -> tuple[int, float, float]:
        """(decisions, wall seconds, this process's CPU seconds) with ``in_flight`` at once."""
        deadline_s = time.perf_counter() + duration_s
        done = 0

        async def loop() -> None:
            nonlocal done
            while time.perf_counter() < deadline_s:
                await self.decide()
                done += 1

        start_s, start_cpu_s = time.perf_counter(), time.process_time()
        await asyncio.gather(*(loop() for _ in range(in_flight)))
        return done, time.perf_counter() - start_s, time.process_time() - start_cpu_s


def _stream_len(args: argparse.Namespace) -> int:
    """The index's change stream length: on (for every writer) when a router matches in a
    replica."""
    return args.kv_event_stream_len if "replica" in args.match_in.split(",") else 0


def _handle(worker_id: str) -> WorkerHandle:
    info = worker_pb2.WorkerInfo(
        worker_id=worker_id, served_model_name="bench", block_size=BLOCK_SIZE
    )
    return WorkerHandle(worker_id, Role.PREFILL, cast(Any, None), None, healthy=True, info=info)


def _load_alone_count() -> float:
    """The router's decisions so far that Redis did not answer in time (its metric)."""
    return REGISTRY.get_sample_value("splitserve_router_prefix_index_errors_total") or 0.0


def _redis_counters(client: redis.Redis) -> dict[str, float]:
    info = client.info("all")
    commands = sum(v["calls"] for k, v in info.items() if k.startswith("cmdstat_"))
    return {
        "commands": commands,
        "bytes_in": info["total_net_input_bytes"],
        "bytes_out": info["total_net_output_bytes"],
        "cpu_s": info["used_cpu_user"] + info["used_cpu_sys"],
        "memory": info["used_memory"] - info["mem_clients_normal"],
    }


def _rates(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    return {k: (after[k] - before[k]) / seconds for k in before}


async def measure_size(url: str, num_workers: int, args: argparse.Namespace) -> list[SizeResult]:
    """Start the fleet, fill the index, measure each ``--max-candidates``, stop the fleet;
    the server is left empty."""
    client = redis.Redis.from_url(url)
    client.flushall()
    empty = _redis_counters(client)
    fleet = Fleet.make(num_workers, args)
    ours, theirs = multiprocessing.get_context("spawn").Pipe()
    process = multiprocessing.get_context("spawn").Process(
        target=run_fleet, args=(url, num_workers, args, theirs), daemon=True
    )
    process.start()
    loop = asyncio.get_running_loop()
    results = []
    try:
        ready = await loop.run_in_executor(None, ours.recv)
        assert ready == "ready", ready
        stream_bytes = client.memory_usage(stream_key("splitserve:")) or 0
        index_bytes = _redis_counters(client)["memory"] - empty["memory"] - stream_bytes
        for max_candidates in (int(k) for k in args.max_candidates.split(",")):
            for match_in in args.match_in.split(","):
                router = _Router(url, fleet, max_candidates, match_in, args)
                rss_before = psutil.Process().memory_info().rss
                await router.start()
                replica_bytes = 0
                if router.replica is not None:
                    replica_bytes = psutil.Process().memory_info().rss - rss_before
                figures = await _measure_router(router, client, ours, args)
                await router.chooser.close()
                results.append(
                    SizeResult(
                        workers=num_workers,
                        max_candidates=max_candidates,
                        match_in=match_in,
                        cached_blocks=fleet.num_blocks,
                        entries=fleet.num_entries,
                        index_bytes_per_block=index_bytes / fleet.num_blocks,
                        index_bytes_per_entry=index_bytes / fleet.num_entries,
                        stream_mib=stream_bytes / 2**20,
                        replica_bytes_per_entry=replica_bytes / fleet.num_entries,
                        **figures,
                    )
                )
        ours.send("stop")
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
        client.flushall()
    return results


async def _measure_router(
    router: _Router, client: redis.Redis, fleet: Connection, args: argparse.Namespace
) -> dict[str, Any]:
    """The decisions' figures of ``SizeResult``, and the ingest's while the router decides."""
    loop = asyncio.get_running_loop()
    await router.latencies_s(100)  # the connection, the script cache
    gc.freeze()
    idle_before = _redis_counters(client)
    await asyncio.sleep(_IDLE_S)
    idle = _rates(idle_before, _redis_counters(client), _IDLE_S)
    latencies_s = await router.latencies_s(args.decisions)
    before = _redis_counters(client)
    timeouts_before = _load_alone_count()
    done, wall_s, cpu_s = await router.throughput(args.in_flight, args.duration_s)
    timed_out = _load_alone_count() - timeouts_before
    busy = _rates(before, _redis_counters(client), wall_s)
    per_decision = {k: (busy[k] - idle[k]) * wall_s / done for k in busy}
    fleet.send("ingest")
    reply = loop.run_in_executor(None, fleet.recv)
    during: list[float] = []
    while not reply.done():
        during += await router.latencies_s(1)
        await asyncio.sleep(1.0 / args.ingest_decision_rate)
    lags_s, events_per_s, republished = await reply
    return {
        "decision_p50_ms": percentile(latencies_s, 0.5) * 1e3,
        "decision_p99_ms": percentile(latencies_s, 0.99) * 1e3,
        "decisions_per_s": done / wall_s,
        "decisions_on_load_alone": timed_out / done,
        "router_cpu_us_per_decision": cpu_s / done * 1e6,
        "redis_commands_per_decision": per_decision["commands"],
        "redis_bytes_in_per_decision": per_decision["bytes_in"],
        "redis_bytes_out_per_decision": per_decision["bytes_out"],
        "redis_cpu_us_per_decision": per_decision["cpu_s"] * 1e6,
        "ingest_events_per_s": events_per_s,
        "ingest_lag_p50_ms": percentile(lags_s, 0.5) * 1e3,
        "ingest_lag_p99_ms": percentile(lags_s, 0.99) * 1e3,
        "decision_p99_ms_during_ingest": percentile(during, 0.99) * 1e3,
        "republications": republished,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="16,64,256,512,1024")
    parser.add_argument(
        "--max-candidates", default="0,32", help="the router's --prefill-max-candidates values"
    )
    parser.add_argument(
        "--match-in",
        default="redis,replica",
        help="where the router matches prompts: redis (the index's Lua walk), replica (its own "
        "copy, following the index's change stream)",
    )
    parser.add_argument(
        "--kv-event-stream-len",
        type=int,
        default=100_000,
        help="the change stream's length (--redis-kv-event-stream-len) when a replica is measured",
    )
    parser.add_argument("--blocks-per-worker", type=int, default=1024)
    parser.add_argument("--system-prompts", type=int, default=64)
    parser.add_argument("--system-blocks", type=int, default=64)
    parser.add_argument("--systems-per-worker", type=int, default=4)
    parser.add_argument("--user-blocks", type=int, default=4)
    parser.add_argument("--decisions", type=int, default=1000)
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--event-rate", type=float, default=1000.0, help="events/s, all workers")
    parser.add_argument("--event-blocks", type=int, default=8)
    parser.add_argument("--ingest-s", type=float, default=5.0)
    parser.add_argument(
        "--ingest-decision-rate", type=float, default=100.0, help="decisions/s during the ingest"
    )
    parser.add_argument(
        "--heartbeat-ttl-s",
        type=float,
        default=30.0,
        help="the publishers' (workers' default: 3 s; longer here, see the docstring)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench-out/control_plane"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as work_dir:
        server = RedisServer(Path(work_dir))
        server.start()
        try:
            for num_workers in (int(w) for w in args.workers.split(",")):
                for result in asyncio.run(measure_size(server.url, num_workers, args)):
                    print(json.dumps(asdict(result)), flush=True)
                    results.append(result)
        finally:
            server.stop()
    args_json = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    (args.out / "control_plane.json").write_text(
        json.dumps({"args": args_json, "sizes": [asdict(r) for r in results]}, indent=2)
    )
    print_report(results)


def print_report(results: Sequence[SizeResult]) -> None:
    print(
        "| workers | max candidates | match in | cached blocks | index B/block | B/entry "
        "| stream MiB | replica B/entry | decision p50 ms | p99 ms "
        "| decisions/s | on load alone | router CPU µs/decision | Redis cmds/decision "
        "| Redis B in/out "
        "| Redis CPU µs/decision | events/s | ingest lag p50/p99 ms | decision p99 ms in ingest |"
    )
    print("|" + "---:|" * 19)
    for r in results:
        print(
            f"| {r.workers} | {r.max_candidates} | {r.match_in} | {r.cached_blocks:,} | "
            f"{r.index_bytes_per_block:.0f} | {r.index_bytes_per_entry:.0f} | "
            f"{r.stream_mib:.1f} | {r.replica_bytes_per_entry:.0f} | "
            f"{r.decision_p50_ms:.2f} | {r.decision_p99_ms:.2f} | "
            f"{r.decisions_per_s:,.0f} | {r.decisions_on_load_alone:.0%} | "
            f"{r.router_cpu_us_per_decision:.0f} | "
            f"{r.redis_commands_per_decision:.1f} | {r.redis_bytes_in_per_decision:,.0f} / "
            f"{r.redis_bytes_out_per_decision:,.0f} | {r.redis_cpu_us_per_decision:.0f} | "
            f"{r.ingest_events_per_s:,.0f} | {r.ingest_lag_p50_ms:.1f} / "
            f"{r.ingest_lag_p99_ms:.1f} | {r.decision_p99_ms_during_ingest:.2f} |"
        )


if __name__ == "__main__":
    main()
