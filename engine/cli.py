"""``splitserve generate``: one prompt through an in-process engine."""

from __future__ import annotations

import argparse
import json
import sys
import time

from engine.config import EngineConfig
from engine.flags import add_flags, from_args
from engine.llm import LLM
from engine.sampling_params import SamplingParams


def configure(parser: argparse.ArgumentParser) -> None:
    """Declare ``generate``'s flags on its sub-parser."""
    add_flags(parser, EngineConfig, skip=("seed",))
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--chat", action="store_true", help="apply the chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=tuple(args.stop),
            ignore_eos=args.ignore_eos,
        )
        llm = LLM.from_config(from_args(EngineConfig, args))
        if args.chat:
            prompt: str | list[int] = llm.tokenizer.encode_chat(
                [{"role": "user", "content": args.prompt}]
            )
        else:
            prompt = args.prompt
        start_s = time.perf_counter()
        final = None
        for out in llm.generate_stream([prompt], params):
            if not args.json:
                sys.stdout.write(out.delta_text)
                sys.stdout.flush()
            final = out
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    assert final is not None
    elapsed_s = time.perf_counter() - start_s
    if args.json:
        print(
            json.dumps(
                {
                    "token_ids": final.token_ids,
                    "text": final.text,
                    "finish_reason": final.finish_reason,
                    "num_prompt_tokens": len(final.prompt_token_ids),
                    "num_cached_tokens": final.num_cached_tokens,
                    "elapsed_s": round(elapsed_s, 3),
                }
            )
        )
    else:
        sys.stdout.write("\n")
    return 0
