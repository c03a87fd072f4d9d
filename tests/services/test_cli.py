"""``splitserve generate`` end to end in a subprocess, against the in-process engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def generate_json(model_dir, *args: str) -> dict:
    """``splitserve generate --json`` on the tiny model (float32, greedy, 6 tokens)."""
    proc = run_cli(
        "--model", str(model_dir), "--dtype", "float32", "--num-kv-blocks", "64",
        "--max-tokens", "6", "--json", *args,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)


def test_generate_json_matches_engine(tiny_llama_dir, llm):
    out = generate_json(tiny_llama_dir, "--prompt", "Hello world")
    assert {"token_ids", "text", "finish_reason", "num_cached_tokens"} <= out.keys()
    want = llm.generate(["Hello world"], GREEDY)[0]
    assert out["token_ids"] == want.token_ids
    assert out["text"] == want.text
    assert out["finish_reason"] == want.finish_reason


def test_generate_chat_applies_template(tiny_llama_dir, llm):
    out = generate_json(tiny_llama_dir, "--prompt", "Hi", "--chat")
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert out["num_prompt_tokens"] == len(prompt)
    assert out["token_ids"] == llm.generate([prompt], GREEDY)[0].token_ids


def test_bad_flag_value_is_a_clear_error(tiny_llama_dir):
    proc = run_cli("--model", str(tiny_llama_dir), "--prompt", "x", "--top-p", "0")
    assert proc.returncode == 2
    assert "top_p" in proc.stderr
