"""Multi-turn chat with and without the second KV tier and peer pulls, in one run.

``python -m loadtest.bench.multi_turn --model smollm2-135m --num-kv-blocks 160
[--users 64 --turns 6 ...] [--arms cache,tier,peer,cluster] [--sharegpt FILE] [--out DIR]``

For each arm a local cluster (``--prefill-workers`` + ``--decode-workers``, the engine flags as
given, ``--num-threads`` per worker, a fresh Redis prefix index) serves ``--users`` users, each
replaying a conversation of ``--turns`` turns through the chat API
(``loadtest.generator.conversations``: every turn's prompt is the whole history, the replies
are the server's, ``--think-time-s`` between turns).
Size the cache (``--num-kv-blocks``) below the working set so that histories are evicted
between turns, as on a busy fleet:

- ``cache``: the engine's prefix cache only (``--peer-pull-min-tokens 0``: the behaviour before
  tiers and peer pulls);
- ``tier``: the same plus a disk tier of ``--tier-gib`` per worker (``--kv-offload-dir``:
  ``tier`` under ``--out``, emptied first; each worker takes a slot of its own in it);
- ``peer``: the cache plus peer pulls (the router's default ``--peer-pull-min-tokens``): a
  prefill worker pulls the history another worker holds, the reply's KV from its decode worker;
- ``cluster``: the tier and peer pulls together.

Reported per arm: TTFT p50 and p99 of turn 1 and of the later turns, prompt tokens of the later
turns and how many were computed, reused from a cache, loaded from a tier (the workers'
``num_tier_hit_blocks`` before and after, from the router's ``Status``) and pulled from a peer
(the router's ``splitserve_router_peer_pulled_blocks_total``). Prints a Markdown
table and writes ``multi_turn.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import tempfile
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from engine.flags import add_flags, from_args
from loadtest.fixtures.redis_server import RedisServer
from loadtest.generator.backends import Backend
from loadtest.generator.conversation_load import (
    add_conversation_flags,
    conversation_report,
    conversations_of,
)
from loadtest.generator.conversations import Conversation, ConversationPlan, run_conversations
from loadtest.generator.openai_http import OpenAIClient
from loadtest.generator.sweep import served_model
from services.common.roles import Role
from services.common.router_channel import open_router_channel
from services.launcher import LocalCluster
from splitserve.v1 import router_pb2, router_pb2_grpc

ARMS = ("cache", "tier", "peer", "cluster")
_TIER_ARMS = ("tier", "cluster")
_PEER_ARMS = ("peer", "cluster")


def tier_hit_blocks(router_address: str) -> int:
    """Blocks every worker behind the router loaded from its tier since it started."""
    with open_router_channel(router_address) as channel:
        status = router_pb2_grpc.RouterStub(channel).Status(router_pb2.StatusRequest(), timeout=30)
    return sum(w.load.num_tier_hit_blocks for w in status.workers)


def router_counters(cluster: LocalCluster) -> dict[tuple[str, str], float]:
    """The router's counters since it started, by (name, its labels' values joined)."""
    port = cluster.workers(Role.ROUTER)[0].metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return {
        (sample.name, ",".join(sample.labels.values())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def run_arm(
    arm: str, engine: EngineConfig, args: argparse.Namespace, conversations: list[Conversation]
) -> dict[str, Any]:
    """Start the arm's cluster, replay ``conversations``, stop it; the arm's figures."""
    engine = dataclasses.replace(engine, kv_offload_gib=0.0, kv_offload_dir=None)
    if arm in _TIER_ARMS:
        # One directory for every worker: each takes a slot of its own in it.
        tier_dir = args.out / "tier"
        shutil.rmtree(tier_dir, ignore_errors=True)
        engine = dataclasses.replace(
            engine, kv_offload_gib=args.tier_gib, kv_offload_dir=str(tier_dir)
        )
    decode_flags: tuple[str, ...] = ()
    if args.decode_num_kv_blocks is not None:
        decode_flags = ("--num-kv-blocks", str(args.decode_num_kv_blocks))
    # Workers publish their caches to a Redis index, as deployed: the router then knows what
    # a decode worker holds (a conversation's replies), which its own predictions never say.
    redis_dir = tempfile.TemporaryDirectory()
    redis_server = RedisServer(Path(redis_dir.name))
    redis_flags = ("--redis-url", redis_server.url)
    peer_flags = () if arm in _PEER_ARMS else ("--peer-pull-min-tokens", "0")
    cluster = LocalCluster(
        engine=engine,
        num_prefill=args.prefill_workers,
        num_decode=args.decode_workers,
        extra_role_flags={Role.DECODE: decode_flags},
        extra_worker_flags=redis_flags,
        extra_router_flags=(*redis_flags, *peer_flags),
        log_level="WARNING",
    )
    try:
        redis_server.start()
        cluster.start()
        served = served_model(cluster.router_address)
        client = OpenAIClient(Backend.OPENAI_CHAT, cluster.http_url, served.name)
        tier_before = tier_hit_blocks(cluster.router_address)
        plan = ConversationPlan(
            num_users=args.users,
            max_tokens=args.reply_tokens,
            think_time_s=args.think_time_s,
            seed=args.seed,
        )
        records = asyncio.run(run_conversations(client, plan, conversations))
        tier_tokens = (tier_hit_blocks(cluster.router_address) - tier_before) * engine.block_size
        counters = router_counters(cluster)
    finally:
        cluster.stop()
        redis_server.stop()
        redis_dir.cleanup()
    return {
        "arm": arm,
        # Per turn, and the history's tokens computed again (reused by no cache).
        **conversation_report(records, args.turns),
        # The tier's hits over the whole run (turn 1 may hit a tier too, for the system prompt).
        "tier_tokens": tier_tokens,
        "peer_tokens": int(
            counters.get(("splitserve_router_peer_pulled_blocks_total", ""), 0) * engine.block_size
        ),
        # How the router's peer pulls ended (pulled, not_cached, pin_failed, pull_failed).
        "peer_pulls": {
            outcome: int(value)
            for (name, outcome), value in counters.items()
            if name == "splitserve_router_peer_pulls_total"
        },
        # What the router predicted of the chosen prefill workers' hits, in all and in their
        # tiers, and what they found (blocks); decisions made blind (Redis too slow).
        **{
            f"{kind}_blocks_{side}": int(
                counters.get((f"splitserve_router_prefix_{kind}_blocks_{side}_total", ""), 0)
            )
            for kind in ("hit", "tier_hit")
            for side in ("predicted", "realized")
        },
        "blind_decisions": int(
            counters.get(("splitserve_router_prefix_index_errors_total", ""), 0)
        ),
        # Why turns failed (the client's error, e.g. "HTTP 503", "ServerDisconnectedError").
        "errors": dict(Counter(r.record.error or "no [DONE]" for r in records if not r.record.ok)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flags(parser, EngineConfig)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"some of {', '.join(ARMS)}")
    parser.add_argument("--tier-gib", type=float, default=1.0, help="the tier arm's tier")
    parser.add_argument("--prefill-workers", type=int, default=2)
    parser.add_argument("--decode-workers", type=int, default=2)
    parser.add_argument(
        "--decode-num-kv-blocks", type=int, help="the decode workers' (default: --num-kv-blocks)"
    )
    parser.add_argument("--users", type=int, default=64, help="users at once, a conversation each")
    add_conversation_flags(parser)
    parser.add_argument("--sharegpt", type=Path, help="replay this file's human turns instead")
    parser.add_argument("--out", type=Path, default=Path("bench-out/multi_turn"))
    args = parser.parse_args()
    engine = from_args(EngineConfig, args)
    args.out.mkdir(parents=True, exist_ok=True)
    conversations = _conversations(engine, args)
    results = [run_arm(arm, engine, args, conversations) for arm in args.arms.split(",")]
    (args.out / "multi_turn.json").write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "arms": results}, indent=2)
    )
    _report(results)


def _conversations(engine: EngineConfig, args: argparse.Namespace) -> list[Conversation]:
    from engine.loader.models import resolve_model
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model(engine.model))
    return conversations_of(args, tokenizer, args.users, args.sharegpt)


def _report(results: list[dict[str, Any]]) -> None:
    print(
        "| arm | turn 1 TTFT p50 / p99 ms | turns 2+ TTFT p50 / p99 ms | turns 2+ prompt tokens "
        "| computed | of which history | reused | of which from a tier | from a peer "
        "| failed turns |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        first, later = r["first_turn"], r["later_turns"]
        print(
            f"| {r['arm']} | {first['ttft_p50_ms']:.0f} / {first['ttft_p99_ms']:.0f} | "
            f"{later['ttft_p50_ms']:.0f} / {later['ttft_p99_ms']:.0f} | "
            f"{later['prompt_tokens']:,} | {r['later_turns_computed_tokens']:,} | "
            f"{r['later_turns_history_recomputed_tokens']:,} | {later['cached_tokens']:,} | "
            f"{r['tier_tokens']:,} | {r['peer_tokens']:,} | "
            f"{first['num_errors'] + later['num_errors']} |"
        )
    for r in results:
        if r["errors"]:
            print(f"{r['arm']}: failed turns by error: {r['errors']}")
        if r["peer_pulls"]:
            print(f"{r['arm']}: peer pulls by outcome: {r['peer_pulls']}")


if __name__ == "__main__":
    main()
