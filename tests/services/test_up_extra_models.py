"""``splitserve up --no-ray --extra-models``: a second model's workers as plain processes
beside the first's, one router serving both; ``status`` names each worker's model and
``client --model`` reaches the second model's worker, whose tokens are its own."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.services.conftest import NUM_KV_BLOCKS, up_no_ray

OTHER = "tiny-qwen2"
PROMPT = "The capital of France"


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *argv], capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def two_models(tiny_llama_dir: Path, tiny_model_dirs: dict[str, Path]) -> Iterator[str]:
    """``up --no-ray`` colocated: one worker of the tiny llama, one of the tiny qwen2."""
    extra = json.dumps([{"name": OTHER, "model": str(tiny_model_dirs["qwen2"])}])
    with up_no_ray(
        "--model", str(tiny_llama_dir), "--extra-models", extra, "--mode", "colocated",
        "--num-prefill-workers", "0", "--dtype", "float32",
        "--num-kv-blocks", str(NUM_KV_BLOCKS),
    ) as target:  # fmt: skip
        yield target


def test_each_model_is_served_by_its_own_worker(
    two_models: str, tiny_llama_dir: Path, tiny_model_dirs: dict[str, Path]
) -> None:
    status = _cli("status", "--target", two_models, "--json")
    assert status.returncode == 0, status.stderr
    reported = json.loads(status.stdout)
    assert reported["models"] == [str(tiny_llama_dir), OTHER]
    served = sorted(w["info"]["served_model_name"] for w in reported["workers"])
    assert served == sorted([str(tiny_llama_dir), OTHER])

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for model, model_dir in [("", tiny_llama_dir), (OTHER, tiny_model_dirs["qwen2"])]:
        llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)
        want = llm.generate([llm.tokenizer.encode(PROMPT)], params)[0].token_ids
        reply = _cli(
            "client", PROMPT, "--target", two_models, "--model", model,
            "--max-tokens", "8", "--ignore-eos", "--json",
        )  # fmt: skip
        assert reply.returncode == 0, reply.stderr
        assert json.loads(reply.stdout)["token_ids"] == want
