"""Tenants under load: one tenant's flood against another's TTFT, and priority under overload.

``python -m loadtest.bench.tenants --model smollm2-135m [--duration-s 40] [--out DIR]`` starts
clusters with ``splitserve up``'s launcher (one prefill and one decode worker, each pinned to
half of the cores, API keys naming four tenants) and measures, with streamed
``/v1/completions`` requests (``--prompt-tokens`` random token ids, greedy, ``ignore_eos``)
timed by the client:

- **rate**: ``steady`` sends one request every ``--interval-s`` (``--max-tokens`` each) for
  ``--duration-s`` alone, then again beside ``flood``: ``--flood-clients`` closed-loop clients
  of its own prompts (``--flood-max-tokens`` each), limited to ``--flood-tokens-per-s``
  (``--tenant-limits``). Target: steady's TTFT p50 and p90 within 1.2x of their unloaded
  values, the flood refused (429) for what is over its rate.
- **priority**: the workers run ``--scheduling-policy priority`` (then ``fcfs``, for
  comparison) with ``--max-num-seqs`` ``--slots``; ``interactive`` (priority 0) sends as
  ``steady`` did, alone and then beside ``bulk`` (priority 10, ``--flood-clients`` closed-loop
  clients, unlimited: the workers are overloaded). Target: under ``priority`` interactive's
  TTFT p50 within 1.2x of its unloaded value, and its requests within the TTFT SLO
  (``--ttft-slo-ms``), while bulk queues.

Each phase reports the share of requests whose TTFT met ``--ttft-slo-ms`` (the paced tenant's
and the flood's).

Prints a Markdown table and writes ``tenants.json`` under ``--out``. Each run's prompts are its
own (a repeat would hit the prefix cache).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.flags import add_flags, from_args
from loadtest.generator.backends import Backend
from loadtest.generator.metrics import RequestRecord
from loadtest.generator.openai_http import OpenAIClient
from loadtest.generator.sweep import served_model
from loadtest.generator.synthetic import LoadRequest
from services.common.roles import Role
from services.launcher import LocalCluster

ADMIN_KEY = "bench-admin-key-0123456789abcdef"
TENANTS = ("steady", "flood", "interactive", "bulk")
_TIMEOUT_S = 600.0


def _key(tenant: str) -> str:
    return f"bench-{tenant}-key-0123456789abcdef"


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class Load:
    """Seeded prompts of the served vocabulary, never the same twice."""

    def __init__(self, vocab: Sequence[int], prompt_tokens: int, seed: int) -> None:
        self._vocab = list(vocab)
        self._prompt_tokens = prompt_tokens
        self._rng = random.Random(seed)

    def request(self, max_tokens: int) -> LoadRequest:
        prompt = tuple(self._rng.choices(self._vocab, k=self._prompt_tokens))
        return LoadRequest(prompt, max_tokens, "tenants")


async def _paced(client: OpenAIClient, load: Load, args: argparse.Namespace) -> list[RequestRecord]:
    """One request every ``--interval-s`` for ``--duration-s``, each awaited before the next."""
    records = []
    loop = asyncio.get_running_loop()
    end_s = loop.time() + args.duration_s
    while loop.time() < end_s:
        start_s = loop.time()
        records.append(await client.send(load.request(args.max_tokens), _TIMEOUT_S))
        await asyncio.sleep(max(0.0, args.interval_s - (loop.time() - start_s)))
    return records


async def _closed_loop(
    client: OpenAIClient, load: Load, max_tokens: int, stop: asyncio.Event
) -> list[RequestRecord]:
    records = []
    while not stop.is_set():
        record = await client.send(load.request(max_tokens), _TIMEOUT_S)
        records.append(record)
        if record.error is not None:  # refused: the client backs off as Retry-After asks
            await asyncio.sleep(1.0)
    return records


async def _phase(
    cluster: LocalCluster,
    model: str,
    vocab: Sequence[int],
    paced_tenant: str,
    flood_tenant: str | None,
    args: argparse.Namespace,
    seed: int,
) -> dict[str, Any]:
    """``paced_tenant``'s paced requests, beside ``flood_tenant``'s closed loops when given."""

    def client(tenant: str) -> OpenAIClient:
        return OpenAIClient(Backend.OPENAI_COMPLETIONS, cluster.http_url, model, _key(tenant))

    stop = asyncio.Event()
    async with contextlib.AsyncExitStack() as stack:
        paced = await stack.enter_async_context(client(paced_tenant))
        floods = []
        if flood_tenant is not None:
            flood = await stack.enter_async_context(client(flood_tenant))
            floods = [
                asyncio.create_task(
                    _closed_loop(
                        flood,
                        Load(vocab, args.prompt_tokens, seed * 100 + i),
                        args.flood_max_tokens,
                        stop,
                    )
                )
                for i in range(args.flood_clients)
            ]
        try:
            records = await _paced(paced, Load(vocab, args.prompt_tokens, seed), args)
        finally:
            stop.set()
            flooded = [record for task in floods for record in await task]
    ttfts_ms = [r.ttft_s * 1e3 for r in records if r.ok and r.ttft_s is not None]
    flood_ttfts_ms = [r.ttft_s * 1e3 for r in flooded if r.ok and r.ttft_s is not None]
    return {
        "ttft_p50_ms": statistics.median(ttfts_ms) if ttfts_ms else float("nan"),
        "ttft_p90_ms": _percentile(ttfts_ms, 0.9),
        "within_slo": _share_within(records, args.ttft_slo_ms),
        "flood_within_slo": _share_within(flooded, args.ttft_slo_ms) if flooded else None,
        "num_requests": len(records),
        "num_failed": sum(not r.ok for r in records),
        "flood_served": sum(r.ok for r in flooded),
        "flood_refused": sum(r.error == "HTTP 429" for r in flooded),
        "flood_ttft_p50_ms": statistics.median(flood_ttfts_ms) if flood_ttfts_ms else None,
    }


def _share_within(records: Sequence[RequestRecord], slo_ms: float) -> float:
    """The share of ``records`` served with a TTFT of at most ``slo_ms`` (a 429 is a miss)."""
    met = sum(r.ok and r.ttft_s is not None and r.ttft_s * 1e3 <= slo_ms for r in records)
    return met / len(records) if records else float("nan")


def _cluster(
    engine: EngineConfig, key_file: Path, limits: str, policy: str, slots: int
) -> LocalCluster:
    role_flags = ("--scheduling-policy", policy, "--max-num-seqs", str(slots))
    cores = os.cpu_count() or 1
    return LocalCluster(
        engine=engine,
        # Each worker on its own half of the cores (the router floats), as a fleet's pods are.
        worker_cpu_cores=(
            (f"0-{cores // 2 - 1}", f"{cores // 2}-{cores - 1}") if cores >= 2 else ()
        ),
        admin_api_key=ADMIN_KEY,
        extra_router_flags=("--api-key-file", str(key_file), "--tenant-limits", limits),
        extra_role_flags={Role.PREFILL: role_flags, Role.DECODE: role_flags},
    )


def _run_cluster(
    cluster: LocalCluster, phases: list[tuple[str, str, str | None]], args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    results = {}
    try:
        cluster.start()
        served = served_model(cluster.router_address, api_key=ADMIN_KEY)
        vocab = served.vocab
        # Warm-up: compiled paths, connections, the tokenizer's caches.
        asyncio.run(_phase(cluster, served.name, vocab, "steady", None, _short(args), 0))
        for seed, (name, paced, flood) in enumerate(phases, start=1):
            results[name] = asyncio.run(
                _phase(cluster, served.name, vocab, paced, flood, args, seed)
            )
            print(name, json.dumps(results[name]), flush=True)
    finally:
        cluster.stop()
    return results


def _short(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "duration_s": 3 * args.interval_s})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flags(parser, EngineConfig)
    parser.add_argument("--duration-s", type=float, default=40.0)
    parser.add_argument("--interval-s", type=float, default=1.0)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--flood-clients", type=int, default=16)
    parser.add_argument("--flood-max-tokens", type=int, default=64)
    parser.add_argument("--flood-tokens-per-s", type=float, default=50.0)
    parser.add_argument("--slots", type=int, default=4, help="--max-num-seqs of the workers")
    parser.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    parser.add_argument("--out", type=Path, default=Path("bench-out/tenants"))
    args = parser.parse_args()
    engine = dataclasses.replace(from_args(EngineConfig, args), detokenize=False)
    args.out.mkdir(parents=True, exist_ok=True)
    key_file = args.out / "api-keys"
    key_file.write_text("".join(f"{_key(t)} data tenant={t}\n" for t in TENANTS))
    limits = (
        f"flood:max_tokens_per_s={args.flood_tokens_per_s:g};"
        "interactive:priority=0;bulk:priority=10"
    )
    results: dict[str, dict[str, Any]] = {}
    rate = _cluster(engine, key_file, limits, "fcfs", 128)
    results |= _run_cluster(
        rate, [("steady alone", "steady", None), ("steady beside flood", "steady", "flood")], args
    )
    for policy in ("priority", "fcfs"):
        cluster = _cluster(engine, key_file, limits, policy, args.slots)
        phases = [
            (f"{policy}: interactive alone", "interactive", None),
            (f"{policy}: interactive beside bulk", "interactive", "bulk"),
        ]
        results |= _run_cluster(cluster, phases, args)
    (args.out / "tenants.json").write_text(json.dumps({"args": _args(args), **results}, indent=2))
    _report(results)


def _args(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def _report(results: dict[str, dict[str, Any]]) -> None:
    print(
        "| phase | TTFT p50 ms | TTFT p90 ms | within SLO | failed | flood served | flood 429 "
        "| flood TTFT p50 ms | flood within SLO |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        flood_ttft, flood_slo = r["flood_ttft_p50_ms"], r["flood_within_slo"]
        print(
            f"| {name} | {r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} | "
            f"{r['within_slo']:.0%} | {r['num_failed']} | "
            f"{r['flood_served']} | {r['flood_refused']} | "
            f"{'-' if flood_ttft is None else f'{flood_ttft:.0f}'} | "
            f"{'-' if flood_slo is None else f'{flood_slo:.0%}'} |"
        )


if __name__ == "__main__":
    main()
