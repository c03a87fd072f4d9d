"""What structured output costs the engine: a batch where every request is JSON-constrained
against the same batch unconstrained, in one run.

``python -m loadtest.bench.structured --model smollm2-135m [--batch 32] [--max-tokens 128]``
runs the offline engine (``LLM``) on ``--batch`` seeded prompts, each generating exactly
``--max-tokens`` tokens (greedy): constrained, every request has a JSON schema of its own (an
array of short strings too long to close within the budget, so that both arms generate the
same number of tokens and the batch stays full); unconstrained, ``ignore_eos``. The arms
alternate over ``--rounds``, each round with new schemas (a compile each). Prints output
tok/s per arm (median over rounds), the constrained share of the unconstrained, and the time
to add a constrained request (the matcher's start: llguidance compiles lazily) p50 / p99.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time

from engine import LLMEngine, SamplingParams
from engine.config import EngineConfig
from engine.constraint import Constraint, ConstraintKind
from engine.flags import add_flags, from_args


def _schema(rng: random.Random) -> dict:
    """An array of strings that cannot close within ``--max-tokens`` (a new schema each)."""
    return {
        "type": "array",
        "items": {"type": "string", "maxLength": rng.randint(8, 16)},
        "minItems": 200,
        "description": f"run {rng.random()}",
    }


def _run(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[float, list[float]]:
    """(output tok/s, seconds to add each request)."""
    add_s = []
    start_s = time.perf_counter()
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        t0 = time.perf_counter()
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, p)
        add_s.append(time.perf_counter() - t0)
    num_tokens = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            num_tokens += len(output.new_token_ids)
    return num_tokens / (time.perf_counter() - start_s), add_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flags(parser, EngineConfig)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    config = dataclasses.replace(from_args(EngineConfig, args), max_num_seqs=args.batch)
    engine = LLMEngine(config)
    rng = random.Random(0)
    vocab = range(100, min(engine.vocab_size, 20000))
    prompts = [[rng.choice(vocab) for _ in range(args.prompt_tokens)] for _ in range(args.batch)]
    plain = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    # Warm-up: the kernels, and llguidance's view of the tokenizer (built once per engine).
    warm = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(_schema(rng)))
    _run(engine, prompts[:2], [dataclasses.replace(plain, constraint=warm)] * 2)
    rates: dict[str, list[float]] = {"unconstrained": [], "json-constrained": []}
    add_s: list[float] = []
    for round_index in range(args.rounds):
        arms = list(rates) if round_index % 2 == 0 else list(rates)[::-1]
        for arm in arms:
            if arm == "unconstrained":
                params = [plain] * args.batch
            else:
                params = [
                    SamplingParams(
                        temperature=0.0,
                        max_tokens=args.max_tokens,
                        constraint=Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(_schema(rng))),
                    )
                    for _ in range(args.batch)
                ]
            rate, added = _run(engine, prompts, params)
            rates[arm].append(rate)
            if arm != "unconstrained":
                add_s.extend(added)
    medians = {arm: statistics.median(r) for arm, r in rates.items()}
    for arm, r in rates.items():
        print(f"{arm}: {medians[arm]:.1f} tok/s (rounds: {', '.join(f'{x:.1f}' for x in r)})")
    share = medians["json-constrained"] / medians["unconstrained"]
    print(f"constrained / unconstrained: {share:.1%}")
    ordered = sorted(add_s)
    p99 = ordered[int(0.99 * (len(ordered) - 1))]
    print(
        f"adding a request with a new schema: p50 {statistics.median(ordered) * 1e3:.2f} ms, "
        f"p99 {p99 * 1e3:.2f} ms ({len(ordered)} schemas)"
    )


if __name__ == "__main__":
    main()
