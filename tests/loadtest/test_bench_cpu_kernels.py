"""The CPU kernel micro-benchmark runs end to end on small shapes."""

from __future__ import annotations

import shutil

import pytest

from engine.model.cpu_kernels import load_cpu_kernels
from loadtest import bench_cpu_kernels

kernels = load_cpu_kernels() if shutil.which("c++") else None
pytestmark = pytest.mark.skipif(
    kernels is None or not kernels.paged_prefill_supported(True, 64, 16, 1),
    reason="the bfloat16 CPU kernels are not built on this host",
)


def test_prints_every_table(capsys):
    argv = ["--layers", "2", "--num-kv-blocks", "128", "--decode-batch", "3"]
    assert bench_cpu_kernels.main([*argv, "--tokens", "32", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("| 1024 |") == 1
    assert "decode, 3 sequences x 2 layers" in out
    for op in ("rms_norm", "silu_and_mul", "rotary_"):
        assert f"| {op} |" in out
