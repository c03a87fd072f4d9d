"""What an 8-bit KV cache costs in quality, against the model's own dtype, on one model.

``python -m loadtest.bench.kv_cache_quality --model smollm2-135m [--dtype auto] [--cpu-isa auto]
[--kv-cache-dtypes int8,fp8_e4m3] [--out bench-out/kv-quality]``

Two measurements per 8-bit dtype, each against a cache in the model's dtype in the same run
(and, for a bfloat16 model, the float32 model's own distance from it, for scale):

- **Greedy agreement** over ``bench_engine``'s workload (the same seeded random-token prompts,
  greedy, ``ignore_eos``): the share of requests whose whole output is identical, and the
  mean share of each output before its first differing token.
- **Teacher-forced log-likelihood** of fixed texts: this repository's own Markdown docs, cut
  into ``--text-tokens`` windows with the model's tokenizer (nothing downloaded). The first
  ``--prefix-tokens`` of each text are one prefill chunk (the compiled prefill kernel reads
  them back from the cache); every later token is one decode step over the cache, so each
  predicted token attends to quantized K/V the way a generated one does. Reported: the mean
  negative log-likelihood per token of each cache, their difference, the mean KL divergence
  from the unquantized cache's next-token distribution, and how often their top-1 agree.

Both engines run in this process, stepped in lockstep over the same blocks. Markdown goes to
stdout and ``report.md``, the numbers to ``results.json``, under ``--out``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.cpu_isa import ISA_CHOICES, resolve_isa
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.resolve import resolve_dtype
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledRequest
from loadtest.bench.engine import resolve_model_dir
from loadtest.generator.workloads import random_token_workload

REPO_ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class GreedyAgreement:
    """Greedy outputs of one cache dtype against the unquantized cache's."""

    kv_cache_dtype: str
    identical_requests: float  # share of requests whose outputs are identical
    mean_prefix_agreement: float  # mean share of each output before its first difference


@dataclass(frozen=True, slots=True)
class Likelihood:
    """Teacher-forced next-token statistics of one cache dtype over the text set."""

    kv_cache_dtype: str
    num_tokens: int
    mean_nll: float  # nats per token
    nll_delta: float  # minus the unquantized cache's mean_nll
    mean_kl: float  # KL(unquantized || this) per token, nats
    top1_agreement: float


@dataclass(frozen=True, slots=True)
class _Forced:
    """The fields of a request a step reads: its ids, and how many are computed already."""

    all_token_ids: list[int]
    num_computed_tokens: int
    num_tokens: int


def doc_texts(tokenizer_encode, num_texts: int, text_tokens: int) -> list[list[int]]:
    """``num_texts`` windows of ``text_tokens`` ids from this repo's Markdown, in a fixed order."""
    paths = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    ids: list[int] = []
    for path in paths:
        ids.extend(tokenizer_encode(path.read_text()))
    windows = [ids[i : i + text_tokens] for i in range(0, len(ids), text_tokens)]
    windows = [w for w in windows if len(w) == text_tokens]
    if len(windows) < num_texts:
        raise SystemExit(f"the docs hold {len(windows)} windows of {text_tokens} tokens")
    step = len(windows) // num_texts
    return [windows[i * step] for i in range(num_texts)]


def greedy_outputs(
    args: argparse.Namespace, kv_cache_dtype: str, dtype: str | None = None
) -> list[list[int]]:
    workload = random_token_workload(
        args.model_dir, args.num_prompts, 128, 512, args.output_tokens, args.seed
    )
    llm = LLM(
        str(args.model_dir),
        dtype=dtype or args.dtype,
        kv_cache_dtype=kv_cache_dtype,
        cpu_isa=args.cpu_isa,
        max_num_seqs=64,
        max_num_batched_tokens=4096,
    )
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([list(p) for p in workload.prompt_token_ids], params)
    return [o.token_ids for o in outputs]


def agreement(kv_cache_dtype: str, ref: list[list[int]], got: list[list[int]]) -> GreedyAgreement:
    prefixes = []
    for a, b in zip(ref, got, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        prefixes.append(same / len(a))
    identical = sum(a == b for a, b in zip(ref, got, strict=True)) / len(ref)
    return GreedyAgreement(kv_cache_dtype, identical, sum(prefixes) / len(prefixes))


def _engine(
    args: argparse.Namespace, kv_cache_dtype: str, num_blocks: int, dtype: str | None = None
) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(args.model_dir),
            dtype=dtype or args.dtype,
            kv_cache_dtype=kv_cache_dtype,
            cpu_isa=args.cpu_isa,
            num_kv_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            max_model_len=args.text_tokens,
            enable_prefix_caching=False,
        )
    )


def forced_logprobs(
    engine: LLMEngine, texts: list[list[int]], prefix_tokens: int
) -> list[torch.Tensor]:
    """Per step, [num_texts, vocab] float32 log-probabilities of each text's next token."""
    blocks_per_text = -(-len(texts[0]) // BLOCK_SIZE)
    tables = [
        list(range(i * blocks_per_text, (i + 1) * blocks_per_text)) for i in range(len(texts))
    ]
    steps = []
    items = [
        ScheduledRequest(_Forced(t, 0, prefix_tokens), prefix_tokens, tables[i])  # type: ignore[arg-type]
        for i, t in enumerate(texts)
    ]
    steps.append(torch.log_softmax(engine.runner.execute(items).float(), dim=-1))
    for pos in range(prefix_tokens, len(texts[0]) - 1):
        items = [
            ScheduledRequest(_Forced(t, pos, pos + 1), 1, tables[i])  # type: ignore[arg-type]
            for i, t in enumerate(texts)
        ]
        steps.append(torch.log_softmax(engine.runner.execute(items).float(), dim=-1))
    return steps


def likelihood(
    kv_cache_dtype: str,
    texts: list[list[int]],
    prefix_tokens: int,
    ref: list[torch.Tensor],
    got: list[torch.Tensor],
) -> tuple[Likelihood, float]:
    """This cache's statistics, and the reference's mean NLL (for the delta)."""
    nll_ref = nll_got = kl = 0.0
    top1 = n = 0
    for step, (r, g) in enumerate(zip(ref, got, strict=True)):
        target = torch.tensor([t[prefix_tokens + step] for t in texts])
        nll_ref -= float(r.gather(1, target[:, None]).sum())
        nll_got -= float(g.gather(1, target[:, None]).sum())
        kl += float((r.exp() * (r - g)).sum())
        top1 += int((r.argmax(-1) == g.argmax(-1)).sum())
        n += len(texts)
    stats = Likelihood(kv_cache_dtype, n, nll_got / n, (nll_got - nll_ref) / n, kl / n, top1 / n)
    return stats, nll_ref / n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench.kv_cache_quality", description=__doc__
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    p.add_argument("--cpu-isa", choices=ISA_CHOICES, default="auto")
    p.add_argument("--kv-cache-dtypes", default="int8,fp8_e4m3")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--num-texts", type=int, default=16)
    p.add_argument("--text-tokens", type=int, default=384)
    p.add_argument("--prefix-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench-out/kv-quality"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.model_dir = resolve_model_dir(args.model)
    quantized = [d.strip() for d in args.kv_cache_dtypes.split(",") if d.strip()]

    blocks = args.num_texts * -(-args.text_tokens // BLOCK_SIZE)
    args.dtype = resolve_dtype(args.dtype, torch.device("cpu"), resolve_isa(args.cpu_isa))
    ref_engine = _engine(args, args.dtype, blocks)
    texts = doc_texts(ref_engine.tokenizer.encode, args.num_texts, args.text_tokens)
    ref_steps = forced_logprobs(ref_engine, texts, args.prefix_tokens)
    del ref_engine
    ref_greedy = greedy_outputs(args, args.dtype)
    greedy, likelihoods = [], []
    ref_nll = 0.0
    # (row name, kv cache dtype, model dtype): the 8-bit caches, then for scale the float32
    # model's own distance from a bfloat16 one.
    rows = [(d, d, args.dtype) for d in quantized]
    if args.dtype != "float32":
        rows.append(("float32 model and cache", "float32", "float32"))
    for name, kv_cache_dtype, dtype in rows:
        engine = _engine(args, kv_cache_dtype, blocks, dtype)
        got = forced_logprobs(engine, texts, args.prefix_tokens)
        del engine
        stats, ref_nll = likelihood(name, texts, args.prefix_tokens, ref_steps, got)
        likelihoods.append(stats)
        greedy.append(agreement(name, ref_greedy, greedy_outputs(args, kv_cache_dtype, dtype)))

    level = resolve_isa(args.cpu_isa).value
    lines = [
        f"## KV cache quality: {args.model}, {args.dtype}, CPU level {level}",
        "",
        f"Greedy: {args.num_prompts} prompts of 128-512 random tokens (seed {args.seed}), "
        f"{args.output_tokens} output tokens, against the {args.dtype} cache.",
        "",
        "| kv cache | identical outputs | mean agreeing prefix |",
        "|---|---|---|",
        *(
            f"| {g.kv_cache_dtype} | {g.identical_requests:.0%} | {g.mean_prefix_agreement:.1%} |"
            for g in greedy
        ),
        "",
        f"Teacher-forced: {args.num_texts} texts of {args.text_tokens} tokens from the repo's "
        f"docs, first {args.prefix_tokens} prefilled, the rest decoded one token a step; "
        f"{args.dtype} cache NLL {ref_nll:.4f} nats/token.",
        "",
        "| kv cache | tokens | NLL (nats/token) | NLL - unquantized | KL (nats/token) "
        "| top-1 agree |",
        "|---|---|---|---|---|---|",
        *(
            f"| {s.kv_cache_dtype} | {s.num_tokens} | {s.mean_nll:.4f} | {s.nll_delta:+.4f} | "
            f"{s.mean_kl:.5f} | {s.top1_agreement:.2%} |"
            for s in likelihoods
        ),
    ]
    report = "\n".join(lines)
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.md").write_text(report + "\n")
    results = {
        "model": args.model,
        "dtype": args.dtype,
        "cpu_isa": level,
        "reference_nll": ref_nll,
        "greedy": [asdict(g) for g in greedy],
        "likelihood": [asdict(s) for s in likelihoods],
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
