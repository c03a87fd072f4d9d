"""The reference of the vLLM engine's tests: vLLM run offline (``vllm.LLM``) on the same model
and settings, in a child process (vLLM sets process-wide threads and CPU affinity, which the
test process must not inherit).

``python -m tests.services.vllm_offline JOB_JSON`` (``ignore_eos`` and ``metrics`` besides
``vllm.LLM``'s arguments) prints one JSON line: ``outputs``, per prompt the greedy
``token_ids`` and ``text``; with ``metrics``, also ``metrics``: vLLM's Prometheus exposition
after the run (its stat logger on). A prompt is a list of token ids, a text (tokenized by vLLM)
or a list of chat messages (``{"role": ..., "content": ...}``, vLLM's chat template).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parents[2]


def offline_greedy(
    model_dir: Path, prompts: list[Any], max_tokens: int, **llm_kwargs: Any
) -> list[dict[str, Any]]:
    """Greedy outputs of offline vLLM for ``prompts`` (``llm_kwargs``: ``vllm.LLM``'s)."""
    outputs: list[dict[str, Any]] = _run_offline(model_dir, prompts, max_tokens, llm_kwargs)[
        "outputs"
    ]
    return outputs


def offline_metrics(
    model_dir: Path, prompts: list[Any], max_tokens: int, **llm_kwargs: Any
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """vLLM's own metrics after running ``prompts`` greedy offline, one at a time, as
    {(sample name, sorted labels): value}."""
    text = _run_offline(model_dir, prompts, max_tokens, {**llm_kwargs, "metrics": True})["metrics"]
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _run_offline(
    model_dir: Path, prompts: list[Any], max_tokens: int, llm_kwargs: dict[str, Any]
) -> dict[str, Any]:
    job = {"model": str(model_dir), "prompts": prompts, "max_tokens": max_tokens, **llm_kwargs}
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-m", "tests.services.vllm_offline", json.dumps(job)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"offline vLLM failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    from prometheus_client import REGISTRY, generate_latest
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(sys.argv[1])
    prompts = job.pop("prompts")
    max_tokens = job.pop("max_tokens")
    ignore_eos = job.pop("ignore_eos", False)
    metrics = job.pop("metrics", False)
    llm = LLM(**job, disable_log_stats=not metrics)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    outputs = []
    for prompt in prompts:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            outputs += llm.chat(prompt, params)
        else:
            one = prompt if isinstance(prompt, str) else TokensPrompt(prompt_token_ids=prompt)
            outputs += llm.generate([one], params)
    results = [
        {"token_ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text} for o in outputs
    ]
    done: dict[str, Any] = {"outputs": results}
    if metrics:
        done["metrics"] = generate_latest(REGISTRY).decode()
    print(json.dumps(done))


if __name__ == "__main__":
    main()
