"""splitserve arm of ``bench_engine``: ``engine.LLM.generate_stream`` over all prompts at once.

Each streamed ``RequestOutput`` is mapped back to its prompt by ``prompt_token_ids`` (the
workload guarantees distinct prompts) the first time its ``req_id`` is seen; the first item
carrying ``new_token_ids`` stamps the request's first token, the ``finished`` item its end.
"""

from __future__ import annotations

import time

from loadtest.bench.arm_protocol import ArmJob, ArmResult, RequestTimeline, arm_main


def run(job: ArmJob) -> ArmResult:
    """Load ``engine.LLM`` and stream every prompt greedily with ignore_eos."""
    import torch

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(job.threads)
    speculative = {}
    if job.num_speculative_tokens is not None:
        speculative["num_speculative_tokens"] = job.num_speculative_tokens
    load_start_s = time.perf_counter()
    llm = LLM(
        model=job.model_dir,
        dtype=job.dtype,
        kv_cache_dtype=job.kv_cache_dtype,
        device=job.device,
        cpu_isa=job.cpu_isa,
        max_num_seqs=job.max_num_seqs,
        max_num_batched_tokens=job.max_num_batched_tokens,
        load_format=job.load_format,
        **speculative,
    )
    load_s = time.perf_counter() - load_start_s

    params = SamplingParams(max_tokens=job.output_tokens, temperature=0.0, ignore_eos=True)
    prompts = job.prompt_token_ids
    index_of_prompt = {tuple(p): i for i, p in enumerate(prompts)}
    index_of_req: dict[str, int] = {}
    output_token_ids: list[list[int]] = [[] for _ in prompts]
    timeline = RequestTimeline(len(prompts))
    timeline.start()
    for output in llm.generate_stream(prompts, params):
        index = index_of_req.get(output.req_id)
        if index is None:
            index = index_of_prompt[tuple(output.prompt_token_ids)]
            index_of_req[output.req_id] = index
        if output.new_token_ids or output.finished:
            timeline.mark(index, output.finished)
        if output.finished:
            output_token_ids[index] = list(output.token_ids)
    return timeline.result(
        "splitserve",
        _version(),
        load_s,
        output_token_ids,
        settings={
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "device": str(llm.engine.device),
            "kernels": llm.engine.kernels.describe(),
            "num_speculative_tokens": llm.engine.config.num_speculative_tokens,
            "draft_tokens": llm.engine.scheduler.num_draft_tokens,
            "accepted_draft_tokens": llm.engine.scheduler.num_accepted_tokens,
        },
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("splitserve")
    except PackageNotFoundError:
        return "source"


if __name__ == "__main__":
    arm_main(run)
