"""TTFT through the cluster vs the prefill worker's own prefill time.

``python -m loadtest.bench.ttft --model smollm2-135m [--prompt-tokens 512] [--requests 20]``
starts a local cluster (``splitserve up``'s launcher: one prefill and one decode worker, cores
split between them), then sends one request at a time, each a fresh random prompt (no prefix
hits) with ``max_tokens=2``:

- ``prefill_s``: the prefill worker's own time from admission to the first token, as it reports
  in ``PrefillResponse.prefill_time_s`` (measured with a direct ``Prefill`` call to the worker,
  lease released right after);
- ``ttft_s``: the client's time from sending ``Router.Generate`` to the first token.

Both are taken for the same prompts in alternation so machine noise hits them alike. Prints a
Markdown table and writes ``ttft.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import grpc

from engine.config import EngineConfig
from engine.flags import add_flags, from_args
from engine.sampling_params import SamplingParams
from services.common.convert import sampling_params_to_worker
from services.launcher import LocalCluster
from splitserve.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def run(args: argparse.Namespace) -> dict:
    engine = from_args(EngineConfig, args)
    cluster = LocalCluster(engine=engine, num_prefill=1, num_decode=1, log_level="WARNING")
    rng = random.Random(args.seed)
    try:
        address = cluster.start()
        prefill_address = cluster.workers("prefill")[0].address
        router = router_pb2_grpc.RouterStub(grpc.insecure_channel(address))
        prefill = worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(prefill_address))
        vocab_size = router.Status(router_pb2.StatusRequest()).workers[0].info.vocab_size
        params = sampling_params_to_worker(SamplingParams(temperature=0.0, max_tokens=2))
        prefill_s: list[float] = []
        ttft_s: list[float] = []
        for i in range(args.warmup + args.requests):
            prompt = [rng.randrange(100, vocab_size) for _ in range(args.prompt_tokens)]
            response = prefill.Prefill(
                worker_pb2.PrefillRequest(
                    request_id=f"direct-{i}", prompt_token_ids=prompt, sampling=params
                )
            )
            prefill.Release(worker_pb2.ReleaseRequest(request_id=f"direct-{i}"))
            prompt = [rng.randrange(100, vocab_size) for _ in range(args.prompt_tokens)]
            start_s = time.perf_counter()
            stream = router.Generate(
                router_pb2.GenerateRequest(
                    token_ids=prompt,
                    sampling=router_pb2.SamplingParams(max_tokens=2, temperature=0.0),
                )
            )
            first = next(iter(stream))
            first_s = time.perf_counter() - start_s
            assert first.token_ids, "the first message carries the first token"
            for _ in stream:
                pass
            if i >= args.warmup:
                prefill_s.append(response.prefill_time_s)
                ttft_s.append(first_s)
    finally:
        cluster.stop()
    return {
        "model": args.model,
        "prompt_tokens": args.prompt_tokens,
        "requests": args.requests,
        "prefill_s": prefill_s,
        "ttft_s": ttft_s,
        "prefill_p50_s": statistics.median(prefill_s),
        "ttft_p50_s": statistics.median(ttft_s),
        "prefill_p90_s": percentile(prefill_s, 0.9),
        "ttft_p90_s": percentile(ttft_s, 0.9),
        "ratio_p50": statistics.median(ttft_s) / statistics.median(prefill_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_flags(parser, EngineConfig)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench-out/ttft"))
    args = parser.parse_args()
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ttft.json").write_text(json.dumps(result, indent=2))
    header = ("prompt tokens", "prefill p50 (s)", "TTFT p50 (s)", "prefill p90 (s)")
    header += ("TTFT p90 (s)", "TTFT / prefill (p50)")
    row = [str(result["prompt_tokens"])]
    row += [f"{result[k]:.3f}" for k in ("prefill_p50_s", "ttft_p50_s", "prefill_p90_s")]
    row += [f"{result['ttft_p90_s']:.3f}", f"{result['ratio_p50']:.2f}x"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
