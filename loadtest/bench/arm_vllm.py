"""vLLM arm of ``bench_engine``; runs under the vLLM venv's interpreter.

Drives ``LLM.llm_engine`` step by step (the same loop ``LLM.generate`` runs) with
``RequestOutputKind.DELTA`` so each request's first token is stamped when the front end
receives it. Environment (``VLLM_CPU_KVCACHE_SPACE``, ``VLLM_CPU_OMP_THREADS_BIND``) is set
by the parent.
"""

from __future__ import annotations

import os
import time

from loadtest.bench.arm_protocol import ArmJob, ArmResult, RequestTimeline, arm_main

_RECORDED_ENV = (
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "LD_PRELOAD",
)


def run(job: ArmJob) -> ArmResult:
    """Load the model in vLLM, run every prompt greedily with ignore_eos, time it."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    # vLLM's ngram drafts with splitserve's lookup defaults (n-grams of 2 to 4 tokens).
    speculative = {}
    if job.num_speculative_tokens:
        speculative["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": job.num_speculative_tokens,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        }
    load_start_s = time.perf_counter()
    llm = LLM(
        model=job.model_dir,
        dtype=job.dtype,
        kv_cache_dtype=job.kv_cache_dtype,
        enforce_eager=True,
        max_num_seqs=job.max_num_seqs,
        max_num_batched_tokens=job.max_num_batched_tokens,
        max_model_len=job.max_model_len,
        seed=job.seed,
        **speculative,
    )
    load_s = time.perf_counter() - load_start_s

    params = SamplingParams(
        max_tokens=job.output_tokens,
        temperature=0.0,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    engine = llm.llm_engine
    num_requests = len(job.prompt_token_ids)
    output_token_ids: list[list[int]] = [[] for _ in range(num_requests)]
    timeline = RequestTimeline(num_requests)
    timeline.start()
    for index, prompt in enumerate(job.prompt_token_ids):
        engine.add_request(str(index), TokensPrompt(prompt_token_ids=prompt), params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            index = int(output.request_id)
            new_token_ids = output.outputs[0].token_ids
            output_token_ids[index].extend(new_token_ids)
            if new_token_ids or output.finished:
                timeline.mark(index, output.finished)
    return timeline.result(
        "vllm",
        vllm.__version__,
        load_s,
        output_token_ids,
        settings={
            "enforce_eager": True,
            "speculative_config": speculative.get("speculative_config"),
            "env": {k: os.environ[k] for k in _RECORDED_ENV if k in os.environ},
        },
    )


if __name__ == "__main__":
    arm_main(run)
