"""``loadtest.bench.kv_tier`` at a small size: every figure it reports is measured, and the
blocks it loads back are the ones it saved."""

from __future__ import annotations

from pathlib import Path

import torch

from engine import LLMEngine
from engine.config import EngineConfig
from engine.kv_offload import build_offload
from loadtest.bench.kv_tier import time_recompute, time_tier


def test_a_small_run_reports_every_figure(tiny_llama_dir, tmp_path) -> None:
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir),
            dtype="float32",
            num_kv_blocks=32,
            max_model_len=256,
            enable_prefix_caching=False,
        )
    )
    assert time_recompute(engine, 64, seed=0) > 0
    torch.manual_seed(0)
    engine.kv_cache.copy_(torch.randn_like(engine.kv_cache))
    before = engine.kv_cache.clone()
    spec = engine.kv_cache_spec
    for directory in (str(tmp_path / "tier"), None):
        offload = build_offload(
            engine.kv_cache, spec, 0.01, directory, Path(engine.model_dir), engine.dtype
        )
        figures = time_tier(offload, 16, drop_caches=False)
        offload.close()
        assert set(figures) == {"save_us_per_block", "write_mb_per_s", "load_warm_us_per_block"}
        assert all(v > 0 for v in figures.values())
        # 16 saves of the cache's first blocks, loaded back into the same blocks.
        assert torch.equal(engine.kv_cache, before)
