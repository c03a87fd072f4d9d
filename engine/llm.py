"""Offline entry point: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from typing import Any, cast

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """Run batches of prompts through one engine in this process.

    ``prompts`` are strings (tokenized with the model's tokenizer, special tokens added) or
    lists of token ids. Keyword arguments are ``EngineConfig`` fields.
    """

    def __init__(self, model: str, **engine_kwargs: Any) -> None:
        self._init(EngineConfig(model=model, **engine_kwargs))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm._init(config)
        return llm

    def _init(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._counter = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_name: str | Sequence[str] = "",
    ) -> list[RequestOutput]:
        """Generate to completion; outputs are in prompt order, each with its prompt logprobs
        when asked for (the engine reports them with the first token). ``lora_name``: the
        loaded adapter every prompt runs with, or one per prompt ("": the base model)."""
        final: dict[str, RequestOutput] = {}
        prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        order = self._add(prompts, params, lora_name)
        for out in self._run():
            if out.prompt_logprobs is not None:
                prompt_logprobs[out.req_id] = out.prompt_logprobs
            if out.finished:
                final[out.req_id] = out
        return [
            dataclasses.replace(final[req_id], prompt_logprobs=prompt_logprobs[req_id])
            if req_id in prompt_logprobs
            else final[req_id]
            for req_id in order
        ]

    def generate_stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield each request's output every step it advances; the last one has ``finished``."""
        self._add(prompts, params)
        yield from self._run()

    def chat(
        self, messages: Sequence[dict[str, str]], params: SamplingParams | None = None
    ) -> RequestOutput:
        """Generate a reply to one conversation rendered with the model's chat template."""
        return self.generate([self.tokenizer.encode_chat(messages)], params)[0]

    def _add(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
        lora_name: str | Sequence[str] = "",
    ) -> list[str]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [cast(Prompt, prompts)]
        prompts = cast(Sequence[Prompt], prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        adapters = [lora_name] * len(prompts) if isinstance(lora_name, str) else lora_name
        if len(adapters) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(adapters)} lora_name values")
        req_ids = []
        for prompt, p, adapter in zip(prompts, params, adapters, strict=True):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            req_id = str(next(self._counter))
            self.engine.add_request(req_id, ids, p, lora_name=adapter)
            req_ids.append(req_id)
        return req_ids

    def _run(self) -> Iterator[RequestOutput]:
        engine = self.engine
        while engine.has_unfinished_requests():
            yield from engine.step()
            if not engine.last_num_scheduled_tokens:  # the rest wait for their grammar
                engine.wait_for_grammars()
