"""Lower CPU levels forced on this host, as an operator reproduces a smaller one: splitserve's
own override (``--cpu-isa``) together with torch's ``ATEN_CPU_CAPABILITY`` and oneDNN's
``ONEDNN_MAX_CPU_ISA`` (``cpu_isa.library_env``), in child processes, since both libraries
read their variable once per process.

AVX2 and PORTABLE run on every x86-64 host (on an AVX2-only host AVX2 is the native level and
this is the same run as the main one, under the libraries' caps).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.cpu_isa import CpuIsa, host_isa, library_env
from loadtest.fixtures.tiny_lora import make_tiny_lora
from tests.engine.test_generate_vs_hf import (
    MAX_TOKENS,
    hf_generate,
    hf_greedy,
    make_head_dim_64_model,
    make_prompts,
)

REPO = Path(__file__).resolve().parents[2]
FORCED = [level for level in (CpuIsa.AVX2, CpuIsa.PORTABLE) if level <= host_isa()]
pytestmark = [
    pytest.mark.skipif(not FORCED, reason=f"host level {host_isa().value} is below avx2"),
    pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler"),
]
ATEN_NAMES = {CpuIsa.AVX2: "AVX2", CpuIsa.PORTABLE: "DEFAULT"}


def run_at_level(level: CpuIsa, *args: str) -> subprocess.CompletedProcess:
    """``python ARGS`` in a child capped at ``level`` by splitserve's and the libraries' vars."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=os.environ | library_env(level) | {"SPLITSERVE_CPU_ISA": level.value},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """head_dim 64: the compiled prefill kernels' shapes."""
    return make_head_dim_64_model(tmp_path_factory.mktemp("forced-isa"), "llama", {})


@pytest.fixture(scope="module")
def hf_expected(model_dir: Path) -> list[list[int]]:
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    return hf_greedy(model_dir, make_prompts(vocab_size), MAX_TOKENS)


@pytest.fixture(scope="module")
def adapter(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """A random LoRA adapter of the model and its greedy outputs by transformers + PEFT."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = make_tiny_lora(model_dir, tmp_path_factory.mktemp("forced-isa-lora"), seed=5)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, path)
    return path, hf_generate(model, make_prompts(model.config.vocab_size), MAX_TOKENS)


@pytest.mark.parametrize("level", FORCED, ids=lambda level: level.value)
def test_generation_at_forced_level_matches_hf(model_dir, hf_expected, adapter, level):
    """float32 is token-for-token HF's, and with a LoRA adapter PEFT's; bfloat16 agrees with it
    as on any host (the first tokens of all prompts but one, as
    ``test_bfloat16_runs_and_mostly_agrees`` requires)."""
    adapter_dir, peft_expected = adapter
    proc = run_at_level(
        level, "-m", "tests.engine.forced_isa_child", str(model_dir), level.value, str(adapter_dir)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["aten_capability"] == ATEN_NAMES[level]
    # Below avx512 bfloat16 linears are F.linear, float32 ones packed; the compiled decode
    # kernel and fused ops run in both; the paged prefill kernel in float32 from avx2, in
    # bfloat16 only from avx512_bf16.
    f32_prefill = "cpp" if level >= CpuIsa.AVX2 else "sdpa"
    assert result["float32_kernels"] == (
        f"linear=onednn-packed decode=cpp prefill={f32_prefill} ops=cpp"
    )
    assert result["bfloat16_kernels"] == "linear=torch decode=cpp prefill=sdpa ops=cpp"
    assert result["float32"] == hf_expected
    agree = sum(g[:2] == e[:2] for g, e in zip(result["bfloat16"], hf_expected, strict=True))
    assert agree >= len(hf_expected) - 1
    # An int8 cache: the level's compiled writes, decode and prefill scratch give the torch
    # reference paths' tokens.
    assert result["int8_cpp"] == result["int8_torch"]
    # LoRA's grouped matmuls are torch's, capped at the level with the linears.
    assert result["lora"] == peft_expected + hf_expected


@pytest.mark.parametrize("level", FORCED, ids=lambda level: level.value)
def test_kernel_tests_pass_at_forced_level(level):
    """The kernel tests of that level, with torch's reference paths capped at it too."""
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", level.value, "tests/engine/model"]
    proc = run_at_level(level, *args)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert " passed" in proc.stdout


@pytest.mark.skipif(host_isa() < CpuIsa.AVX512_BF16, reason="bfloat16 prefill is SDPA below")
def test_bfloat16_prefill_is_compiled_at_avx512_bf16_and_sdpa_at_amx(model_dir):
    """The compiled prefill kernel (AVX-512 BF16 dot products) from avx512_bf16; at amx,
    SDPA, whose matmuls oneDNN runs on AMX tiles."""
    from engine import LLM

    for level in (CpuIsa.AVX512_BF16, host_isa()):
        llm = LLM(str(model_dir), dtype="bfloat16", cpu_isa=level.value, num_kv_blocks=64)
        want = "sdpa" if level is CpuIsa.AMX else "cpp"
        assert f"prefill={want}" in llm.engine.kernels.describe()
