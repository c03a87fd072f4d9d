"""transformers arm of ``bench_engine``: the naive static-batching baseline.

Prompts run in their given order in static batches of ``hf_batch_size``, left-padded, through
``generate(do_sample=False)``. EOS is disabled in the generation config (``eos_token_id=None``)
instead of using ``min_new_tokens``: ``min_new_tokens`` masks EOS logits and so changes
greedy ids, whereas ``ignore_eos`` in vLLM/splitserve lets EOS be generated and continues.
TTFT: a streamer stamps the first generated token of each batch (``generate`` calls
``streamer.put`` once with the prompt, then once per step); every request in a batch gets
that stamp, measured from the common start of the run.
"""

from __future__ import annotations

import time
from typing import Any

from loadtest.bench.arm_protocol import ArmJob, ArmResult, RequestTimeline, arm_main


def _pad_token_id(model: Any) -> int:
    for value in (model.generation_config.pad_token_id, model.config.pad_token_id):
        if isinstance(value, int):
            return value
    return 0


def run(job: ArmJob) -> ArmResult:
    """Load with ``AutoModelForCausalLM`` and generate every prompt in static batches."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    class FirstTokenStamp(BaseStreamer):
        """Calls ``on_first_token`` when the first generated token of the batch arrives."""

        def __init__(self, on_first_token: Any) -> None:
            self._calls = 0
            self._on_first_token = on_first_token

        def put(self, value: Any) -> None:
            self._calls += 1
            if self._calls == 2:  # call 1 carries the prompt ids
                self._on_first_token()

        def end(self) -> None:
            pass

    torch.set_num_threads(job.threads)
    load_start_s = time.perf_counter()
    device = torch.device(job.device)
    model = AutoModelForCausalLM.from_pretrained(job.model_dir, dtype=getattr(torch, job.dtype))
    model.to(device).eval()
    load_s = time.perf_counter() - load_start_s

    generation_config = model.generation_config
    pad_token_id = _pad_token_id(model)
    generation_config.eos_token_id = None
    generation_config.pad_token_id = pad_token_id
    generation_config.do_sample = False
    generation_config.max_new_tokens = job.output_tokens
    generation_config.min_new_tokens = None

    prompts = job.prompt_token_ids
    output_token_ids: list[list[int]] = []
    timeline = RequestTimeline(len(prompts))
    timeline.start()
    for first in range(0, len(prompts), job.hf_batch_size):
        indices = range(first, min(first + job.hf_batch_size, len(prompts)))
        width = max(len(prompts[i]) for i in indices)
        input_ids = torch.full((len(indices), width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(indices), width), dtype=torch.long)
        for row, i in enumerate(indices):
            input_ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            attention_mask[row, width - len(prompts[i]) :] = 1

        def stamp_batch(batch: range = indices) -> None:
            for i in batch:
                timeline.mark(i, finished=False)

        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=generation_config,
                streamer=FirstTokenStamp(stamp_batch),
            )
        for i in indices:
            timeline.mark(i, finished=True)
        output_token_ids.extend(out[:, width:].tolist())
    return timeline.result(
        "transformers",
        transformers.__version__,
        load_s,
        output_token_ids,
        settings={
            "hf_batch_size": job.hf_batch_size,
            "attn_implementation": model.config._attn_implementation,
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "device": str(device),
        },
    )


if __name__ == "__main__":
    arm_main(run)
