"""``--kv-cache-dtype``: how it resolves, what an 8-bit cache holds, and what it costs in
greedy output against the model's own dtype (the compiled paths against the torch paths, and
SmolLM2's real weights against an unquantized cache)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.resolve import resolve_kv_cache_dtype
from tests.engine.loader.tiny_gguf import needs_smollm2
from tests.engine.test_generate_vs_hf import make_prompts

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def test_auto_is_int8_for_bfloat16_on_cpu_and_the_model_dtype_elsewhere():
    assert resolve_kv_cache_dtype("auto", "bfloat16", CPU) == "int8"
    assert resolve_kv_cache_dtype("auto", "float32", CPU) == "float32"
    assert resolve_kv_cache_dtype("auto", "bfloat16", CUDA) == "bfloat16"
    assert resolve_kv_cache_dtype("fp8", "float32", CPU) == "fp8_e4m3"
    assert resolve_kv_cache_dtype("int8", "float32", CUDA) == "int8"
    assert resolve_kv_cache_dtype("float32", "float32", CPU) == "float32"
    with pytest.raises(ValueError, match="--kv-cache-dtype bfloat16 with --dtype float32"):
        resolve_kv_cache_dtype("bfloat16", "float32", CPU)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(model="m", kv_cache_dtype="int4")


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_an_8bit_cache_holds_rows_of_codes_and_scales_in_about_half_the_memory(
    tiny_llama_dir, kv_cache_dtype
):
    full = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory_gb=0.01)
    small = LLM(
        str(tiny_llama_dir), dtype="float32", kv_cache_dtype=kv_cache_dtype, kv_cache_memory_gb=0.01
    )
    spec = small.engine.kv_cache_spec
    assert spec.dtype == kv_cache_dtype and spec.row_size == spec.head_dim + 4
    assert small.engine.kv_cache.dtype == torch.uint8
    assert small.engine.kv_cache.shape[1:] == spec.block_shape
    # float32 rows are 4 bytes a value, 8-bit ones 1 and a 4-byte scale per row.
    ratio = small.engine.runner.num_kv_blocks / full.engine.runner.num_kv_blocks
    assert ratio == pytest.approx(4 * spec.head_dim / (spec.head_dim + 4), rel=0.01)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_compiled_and_torch_paths_agree_over_an_8bit_cache(tiny_llama_dir, kv_cache_dtype):
    """The compiled decode (and, at AVX2 and up, prefill) kernels against the torch paths, on
    the same quantized cache: greedy ids equal, alone and batched, and after a prefix hit."""
    outputs = []
    for backend in ("cpp", "torch"):
        llm = LLM(
            str(tiny_llama_dir),
            dtype="float32",
            kv_cache_dtype=kv_cache_dtype,
            num_kv_blocks=256,
            kernel_backend=backend,
        )
        prompts = make_prompts(llm.engine.vocab_size)
        batched = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        again = [o.token_ids for o in llm.generate(prompts[-2:], GREEDY)]  # prefix-cache hits
        assert again == batched[-2:]
        outputs.append(batched)
    assert outputs[0] == outputs[1]


SMOLLM2_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Photosynthesis is the process by which",
    "Here is a list of the planets in our solar system:",
    "Once upon a time, in a small village by the sea,",
    "To make a cup of tea, first",
    "The three primary colors are",
    "Water boils at a temperature of",
]


@needs_smollm2
def test_8bit_caches_keep_smollm2s_greedy_output():
    """SmolLM2-135M's real weights in float32: greedy text from an int8 cache agrees with a
    float32 cache on most prompts and most tokens; fp8 e4m3 (3 mantissa bits) a little less.
    ``loadtest.bench.kv_cache_quality`` measures the same on the benchmark set (BENCHMARKS.md)."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for kv_cache_dtype in ("float32", "int8", "fp8_e4m3"):
        llm = LLM("smollm2-135m", dtype="float32", kv_cache_dtype=kv_cache_dtype)
        outputs[kv_cache_dtype] = [o.token_ids for o in llm.generate(SMOLLM2_PROMPTS, params)]
    ref = outputs["float32"]
    for kv_cache_dtype, min_identical, min_tokens in (("int8", 4, 0.7), ("fp8_e4m3", 3, 0.55)):
        got = outputs[kv_cache_dtype]
        identical = sum(a == b for a, b in zip(ref, got, strict=True))
        agreeing = sum(
            next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
            for a, b in zip(ref, got, strict=True)
        ) / sum(len(a) for a in ref)
        assert identical >= min_identical and agreeing >= min_tokens, (
            kv_cache_dtype,
            identical,
            agreeing,
        )
