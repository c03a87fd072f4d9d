"""The CPU kernel micro-benchmark runs end to end on small shapes, at every level up to the
host's, in both CPU dtypes."""

from __future__ import annotations

import shutil

import pytest

from engine.cpu_isa import CpuIsa, host_isa
from loadtest.bench import cpu_kernels

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
LEVELS = [level for level in CpuIsa if level <= host_isa()]
SMALL = [
    *("--layers", "2", "--num-kv-blocks", "128", "--decode-batch", "3", "--vocab", "512"),
    *("--rows-per-seq", "2"),
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("level", LEVELS, ids=lambda level: level.value)
def test_prints_every_table(capsys, level, dtype):
    argv = [*SMALL, "--cpu-isa", level.value, "--dtype", dtype, "--tokens", "32"]
    assert cpu_kernels.main([*argv, "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert f"CPU level {level.value}, {dtype}" in out
    assert "decode, 3 sequences x 2 rows x 2 layers" in out
    for kv_cache_dtype in (dtype, "int8", "fp8_e4m3"):
        assert f"\n| {kv_cache_dtype} | " in out
    prefill_from = CpuIsa.AVX512_BF16 if dtype == "bfloat16" else CpuIsa.AVX2
    has_prefill_kernel = level >= prefill_from
    assert (out.count("| 1024 |") == 1) == has_prefill_kernel
    packs = dtype == "float32" or level >= CpuIsa.AVX512
    assert ("| lm_head | 64 |" in out) == packs
    for op in ("rms_norm", "silu_and_mul", "rotary_"):
        assert f"| {op} |" in out
