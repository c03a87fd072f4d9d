"""What a block costs in the second KV tier, against recomputing it.

``python -m loadtest.bench.kv_tier --model smollm2-135m [--blocks 512] [--dir DIR]``

Loads the model's engine (``--kv-cache-dtype`` as given) and times, on its own KV cache:

- **save**: ``KVOffload.save`` of one evicted block (the copy the engine's step pays; the file is
  written by the tier's thread) and the writer's throughput until every file is on disk;
- **load**: ``KVOffload.load`` of the same blocks (read, checksum, copy into the cache), from the
  page cache (files just written) and, for the disk tier, after dropping the page cache
  (``--drop-caches``, as root) for a cold read;
- **recompute**: a prefill of the same number of tokens by the engine (prefix caching off),
  per block.

Each for a disk tier under ``--dir`` and a host-memory tier. Prints a Markdown table (us per
block, MB/s) and writes ``kv_tier.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

from engine import LLMEngine, SamplingParams
from engine.config import EngineConfig
from engine.flags import add_flags, from_args
from engine.kv_offload import KVOffload, build_offload


def _hashes(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(n)]


def time_tier(offload: KVOffload, num_blocks: int, drop_caches: bool) -> dict[str, float]:
    """Save ``num_blocks`` of the cache's blocks, wait for the writes, load them back."""
    hashes = _hashes(num_blocks, seed=1)
    block_ids = [i % offload.num_cache_blocks for i in range(num_blocks)]
    start_s = time.perf_counter()
    for block_id, block_hash in zip(block_ids, hashes, strict=True):
        offload.save(block_id, block_hash)
    save_s = time.perf_counter() - start_s
    offload.tier.flush()
    written_s = time.perf_counter() - start_s
    results = {
        "save_us_per_block": save_s / num_blocks * 1e6,
        "write_mb_per_s": num_blocks * offload.block_bytes / written_s / 1e6,
    }
    for label, drop in (("warm", False), ("cold", drop_caches)):
        if label == "cold" and not drop:
            continue
        if drop:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        start_s = time.perf_counter()
        for block_id, block_hash in zip(block_ids, hashes, strict=True):
            assert offload.load([block_hash], [block_id]) == 1
        results[f"load_{label}_us_per_block"] = (time.perf_counter() - start_s) / num_blocks * 1e6
    return results


def time_recompute(engine: LLMEngine, num_tokens: int, seed: int) -> float:
    """Microseconds per block of a prefill of ``num_tokens`` fresh random tokens."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, engine.vocab_size) for _ in range(num_tokens)]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    engine.add_request(f"recompute-{seed}", prompt, params)
    start_s = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (time.perf_counter() - start_s) / (num_tokens / engine.config.block_size) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flags(parser, EngineConfig)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--dir", type=Path, default=Path("bench-out/kv_tier/tier"))
    parser.add_argument("--drop-caches", action="store_true", help="also time cold reads")
    parser.add_argument("--out", type=Path, default=Path("bench-out/kv_tier"))
    args = parser.parse_args()
    config = dataclasses.replace(
        from_args(EngineConfig, args), enable_prefix_caching=False, kv_offload_gib=0.0
    )
    engine = LLMEngine(config)
    spec = engine.kv_cache_spec
    capacity_gib = 2 * args.blocks * spec.block_bytes / 2**30
    results: dict[str, Any] = {
        "kv": spec.describe(),
        "block_bytes": spec.block_bytes,
        "cpu_isa": engine.executor.cpu_isa,
    }
    time_recompute(engine, args.prefill_tokens, seed=0)  # warm-up
    results["recompute_us_per_block"] = time_recompute(engine, args.prefill_tokens, seed=1)
    shutil.rmtree(args.dir, ignore_errors=True)
    for kind, directory in (("disk", str(args.dir)), ("host", None)):
        offload = build_offload(
            engine.kv_cache,
            spec,
            capacity_gib,
            directory,
            Path(engine.model_dir),
            engine.dtype,
        )
        results[kind] = time_tier(offload, args.blocks, args.drop_caches and kind == "disk")
        offload.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_tier.json").write_text(json.dumps(results, indent=2))
    print(f"{results['kv']}: {results['block_bytes']:,} bytes a block; CPU {results['cpu_isa']}")
    print(
        f"recompute (prefill of {args.prefill_tokens} tokens): "
        f"{results['recompute_us_per_block']:,.0f} us per block"
    )
    print("| tier | save us/block | write MB/s | load us/block (page cache) | load cold |")
    print("|---|---:|---:|---:|---:|")
    for kind in ("disk", "host"):
        r = results[kind]
        cold = r.get("load_cold_us_per_block")
        print(
            f"| {kind} | {r['save_us_per_block']:,.0f} | {r['write_mb_per_s']:,.0f} | "
            f"{r['load_warm_us_per_block']:,.0f} | {'-' if cold is None else f'{cold:,.0f}'} |"
        )


if __name__ == "__main__":
    main()
