"""``VLLMEngine``: vLLM's engine core behind splitserve's ``EngineBackend``.

vLLM runs in the worker's process: its ``EngineCore`` (scheduler, KV cache manager, structured
outputs) is built and stepped on the worker's engine thread, exactly where the native engine
runs, and its model executor is in-process at tensor parallel size 1 (vLLM's multiprocess
executor beyond). vLLM's ``InputProcessor`` validates each request as ``vllm serve`` would.
The worker streams token ids only; the router detokenizes and matches stop strings for both
engines, so vLLM's output processor is not used; vLLM's own metrics are fed from the core's
outputs as its output handler feeds them (``metrics.py``).

KV moves between workers through ``SplitserveConnector`` (``connector.py``): vLLM keeps a
prefilled request's blocks for the worker's KV transfer backend to serve, and waits for the
blocks a decode worker's puller fills. Not yet behind this engine (docs/engines.md):
``set_paused`` (a slow reader's tokens are buffered).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from engine.backend import EngineInfo
from engine.block_hash import BlockHash
from engine.block_pool import KVCacheEvent, KVMedium
from engine.config import EngineConfig
from engine.constraint import Constraint
from engine.cpu_isa import resolve_isa
from engine.cpu_tuning import place_engine_threads
from engine.kv_cache_spec import KVCacheSpec
from engine.lora.names import parse_lora_modules
from engine.lora.registry import LoraRegistry
from engine.outputs import RequestOutput
from engine.request_limits import check_cache_salt
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import DuplicateRequestError
from engine.scheduler_output import KVLoad
from engine.stats import EngineStats
from engine.vllm_engine.args import engine_args, prepare_process_env, require_vllm
from engine.vllm_engine.connector import attach, layer_major_cache
from engine.vllm_engine.convert import prompt_token_logprobs, sampling_params, token_logprobs
from engine.vllm_engine.events import EventCollector, EventTranslator
from engine.vllm_engine.lora import VLLMAdapterLoader
from engine.vllm_engine.metrics import VLLMStatLogger

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _RequestState:
    """What a request's outputs report beyond vLLM's per-step deltas."""

    prompt_token_ids: list[int]
    token_ids: list[int]  # given (sampled elsewhere) and generated so far
    logprobs: list[TokenLogprobs] | None
    arrival_time_s: float
    # With prompt_logprobs: the prompt's entries so far, until the first token reports them.
    prompt_logprobs: list[TokenLogprobs] | None = None
    first_token_time_s: float | None = None
    scheduled_time_s: float | None = None
    num_cached_tokens: int = 0
    lora_name: str = ""


class VLLMEngine:
    """One vLLM engine core, driven through ``EngineBackend`` (see ``engine.backend``).

    Built on the engine thread; every method but the properties runs there. Request ids are
    the workers' own (vLLM's random suffixing is not applied), so aborts and outputs match.
    """

    def __init__(self, config: EngineConfig) -> None:
        require_vllm()
        prepare_process_env()
        from vllm.renderers.registry import renderer_from_config
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.engine.input_processor import InputProcessor
        from vllm.v1.executor import Executor

        # In its own process vLLM binds threads itself; in ours it keeps the pool it finds.
        place_engine_threads(config.cpu_cores, config.num_threads)
        args = engine_args(config, cuda=torch.cuda.is_available())
        self._channel = attach(args)
        vllm_config = args.create_engine_config()
        self._core = EngineCore(vllm_config, Executor.get_class(vllm_config), log_stats=True)
        self._inputs = InputProcessor(vllm_config, renderer_from_config(vllm_config))
        self._stat_logger = VLLMStatLogger(vllm_config)
        self._supported_tasks = self._core.get_supported_tasks()
        scheduler: Any = self._core.scheduler
        self._scheduler = scheduler
        self._last_num_scheduled_tokens = 0
        schedule = scheduler.schedule

        def schedule_and_count(*args: Any, **kwargs: Any) -> Any:
            output = schedule(*args, **kwargs)
            self._last_num_scheduled_tokens = output.total_num_scheduled_tokens
            if self._grammar_replays:
                for new_request in output.scheduled_new_reqs:
                    self._replay_grammar(new_request.req_id)
            return output

        scheduler.schedule = schedule_and_count
        self._events = EventCollector()
        if getattr(scheduler, "kv_event_publisher", None) is not None:
            scheduler.kv_event_publisher = self._events
        model_config = vllm_config.model_config
        block_size = vllm_config.cache_config.block_size
        self._kv_cache: torch.Tensor | None = None
        self._kv_cache_spec: KVCacheSpec | None = None
        if self._channel is not None:
            cache = layer_major_cache(self._channel.kv_caches, block_size)
            if isinstance(cache, str):
                logger.warning("vLLM engine: KV stays on this worker: %s", cache)
            else:
                self._kv_cache, self._kv_cache_spec = cache
        self._translator = EventTranslator(block_size)
        self._states: dict[str, _RequestState] = {}
        # Constrained requests given tokens sampled elsewhere: their grammar must accept those
        # tokens before it masks the next one.
        self._grammar_replays: dict[str, list[int]] = {}
        self._num_preemptions = 0
        self.on_constraint_compiled: Callable[[], object] | None = None
        device_type = torch.device(vllm_config.device_config.device or "cpu").type
        self._info = EngineInfo(
            served_model_name=config.served_model_name or config.model,
            vocab_size=model_config.get_vocab_size(),
            max_model_len=model_config.max_model_len,
            block_size=block_size,
            dtype=str(model_config.dtype).removeprefix("torch."),
            cpu_isa=resolve_isa("auto").value if device_type == "cpu" else "",
            kernels=f"vLLM {_vllm_version()} ({device_type})",
        )
        lora_config = vllm_config.lora_config
        # vLLM keeps up to --max-cpu-loras adapters (default: --max-loras); past that it would
        # evict one from memory and reload it from disk at its next request.
        max_loaded = 0
        if lora_config is not None:
            max_loaded = lora_config.max_cpu_loras or lora_config.max_loras
        self._adapters = VLLMAdapterLoader(self._core)
        self._loras = LoraRegistry(self._adapters, lora_config is not None, max_loaded)
        for name, path in parse_lora_modules(config.lora_modules):
            self._loras.load(name, path)
        logger.info("vLLM engine ready: %s", self._info.kernels)

    # ----------------------------------------------------------------------------- facts
    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def kv_cache(self) -> torch.Tensor | None:
        """vLLM's own cache, viewed layer-major (``KVLayout.VLLM_CPU``); None when its KV
        cannot move (logged at load: see ``connector.attach`` and ``layer_major_cache``)."""
        return self._kv_cache

    @property
    def kv_cache_spec(self) -> KVCacheSpec | None:
        return self._kv_cache_spec

    @property
    def metrics(self) -> CollectorRegistry:
        """vLLM's own ``vllm:`` metrics of this engine (``metrics.VLLMStatLogger``)."""
        return self._stat_logger.registry

    # ----------------------------------------------------------------------------- requests
    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        output_token_ids: Sequence[int] = (),
        num_external_tokens: int = 0,
        hold_kv: bool = False,
        cache_salt: str = "",
        priority: int = 0,
        lora_name: str = "",
    ) -> None:
        """Validate through vLLM's input processor and queue. Tokens sampled elsewhere
        (``output_token_ids``: a resumed stream) extend the prompt and count towards
        ``max_tokens``: the continuation is the same for greedy decoding."""
        from vllm.inputs.engine import tokens_input

        if (hold_kv or num_external_tokens) and self._kv_cache is None:
            field_name = "hold_kv" if hold_kv else "num_external_tokens"
            raise ValueError(f"{field_name}: this worker's vLLM engine moves no KV (see its log)")
        if num_external_tokens > len(prompt_token_ids):
            raise ValueError(
                f"num_external_tokens: {num_external_tokens} is more than the prompt's "
                f"{len(prompt_token_ids)} tokens"
            )
        lora_request = None
        if lora_name:
            self._loras.block_key(lora_name)  # ValueError naming it unless loaded
            lora_request = self._adapters.request(lora_name)
        if req_id in self._states:
            raise DuplicateRequestError(f"request_id {req_id!r} is already in flight")
        if len(output_token_ids) >= params.max_tokens:
            raise ValueError(
                f"output_token_ids: {len(output_token_ids)} tokens given, max_tokens is "
                f"{params.max_tokens}"
            )
        check_cache_salt(cache_salt)
        prompt = [*prompt_token_ids, *output_token_ids]
        request = self._inputs.process_inputs(
            req_id,
            tokens_input(prompt, cache_salt=cache_salt or None),
            sampling_params(params, len(output_token_ids)),
            self._supported_tasks,
            lora_request=lora_request,
            priority=priority,
        )
        if self._channel is not None:
            self._channel.add(req_id, num_external_tokens, hold_kv)
        if params.constraint is not None and output_token_ids:
            self._grammar_replays[req_id] = list(output_token_ids)
        self._core.add_request(*self._core.preprocess_add_request(request))
        self._stat_logger.request_added(request)
        self._states[req_id] = _RequestState(
            prompt_token_ids=list(prompt_token_ids),
            token_ids=list(output_token_ids),
            logprobs=[] if params.logprobs is not None else None,
            arrival_time_s=time.perf_counter(),
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
            lora_name=lora_name,
        )

    def abort_requests(self, req_ids: Iterable[str]) -> list[RequestOutput]:
        live = [req_id for req_id in req_ids if req_id in self._states]
        if not live:
            return []
        for req_id in live:
            self._grammar_replays.pop(req_id, None)
            if self._channel is not None:
                self._channel.abort(req_id)
            self._stat_logger.request_aborted(req_id)
        self._core.abort_requests(live)
        return [
            self._report(req_id, self._states[req_id], [], None, finish_reason="abort")
            for req_id in live
        ]

    def set_paused(self, req_id: str, paused: bool) -> None:
        """vLLM has no per-request pause: a slow reader's tokens stay buffered in its stream."""

    async def prepare_constraint(self, constraint: Constraint) -> None:
        """vLLM compiles grammars itself, off its step loop, while the request waits."""

    def _replay_grammar(self, req_id: str) -> None:
        """Advance a constrained request's grammar past the tokens it was given (a resumed
        stream, or a prefill worker's first token), as it would have advanced had it sampled
        them here. vLLM schedules the request only once its grammar is compiled, and samples
        it after this, in the same step."""
        token_ids = self._grammar_replays.pop(req_id, None)
        if token_ids is None:
            return
        request = self._scheduler.requests.get(req_id)
        structured = None if request is None else request.structured_output_request
        grammar = None if structured is None else structured.grammar
        if grammar is None or isinstance(grammar, Exception):
            return
        if not grammar.accept_tokens(req_id, token_ids):
            logger.warning("req_id=%s: the tokens it was given break its constraint", req_id)

    # ----------------------------------------------------------------------------- stepping
    def step(self) -> list[RequestOutput]:
        self._last_num_scheduled_tokens = 0
        outputs_by_client, model_executed = self._core.step_fn()
        self._core.post_step(model_executed)
        core_outputs = (outputs_by_client or {}).get(0)
        if core_outputs is None:
            return []
        self._stat_logger.record(core_outputs)
        now_s = time.perf_counter()
        return [
            self._output(output, now_s)
            for output in core_outputs.outputs
            if output.request_id in self._states
        ]

    def _output(self, output: Any, now_s: float) -> RequestOutput:
        from vllm.v1.engine import EngineCoreEventType

        state = self._states[output.request_id]
        for event in output.events or ():
            if event.type == EngineCoreEventType.SCHEDULED and state.scheduled_time_s is None:
                state.scheduled_time_s = now_s
            elif event.type == EngineCoreEventType.PREEMPTED:
                self._num_preemptions += 1
        if output.prefill_stats is not None:
            state.num_cached_tokens = output.prefill_stats.num_cached_tokens
        new_token_ids = list(output.new_token_ids)
        if new_token_ids and state.first_token_time_s is None:
            state.first_token_time_s = now_s
        state.token_ids += new_token_ids
        new_logprobs = None
        if state.logprobs is not None and output.new_logprobs is not None:
            new_logprobs = token_logprobs(output.new_logprobs)
            state.logprobs += new_logprobs
        prompt_logprobs = None
        if state.prompt_logprobs is not None:
            if output.new_prompt_logprobs_tensors is not None:
                state.prompt_logprobs += prompt_token_logprobs(output.new_prompt_logprobs_tensors)
            if new_token_ids:
                # vLLM's prompt is the given tokens too: the client's ends before them.
                prompt_logprobs = state.prompt_logprobs[: len(state.prompt_token_ids) - 1]
                state.prompt_logprobs = None
        finish_reason = None if output.finish_reason is None else str(output.finish_reason)
        return self._report(
            output.request_id,
            state,
            new_token_ids,
            new_logprobs,
            finish_reason=finish_reason,
            stop_reason=output.stop_reason,
            prompt_logprobs=prompt_logprobs,
            error="vLLM failed this request (see the worker's log)"
            if finish_reason == "error"
            else None,
        )

    def _report(
        self,
        req_id: str,
        state: _RequestState,
        new_token_ids: list[int],
        new_logprobs: list[TokenLogprobs] | None,
        *,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
        error: str | None = None,
        prompt_logprobs: list[TokenLogprobs] | None = None,
    ) -> RequestOutput:
        """``req_id``'s output for this step; a finished one carries the cumulative token ids
        and logprobs, and the request is forgotten."""
        finished = finish_reason is not None
        if finished:
            del self._states[req_id]
            self._grammar_replays.pop(req_id, None)
        return RequestOutput(
            req_id=req_id,
            prompt_token_ids=state.prompt_token_ids,
            token_ids=state.token_ids if finished else [],
            new_token_ids=new_token_ids,
            text="",
            delta_text="",
            finished=finished,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_cached_tokens=state.num_cached_tokens,
            logprobs=state.logprobs if finished else None,
            arrival_time_s=state.arrival_time_s,
            first_token_time_s=state.first_token_time_s,
            scheduled_time_s=state.scheduled_time_s,
            new_logprobs=new_logprobs,
            error=error,
            prompt_logprobs=prompt_logprobs,
        )

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or transfers to report; not kept blocks alone (vLLM's own
        ``has_requests`` counts those, so its engine would step while a lease lasts)."""
        scheduler = self._scheduler
        reports = self._channel is not None and self._channel.has_reports()
        return bool(scheduler.has_unfinished_requests() or scheduler.finished_req_ids or reports)

    @property
    def last_num_scheduled_tokens(self) -> int:
        return self._last_num_scheduled_tokens

    @property
    def lora_adapters(self) -> dict[str, str]:
        """The LoRA adapters a request may name, with their block keys (``lora.py``)."""
        return self._loras.block_keys

    def load_lora_adapter(self, name: str, path: str) -> None:
        self._loras.load(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        self._loras.unload(name, (state.lora_name for state in self._states.values()))

    def stats(self) -> EngineStats:
        scheduler = self._scheduler
        pool = scheduler.kv_cache_manager.block_pool
        num_running, num_waiting = scheduler.get_request_counts()
        queued_tokens = sum(r.num_tokens - r.num_computed_tokens for r in scheduler.waiting)
        # vLLM's pool keeps block 0 as its null block, never free and never used by a request.
        num_usable_blocks = pool.num_gpu_blocks - 1
        return EngineStats(
            num_running=num_running,
            num_waiting=num_waiting,
            num_waiting_for_kv=0 if self._channel is None else self._channel.num_loading,
            num_held_kv=0 if self._channel is None else self._channel.num_held,
            num_total_blocks=num_usable_blocks,
            num_used_blocks=num_usable_blocks - pool.get_num_free_blocks(),
            num_cached_blocks=self._translator.num_live_blocks,
            num_queued_prefill_tokens=queued_tokens,
            num_preemptions=self._num_preemptions,
        )

    # ----------------------------------------------------------------------------- prefix cache
    def take_kv_cache_events(self) -> list[KVCacheEvent]:
        return self._translator.translate(self._events.take())

    def prefix_cache_blocks(self) -> dict[BlockHash, KVMedium]:
        return dict.fromkeys(self._translator.live_block_hashes(), KVMedium.CACHE)

    # ----------------------------------------------------------------------------- KV transfer
    def holds_kv(self, req_id: str) -> bool:
        return bool(self.held_kv_block_ids(req_id))

    def held_kv_block_ids(self, req_id: str) -> list[int]:
        return [] if self._channel is None else self._channel.held_block_ids(req_id)

    def release_held_kv(self, req_id: str) -> bool:
        """vLLM frees the blocks at the next step (``has_unfinished_requests`` says so)."""
        return self._channel is not None and self._channel.release(req_id)

    def pin_prefix(
        self,
        pin_id: str,
        prompt_token_ids: Sequence[int],
        max_blocks: int,
        *,
        cache_salt: str = "",
        lora_name: str = "",
    ) -> list[int]:
        """Never pins: vLLM's scheduler owns its blocks' references, and its connector sees a
        request's blocks only while the request runs. A vLLM worker is no peer source."""
        return []

    def take_kv_loads(self) -> list[KVLoad]:
        return [] if self._channel is None else self._channel.take_loads()

    def finish_kv_load(self, req_id: str, success: bool) -> None:
        """vLLM runs the request at the next step, on the loaded blocks or (failed)
        recomputing the prompt past its own prefix cache."""
        if self._channel is not None:
            self._channel.finish_load(req_id, success)


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)
