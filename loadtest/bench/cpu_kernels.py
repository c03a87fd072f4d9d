"""The compiled CPU kernels against the torch paths they replace, one op at a time.

``python -m loadtest.bench.cpu_kernels [--cpu-isa auto|avx2|...] [--dtype bfloat16|float32]
[--threads 2] [--heads 9] [--kv-heads 3] [--head-dim 64]``

Shapes default to SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64, hidden 576), 16-token
blocks, a cache as large as the engine's 2 GiB default, block ids shuffled (the layout after
churn). The kernels are those built for ``--cpu-isa`` (default: the host's level), so an AVX2
host can be simulated on a better one. Reported, best of ``--repeats``:

- the linears (q/k/v, gate/up, down, LM head) at 1, 64 and 512 rows, oneDNN-packed against
  ``F.linear``, where the level packs the dtype;
- prefill attention of one causal prompt per layer, the paged kernel against SDPA (the engine's
  path without the kernel), with GFLOP/s counted on the causal half (bfloat16 from
  avx512_bf16, float32 from avx2; elsewhere the engine runs SDPA);
- decode attention of a ``--decode-batch`` batch with contexts uniform in [130, 640] tokens
  (``--rows-per-seq`` rows each, as a decode with draft tokens) over all layers, the paged
  kernel against the torch gather path, with the K/V bytes read;
- the fused elementwise ops against their torch composition on ``--tokens`` rows.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.cpu_isa import ISA_CHOICES, CpuIsa, resolve_isa
from engine.cpu_tuning import advise_huge_pages
from engine.kv_cache_spec import KV_SCALE_BYTES
from engine.model.attention import DecodeInputs, PagedKVCache, _decode, decode_bias
from engine.model.cpu_kernels import load_cpu_kernels
from engine.model.kv_quant import kv_quant_for, quantize_rows
from engine.model.ops import FusedCpuOps, TorchOps
from engine.model.packed_linear import PackedLinear, packing_supported
from engine.model.rotary import RotaryEmbedding

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def prefill_ms(args: argparse.Namespace, kernels, cache: PagedKVCache, n: int) -> list[float]:
    """[kernel, SDPA] ms for one causal ``n``-token prompt in one layer."""
    heads, dim = args.heads, args.head_dim
    dtype = cache.tensor.dtype
    q = torch.randn(n, heads, dim).to(dtype)
    k = torch.randn(n, args.kv_heads, dim).to(dtype)
    v = torch.randn(n, args.kv_heads, dim).to(dtype)
    table = torch.randperm(cache.tensor.shape[0])[: -(-n // 16)][None].contiguous()
    lens = torch.tensor([n])
    out = torch.empty_like(q)

    def kernel() -> None:
        kernels.paged_prefill(
            q, cache.tensor, table, torch.tensor([0]), lens, lens, 0, dim**-0.5, -1, out
        )

    def sdpa() -> None:
        F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            enable_gqa=True,
        )

    return [best_ms(kernel, args.repeats), best_ms(sdpa, args.repeats)]


def bench_prefill(args: argparse.Namespace, kernels, cache: PagedKVCache) -> None:
    print("| prompt tokens | kernel ms/layer | SDPA ms/layer | kernel GFLOP/s | SDPA GFLOP/s |")
    print("|---|---|---|---|---|")
    for n in (128, 256, 512, 1024):
        ms = prefill_ms(args, kernels, cache, n)
        flops = 4 * args.heads * args.head_dim * n * n / 2
        gflops = [flops / m / 1e6 for m in ms]
        print(f"| {n} | {ms[0]:.2f} | {ms[1]:.2f} | {gflops[0]:.0f} | {gflops[1]:.0f} |")


def bench_linears(args: argparse.Namespace, level: CpuIsa, dtype: torch.dtype) -> None:
    if not packing_supported(dtype, level):
        print(f"linears: {dtype} weights are not packed at {level.value} (F.linear runs)\n")
        return
    hidden, inter, dim = args.hidden, args.intermediate, args.head_dim
    shapes = {
        "qkv_proj": ((args.heads + 2 * args.kv_heads) * dim, hidden),
        "gate_up_proj": (2 * inter, hidden),
        "down_proj": (hidden, inter),
        "lm_head": (args.vocab, hidden),
    }
    print("| linear | rows | packed ms | F.linear ms |\n|---|---|---|---|")
    for name, (out_features, in_features) in shapes.items():
        weight = torch.randn(out_features, in_features).to(dtype)
        packed = PackedLinear(weight)
        for rows in (1, 64, 512):
            x = torch.randn(rows, in_features).to(dtype)
            ms = [
                best_ms(functools.partial(packed, x), args.repeats),
                best_ms(functools.partial(F.linear, x, weight), args.repeats),
            ]
            print(f"| {name} | {rows} | {ms[0]:.3f} | {ms[1]:.3f} |")
    print()


def decode_cache(args: argparse.Namespace, kv_cache_dtype: str, dtype: torch.dtype) -> PagedKVCache:
    """A cache of the engine's default size in ``kv_cache_dtype`` (the model's, or 8-bit rows
    quantized from the same random values), built a slice at a time, on huge pages where the
    engine's would be."""
    quant = kv_quant_for(kv_cache_dtype)
    row = args.head_dim + (KV_SCALE_BYTES if quant else 0)
    shape = (args.num_kv_blocks, args.layers, 2, args.kv_heads, 16)
    tensor = torch.empty((*shape, row), dtype=torch.uint8 if quant else dtype)
    advise_huge_pages(tensor.data_ptr(), tensor.nbytes)  # as the engine's cache
    gen = torch.Generator().manual_seed(1)
    for first in range(0, args.num_kv_blocks, 256):
        n = min(256, args.num_kv_blocks - first)
        part = torch.randn((n, *shape[1:], args.head_dim), generator=gen)
        tensor[first : first + n] = quantize_rows(part, quant) if quant else part.to(dtype)
    return PagedKVCache(tensor, quant, dtype)


def bench_decode(args: argparse.Namespace, kernels, dtype: torch.dtype) -> None:
    """Per KV cache dtype: the decode kernel over a step's batch, all layers, against a plain
    read of the same bytes (``read_kv_blocks``); the torch gather path for the model's dtype."""
    gen = torch.Generator().manual_seed(0)
    batch, heads, dim, rows = args.decode_batch, args.heads, args.head_dim, args.rows_per_seq
    seq_lens = torch.randint(130, 641, (batch,), generator=gen)
    max_blocks = -(-(int(seq_lens.max()) + rows - 1) // 16)
    seq_tables = torch.randperm(args.num_kv_blocks, generator=gen)[: batch * max_blocks]
    seq_tables = seq_tables.view(batch, max_blocks).contiguous()
    # A decode with rows - 1 draft tokens: rows seeing n, n + 1, ... tokens of one table.
    lens = (seq_lens[:, None] + torch.arange(rows)).flatten()
    tables = seq_tables.repeat_interleave(rows, dim=0).contiguous()
    q = torch.randn(batch * rows, heads, dim, generator=gen).to(dtype)
    layers = args.layers
    blocks_read = int(sum(-(-(int(n) + rows - 1) // 16) for n in seq_lens))
    print(f"\ndecode, {batch} sequences x {rows} rows x {layers} layers, {args.dtype} queries")
    print(
        "| KV cache | MB of K/V per step | kernel ms | plain read ms | kernel / read | "
        "torch gather ms |\n|---|---|---|---|---|---|"
    )
    for kv_cache_dtype in args.kv_cache_dtypes:
        name = args.dtype if kv_cache_dtype == "auto" else kv_cache_dtype
        cache = decode_cache(args, name, dtype)
        meta = type("Meta", (), {"decode": DecodeInputs(tables, lens, None, None, kernels, None)})()

        def kernel(cache: PagedKVCache = cache, meta=meta) -> None:
            for layer in range(layers):
                _decode(layer, q, cache, meta)

        def plain_read(cache: PagedKVCache = cache) -> None:
            for layer in range(layers):
                kernels.read_kv_blocks(cache.tensor, seq_tables, seq_lens + rows - 1, layer)

        ms = [best_ms(fn, args.repeats) for fn in (kernel, plain_read)]
        gather_ms = "-"
        if cache.quant is None:
            bias = decode_bias(lens, max_blocks * 16, None, dtype)
            inputs = DecodeInputs(tables, lens, cache.tile_rows(tables), bias, None, None)
            ref_meta = type("Meta", (), {"decode": inputs})()
            gather_ms = f"{best_ms(functools.partial(kernel, cache, ref_meta), 2):.1f}"
        layer_bytes = cache.tensor[0, 0].numel() * cache.tensor.element_size()
        mb = blocks_read * layers * layer_bytes / 1e6
        print(
            f"| {name} | {mb:.0f} | {ms[0]:.1f} | {ms[1]:.1f} | {ms[0] / ms[1]:.2f} | {gather_ms} |"
        )
        del cache


def bench_ops(args: argparse.Namespace, kernels, dtype: torch.dtype) -> None:
    ref, fused = TorchOps(), FusedCpuOps(kernels)
    n, hidden, inter = args.tokens, args.hidden, args.intermediate
    heads = args.heads + 2 * args.kv_heads
    x, w = torch.randn(n, hidden).to(dtype), torch.randn(hidden).to(dtype)
    gate_up = torch.randn(n, 2 * inter).to(dtype)
    qkv = torch.randn(n, heads, args.head_dim).to(dtype)
    config = type("C", (), {"head_dim": args.head_dim, "rope_theta": 1e4, "rope_scaling": {}})()
    cos, sin = RotaryEmbedding(config, 4096, dtype, torch.device("cpu")).cos_sin(
        torch.arange(n) % 4096
    )
    rot = args.heads + args.kv_heads
    cases = {
        "rms_norm": lambda o: o.rms_norm(x, w, 1e-5),
        "silu_and_mul": lambda o: o.silu_and_mul(gate_up),
        "rotary_": lambda o: o.rotary_(qkv, cos, sin, rot),
    }
    print(f"\nelementwise ops on {n} rows\n| op | fused ms | torch ms |\n|---|---|---|")
    for name, fn in cases.items():
        ms = [best_ms(functools.partial(fn, o), args.repeats) for o in (fused, ref)]
        print(f"| {name} | {ms[0]:.3f} | {ms[1]:.3f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.cpu_kernels", description=__doc__)
    p.add_argument("--cpu-isa", choices=ISA_CHOICES, default="auto")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--num-kv-blocks", type=int, default=5800)
    p.add_argument("--decode-batch", type=int, default=62)
    p.add_argument(
        "--rows-per-seq",
        type=int,
        default=1,
        help="decode rows per sequence (a decode with rows - 1 draft tokens)",
    )
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--kv-cache-dtypes",
        default="auto,int8,fp8_e4m3",
        help="the decode benchmark's caches (auto: the model's --dtype)",
    )
    p.add_argument(
        "--only", choices=("all", "decode"), default="all", help="decode: the decode table only"
    )
    args = p.parse_args(argv)
    args.kv_cache_dtypes = [d.strip() for d in args.kv_cache_dtypes.split(",") if d.strip()]
    torch.set_num_threads(args.threads)
    level = resolve_isa(args.cpu_isa)
    dtype = DTYPES[args.dtype]
    kernels = load_cpu_kernels(level)
    if kernels is None:
        raise SystemExit(f"the CPU kernels do not build for {level.value} here")
    print(f"CPU level {level.value}, {args.dtype}, {args.threads} threads\n")
    with torch.inference_mode():
        if args.only == "all":
            bench_linears(args, level, dtype)
            if kernels.paged_prefill_supported(args.dtype, args.head_dim, 16, 1):
                bench_prefill(args, kernels, decode_cache(args, args.dtype, dtype))
            else:
                print(f"prefill: no paged prefill kernel for {args.dtype} at {level.value}")
        bench_decode(args, kernels, dtype)
        if args.only == "all":
            bench_ops(args, kernels, dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
