"""llguidance vs xgrammar on CPU: the time to start a request on a new JSON schema and the time
to compute each token's mask, over one model's tokenizer (the choice behind
``engine/structured_output.py``).

``python -m loadtest.bench.grammar --model smollm2-135m [--schemas 50]`` runs llguidance; where
``xgrammar`` is importable (install it in a venv of its own, with this checkout on the path: it
pulls triton and transformers), the same schemas through xgrammar too. Each schema is one of
the tests' random schemas (nested objects, arrays, enums, bounded numbers, patterned strings);
its tokens are sampled from noise under the mask, as the engine would. Prints p50 / p99 per
library; nothing is cached between schemas (xgrammar's compiler cache is off).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import llguidance
import torch

from engine.loader.models import resolve_model
from engine.structured_output import apply_bitmask, bitmask_width
from engine.tokenizer import Tokenizer
from loadtest.fixtures.schemas import random_schema

_MAX_TOKENS = 60


def _summary(name: str, seconds: list[float]) -> str:
    ordered = sorted(seconds)
    p99 = ordered[int(0.99 * (len(ordered) - 1))]
    return f"{name} p50 {statistics.median(ordered) * 1e3:.3f} ms, p99 {p99 * 1e3:.3f} ms"


def _run(
    start: Callable[[dict[str, Any]], Any],
    fill: Callable[[Any, torch.Tensor], None],
    accept: Callable[[Any, int], bool],
    done: Callable[[Any], bool],
    schemas: list[dict[str, Any]],
    vocab_size: int,
) -> tuple[list[float], list[float]]:
    """(per schema: start + first mask, per token: mask) seconds."""
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.full((1, bitmask_width(vocab_size)), -1, dtype=torch.int32)
    starts, masks = [], []
    for schema in schemas:
        start_s = time.perf_counter()
        matcher = start(schema)
        fill(matcher, bitmask)
        starts.append(time.perf_counter() - start_s)
        for _ in range(_MAX_TOKENS):
            if done(matcher):
                break
            mask_s = time.perf_counter()
            fill(matcher, bitmask)
            masks.append(time.perf_counter() - mask_s)
            logits = torch.randn(1, vocab_size, generator=generator)
            apply_bitmask(logits, bitmask, torch.tensor([0]))
            if not accept(matcher, int(logits.argmax())):
                break
    return starts, masks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--schemas", type=int, default=50)
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    tokenizer = Tokenizer(model_dir)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    schemas = [random_schema(random.Random(seed)) for seed in range(args.schemas)]

    start_s = time.perf_counter()
    ll_tokenizer = llguidance.LLTokenizer(
        tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=sorted(tokenizer.eos_token_ids)
    )
    print(f"llguidance: tokenizer {time.perf_counter() - start_s:.2f} s")
    starts, masks = _run(
        lambda s: llguidance.LLMatcher(
            ll_tokenizer, llguidance.LLMatcher.grammar_from_json_schema(s), log_level=0
        ),
        lambda m, b: m.unsafe_compute_mask_ptr(b.data_ptr(), b.numel() * b.element_size()),
        lambda m, t: m.consume_token(t),
        lambda m: m.is_stopped(),
        schemas,
        vocab_size,
    )
    print(f"llguidance: {_summary('new schema', starts)}; {_summary('mask', masks)}")

    try:
        import xgrammar  # type: ignore[import-not-found]
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        print("xgrammar: not installed here")
        return
    start_s = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend), vocab_size=vocab_size
    )
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    print(f"xgrammar: tokenizer {time.perf_counter() - start_s:.2f} s")
    starts, masks = _run(
        lambda s: xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(s))),
        lambda m, b: m.fill_next_token_bitmask(b),
        lambda m, t: m.accept_token(t),
        lambda m: m.is_terminated(),
        schemas,
        vocab_size,
    )
    print(f"xgrammar: {_summary('new schema', starts)}; {_summary('mask', masks)}")


if __name__ == "__main__":
    main()
