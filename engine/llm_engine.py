"""The engine loop: schedule → run the model → sample → update → detokenize.

One ``step()`` is one forward pass over a mixed batch. Callers (the offline ``LLM``, the
prefill and decode workers) own the loop and the threading; the engine itself is single-threaded.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from engine.backend import EngineInfo
from engine.block_hash import BlockHash, block_extra_key
from engine.block_pool import KVCacheEvent, KVMedium
from engine.config import EngineConfig, SchedulingPolicy
from engine.constraint import Constraint
from engine.cpu_isa import CpuIsa, host_isa, resolve_isa
from engine.cpu_tuning import BuildThread, keep_freed_memory_in_heap, place_engine_threads
from engine.detokenizer import IncrementalDetokenizer
from engine.executor import NativeExecutor, build_executor
from engine.grammar_admission import GrammarAdmission
from engine.grammar_pool import GrammarPool
from engine.kv_cache_manager import KVCacheManager
from engine.kv_cache_spec import KVCacheSpec
from engine.kv_offload import build_offload
from engine.loader.models import resolve_model
from engine.lora.names import parse_lora_modules
from engine.lora.registry import LoraRegistry
from engine.model.kernel_plan import KernelPlan
from engine.model_runner import ModelRunner
from engine.moving_average import MovingAverage
from engine.ngram_proposer import NgramProposer
from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from engine.request_limits import check_cache_salt, check_request_limits
from engine.request_state import RequestState
from engine.resolve import resolve_device, resolve_dtype, resolve_kv_cache_dtype
from engine.sampler import Sampler, TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import DuplicateRequestError, Scheduler, SchedulerConfig
from engine.scheduler_output import KVLoad, ScheduledRequest, SchedulerOutput
from engine.stats import EngineStats, make_stats
from engine.structured_output import CompiledGrammar
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def _check_kv_capacity(num_kv_blocks: int, block_size: int, max_model_len: int) -> None:
    """Refuse to start when one request of ``max_model_len`` tokens cannot fit in the whole
    KV cache: it would preempt itself forever and block every request queued behind it."""
    capacity_tokens = num_kv_blocks * block_size
    if capacity_tokens < max_model_len:
        raise ValueError(
            f"the KV cache holds {capacity_tokens} tokens ({num_kv_blocks} blocks of "
            f"{block_size}), fewer than one request of max_model_len {max_model_len}: give it "
            f"more memory (--kv-cache-memory-gb, --num-kv-blocks) or lower --max-model-len"
        )


class LLMEngine:
    """A paged-KV, continuous-batching engine for one model on one device: the native
    ``EngineBackend``.

    Not thread-safe: call it from one thread only (a worker's engine thread), except for what
    is fixed at load (``kv_cache``, ``kv_cache_spec``, ``kernels`` and the plain attributes)
    and ``grammars``, which is thread-safe.

    A constrained request whose grammar is not compiled yet waits outside the scheduler while
    ``grammars`` compiles it on threads of its own; each ``step`` first hands the compiled ones
    to the scheduler (``engine.grammar_admission``; see ``add_request``).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        place_engine_threads(config.cpu_cores, config.num_threads)
        self.device = resolve_device(config.device)
        # Steps on CPU belong on this thread (see BuildThread); None on other devices.
        self.build_thread = BuildThread() if self.device.type == "cpu" else None
        if self.device.type == "cpu":
            keep_freed_memory_in_heap()
        cpu_isa = resolve_isa(config.cpu_isa)
        self.dtype = resolve_dtype(config.dtype, self.device, cpu_isa)
        if self.dtype == "float16" and self.device.type == "cpu":
            logger.warning("float16 matmuls are very slow on CPU; prefer bfloat16 or float32")
        elif (
            self.dtype == "bfloat16" and self.device.type == "cpu" and cpu_isa < CpuIsa.AVX512_BF16
        ):
            logger.warning(
                "bfloat16 is emulated below avx512_bf16 (level %s): expect float32 to be faster",
                cpu_isa.value,
            )
        self.model_dir = resolve_model(config.model, revision=config.revision)
        # The name clients see (WorkerInfo, Router.Status): --served-model-name, else --model.
        self.served_model_name = config.served_model_name or config.model
        self.tokenizer = Tokenizer(self.model_dir)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        self.sampler = Sampler(config.seed)
        self.executor = build_executor(
            config,
            self.model_dir,
            self.dtype,
            self.kv_cache_dtype,
            self.device,
            cpu_isa,
            self.sampler,
            self.tokenizer.eos_token_ids,
        )
        self.max_model_len = self.executor.max_model_len
        self.lora = LoraRegistry(self.executor, config.enable_lora, config.max_loras)
        for name, path in parse_lora_modules(config.lora_modules):
            self.lora.load(name, path)
        _check_kv_capacity(self.executor.num_kv_blocks, config.block_size, self.max_model_len)
        offload = None
        if config.kv_offload_gib and config.enable_prefix_caching:
            offload = build_offload(
                self.executor.kv_cache,
                self.executor.kv_cache_spec,
                config.kv_offload_gib,
                config.kv_offload_dir,
                Path(self.model_dir),
                self.dtype,
            )
        self.kv_cache_manager = KVCacheManager(
            self.executor.num_kv_blocks, config.block_size, config.enable_prefix_caching, offload
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                by_priority=config.scheduling_policy is SchedulingPolicy.PRIORITY,
            ),
            self.kv_cache_manager,
            proposer=(
                NgramProposer(
                    config.num_speculative_tokens,
                    config.prompt_lookup_min,
                    config.prompt_lookup_max,
                )
                if config.num_speculative_tokens
                else None
            ),
        )
        self.vocab_size = self.executor.vocab_size
        self.admission = GrammarAdmission(self.tokenizer, self.vocab_size, config.constraint_limits)
        self._states: dict[str, RequestState] = {}
        self._kv_loads: list[KVLoad] = []
        self.last_num_scheduled_tokens = 0
        self.prefill_s_per_token = MovingAverage()
        logger.info(
            "engine ready: model=%s dtype=%s kv_cache_dtype=%s device=%s pid=%d",
            self.model_dir,
            self.dtype,
            self.kv_cache_dtype,
            self.device,
            os.getpid(),
        )
        if self.executor.cpu_isa:
            logger.info(
                "CPU level %s (host %s, --cpu-isa %s); kernels: %s",
                self.executor.cpu_isa,
                host_isa().value,
                config.cpu_isa,
                self.executor.describe(),
            )
        else:
            logger.info("kernels: %s", self.executor.describe())

    # ----------------------------------------------------------------------------- requests
    def validate_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        output_token_ids: Sequence[int] = (),
    ) -> None:
        """Raise ``ValueError`` naming the field if the request cannot run on this engine."""
        check_request_limits(
            prompt_token_ids,
            params,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            output_token_ids=output_token_ids,
        )

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        output_token_ids: Sequence[int] = (),
        num_external_tokens: int = 0,
        hold_kv: bool = False,
        arrival_time_s: float | None = None,
        cache_salt: str = "",
        priority: int = 0,
        lora_name: str = "",
    ) -> None:
        """Queue a request.

        ``output_token_ids`` were sampled elsewhere (a prefill worker's first token); they count
        towards ``max_tokens`` and are not reported again. With ``num_external_tokens`` the
        first tokens' KV must be loaded (see ``take_kv_loads`` / ``finish_kv_load``) instead of
        computed. With ``hold_kv`` the blocks outlive the request until ``release_held_kv``.
        Requests share prefix-cache blocks only when their ``cache_salt`` and their LoRA adapter
        (``lora_name``, "" for none: a loaded one) are the same (both go into every block hash).

        A ``params.constraint`` starts the request's matcher, advanced over
        ``output_token_ids``. Its grammar compiles on ``grammars``' threads; the request waits
        outside the scheduler until it is done, and fails with ``finish_reason == "error"`` when
        it does not compile, or not within ``constraint_limits.compile_timeout_s``. When the
        grammar is compiled already (a cached one), everything is checked here: ``ValueError``
        if the constraint is over its size budget, does not compile or ``output_token_ids``
        break it.
        """
        self.validate_request(prompt_token_ids, params, output_token_ids)
        extra_key = self._block_extra_key(cache_salt, lora_name)
        request = Request(
            req_id=req_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_ids=self.tokenizer.eos_token_ids,
            block_size=self.config.block_size,
            arrival_time_s=arrival_time_s if arrival_time_s is not None else time.perf_counter(),
            num_external_tokens=num_external_tokens,
            hold_kv=hold_kv,
            output_token_ids=list(output_token_ids),
            extra_key=extra_key,
            lora_name=lora_name,
            priority=priority,
        )
        if req_id in self._states:
            raise DuplicateRequestError(f"request_id {req_id!r} is already in flight")
        if self.holds_kv(req_id):
            raise DuplicateRequestError(
                f"request_id {req_id!r} still holds its KV cache under a lease"
            )
        if self.admission.start(request):
            self.scheduler.add_request(request)
        detokenizer = None
        if self.config.detokenize:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer.backend, request.prompt_token_ids, params
            )
            if output_token_ids:
                detokenizer.update(output_token_ids)
                detokenizer.take_delta(False)
        self._states[req_id] = RequestState(
            request=request,
            detokenizer=detokenizer,
            logprobs=[] if params.logprobs is not None else None,
            num_reported_tokens=len(output_token_ids),
        )
        logger.debug("req_id=%s added: %d prompt tokens", req_id, len(prompt_token_ids))

    def _block_extra_key(self, cache_salt: str, lora_name: str) -> str:
        """What a request's block hashes carry besides its tokens: its salt and its adapter's
        key. ``ValueError`` naming the field for a bad salt or an adapter not loaded here."""
        check_cache_salt(cache_salt)
        return block_extra_key(cache_salt, self.lora.block_key(lora_name) if lora_name else "")

    @property
    def grammars(self) -> GrammarPool[CompiledGrammar]:
        """Where constraints compile, off this thread (``engine.grammar_pool``; thread-safe): a
        worker compiles one before adding its request, so that the request starts at once."""
        return self.admission.grammars

    @grammars.setter
    def grammars(self, pool: GrammarPool[CompiledGrammar]) -> None:
        self.admission.grammars = pool

    @property
    def on_constraint_compiled(self) -> Callable[[], object] | None:
        """Called on a compile thread when a held request's grammar is done (or failed): an
        engine loop idling between steps wakes up to admit it."""
        return self.admission.on_compiled

    @on_constraint_compiled.setter
    def on_constraint_compiled(self, callback: Callable[[], object] | None) -> None:
        self.admission.on_compiled = callback

    def wait_for_grammars(self) -> None:
        """Block until a held request's grammar is done or the earliest compile budget runs
        out; return at once when no request is held. What a caller that steps the engine in a
        loop does when a step scheduled nothing, instead of spinning."""
        self.admission.wait()

    def _admit_compiled(self) -> list[RequestOutput]:
        """Hand the held requests whose grammar compiled to the scheduler, in the order they
        were added; finish with an error those whose compile failed or ran out of time, and
        return their outputs."""
        ready, failed = self.admission.admit()
        for request in ready:
            try:
                self.scheduler.add_request(request)
            except ValueError as exc:
                request.error = str(exc)
                logger.warning("req_id=%s failed: %s", request.req_id, request.error)
                failed.append(request)
        outputs = []
        for request in failed:
            request.status = RequestStatus.FINISHED_ERROR
            outputs.append(self._states.pop(request.req_id).output([]))
        return outputs

    def abort_requests(self, req_ids: Iterable[str]) -> list[RequestOutput]:
        """Abort requests in any state (their grammar compiling included); their blocks are
        freed at once."""
        req_ids = list(req_ids)
        outputs = []
        for req_id in req_ids:
            if self.admission.discard(req_id) is not None:
                state = self._states.pop(req_id)
                state.request.status = RequestStatus.FINISHED_ABORTED
                outputs.append(state.output([]))
        finished = self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)
        return outputs + [self._states.pop(r.req_id).output([]) for r in finished]

    def set_paused(self, req_id: str, paused: bool) -> None:
        """Stop (or resume) scheduling running request ``req_id``, whose reader fell behind: it
        keeps its blocks and gets no new tokens, but may still be preempted. Unknown or finished
        ids are ignored; a request's pause ends when it finishes."""
        self.scheduler.set_paused(req_id, paused)

    def take_kv_loads(self) -> list[KVLoad]:
        """KV transfers the scheduler started since the last call (each reported once)."""
        loads, self._kv_loads = self._kv_loads, []
        return loads

    def finish_kv_load(self, req_id: str, success: bool) -> None:
        """Report the end of a transfer from ``take_kv_loads``; failure means recompute."""
        self.scheduler.finish_remote_kv(req_id, success)

    def release_held_kv(self, req_id: str) -> bool:
        """Free the blocks kept by a finished ``hold_kv`` request; False if it held none."""
        return self.scheduler.release_held_kv(req_id)

    def holds_kv(self, req_id: str) -> bool:
        """Whether finished ``hold_kv`` request ``req_id`` still keeps its blocks (until
        ``release_held_kv``). No side effects."""
        return req_id in self.scheduler.held_kv

    def held_kv_block_ids(self, req_id: str) -> list[int]:
        """Blocks a finished ``hold_kv`` request keeps, in token order ([] if none)."""
        if not self.holds_kv(req_id):
            return []
        return self.kv_cache_manager.get_block_ids(req_id)

    def pin_prefix(
        self,
        pin_id: str,
        prompt_token_ids: Sequence[int],
        max_blocks: int,
        *,
        cache_salt: str = "",
        lora_name: str = "",
    ) -> list[int]:
        """Hold the longest run (at most ``max_blocks``) of the prompt's full blocks this
        engine holds, in its cache or its second tier (loaded back), under ``pin_id`` until
        ``release_held_kv``; [] when it holds none, the salt is bad or the adapter is not
        loaded here (nothing is held then). ``DuplicateRequestError`` if
        ``pin_id`` is a live request's or holds KV here."""
        try:
            extra_key = self._block_extra_key(cache_salt, lora_name)
        except ValueError:
            return []
        request = Request(
            req_id=pin_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=SamplingParams(max_tokens=1),
            eos_token_ids=self.tokenizer.eos_token_ids,
            block_size=self.config.block_size,
            arrival_time_s=time.perf_counter(),
            hold_kv=True,
            extra_key=extra_key,
            lora_name=lora_name,
        )
        return self.scheduler.pin_cached_prefix(request, max_blocks)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished_requests > 0 or bool(self.admission)

    async def prepare_constraint(self, constraint: Constraint) -> None:
        """Compile ``constraint`` on ``grammars``' threads and wait for it (on the asyncio
        loop), so that the request carrying it is added with its grammar ready (a cache hit);
        ``ValueError`` naming the field when it is over its budget or does not compile."""
        await self.grammars.wait(constraint)

    # ----------------------------------------------------------------------------- adapters
    @property
    def lora_adapters(self) -> dict[str, str]:
        """The LoRA adapters a request may name, with their block keys (``EngineBackend``)."""
        return self.lora.block_keys

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at ``path`` as ``name`` from the next step; ``ValueError``
        saying why it cannot be (LoRA off, the name taken, every slot used, the files)."""
        self.lora.load(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving adapter ``name``; ``ValueError`` if it is not loaded or a request in
        flight uses it. Its cached blocks stay until evicted: a reload of other weights under
        the same name hashes differently (``LoraAdapter.block_key``)."""
        self.lora.unload(name, (state.request.lora_name for state in self._states.values()))

    def stats(self) -> EngineStats:
        return make_stats(self.scheduler, len(self.admission), self.prefill_s_per_token.value)

    @property
    def info(self) -> EngineInfo:
        """What this engine serves and how (``EngineBackend.info``)."""
        return EngineInfo(
            served_model_name=self.served_model_name,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            block_size=self.config.block_size,
            dtype=self.dtype,
            cpu_isa=self.executor.cpu_isa,
            kernels=self.executor.describe(),
        )

    # ----------------------------------------------------------------------------- KV cache
    @property
    def kv_cache(self) -> torch.Tensor:
        """The paged KV cache, one tensor laid out as ``kv_cache_spec`` says: what a KV transfer
        backend registers. Allocated once at load, so its storage never moves."""
        return self.executor.kv_cache

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """The layout of ``kv_cache`` (block shape, dtype, bytes per block)."""
        return self.executor.kv_cache_spec

    @property
    def metrics(self) -> None:
        """None: the worker computes the ``vllm:`` serving metrics from this engine's outputs."""
        return None

    @property
    def runner(self) -> ModelRunner | None:
        """The native model (tests and benchmarks reach into it); None on a simulated engine."""
        return self.executor.runner if isinstance(self.executor, NativeExecutor) else None

    @property
    def kernels(self) -> KernelPlan:
        """Which implementation runs each part of the model on this host (the native engine's;
        ``info.kernels`` describes any engine's)."""
        runner = self.runner
        if runner is None:
            raise AttributeError("a simulated engine runs no kernels")
        return runner.kernels

    def take_kv_cache_events(self) -> list[KVCacheEvent]:
        """Prefix-cache changes (blocks stored, removed, all cleared) since the last call, in
        order, each returned once: the engine keeps them until taken, so drain them every step."""
        return self.kv_cache_manager.take_events()

    def prefix_cache_blocks(self) -> dict[BlockHash, KVMedium]:
        """Every block a prefix hit can use now, and where it is: the state whose changes
        ``take_kv_cache_events`` reports. No side effects."""
        return self.kv_cache_manager.held_blocks()

    # ----------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one batch; return an output for every request that got a token or finished.

        Held requests whose grammar is done join the scheduler first (see ``add_request``). A
        failure confined to some requests (non-finite logits, an exception that a request
        raises on its own) finishes those with ``finish_reason == "error"`` and the rest of the
        batch goes on; ``EngineBrokenError`` means no request can run here any more.
        """
        if self.build_thread is not None:
            self.build_thread.check()
        outputs = self._admit_compiled()
        sched = self.scheduler.schedule()
        self._kv_loads.extend(sched.kv_loads)
        self.last_num_scheduled_tokens = sched.total_num_scheduled_tokens
        if sched.is_empty:
            return outputs
        start_s = time.perf_counter()
        sampled, errors = self.executor.run(sched.scheduled)
        # What a token of prefill costs here (steps with at least a block of prompt tokens).
        num_prompt_tokens = sum(s.num_new_tokens for s in sched.scheduled if not s.is_decode)
        if num_prompt_tokens >= self.config.block_size:
            seconds_per_token = (time.perf_counter() - start_s) / sched.total_num_scheduled_tokens
            self.prefill_s_per_token.add(seconds_per_token)
        outputs.extend(self._fail_requests(errors))
        self._keep_prompt_logprobs(sched.scheduled, sampled.prompt_logprobs, errors)
        if errors:
            sched = SchedulerOutput(
                scheduled=[s for s in sched.scheduled if s.request.req_id not in errors],
                preempted_req_ids=sched.preempted_req_ids,
                kv_loads=sched.kv_loads,
            )
        # Each sampling request's logprobs are its first row's (requests with drafts have none).
        row_counts = [s.num_sample_rows for s in sched.scheduled if s.num_sample_rows]
        first_rows = list(itertools.accumulate(row_counts, initial=0))[:-1]
        request_logprobs = [sampled.logprobs[i] for i in first_rows]
        updated, finished = self.scheduler.update_from_output(sched, sampled.sampled_token_ids)
        now = time.perf_counter()
        finished_ids = {r.req_id for r in finished}
        detokenize_errors: dict[str, str] = {}
        for request, logprobs in zip(updated, request_logprobs, strict=True):
            state = self._states[request.req_id]
            if state.first_token_time_s is None:
                state.first_token_time_s = now
            if state.logprobs is not None and logprobs is not None:
                state.logprobs.append(logprobs)
            try:
                stop = state.detokenize(request.req_id in finished_ids)
            except Exception as exc:  # confined to this request
                detokenize_errors[request.req_id] = f"detokenizing failed: {exc!r}"
                continue
            if stop is not None and request.req_id not in finished_ids:
                request.stop_reason = stop
                self.scheduler.finish_requests([request.req_id], RequestStatus.FINISHED_STOPPED)
            new_ids = request.output_token_ids[state.num_reported_tokens :]
            outputs.append(state.output(new_ids))
            if request.status.is_finished:
                del self._states[request.req_id]
        outputs.extend(self._fail_requests(detokenize_errors))
        if self.config.check_kv_integrity:
            self.kv_cache_manager.check_integrity()
        return outputs

    def _keep_prompt_logprobs(
        self,
        scheduled: list[ScheduledRequest],
        prompt_logprobs: dict[str, list[TokenLogprobs]],
        errors: dict[str, str],
    ) -> None:
        """Keep each request's new prompt logprobs until its first token is reported."""
        for item in scheduled:
            request = item.request
            if not item.prompt_logprob_positions or request.req_id in errors:
                continue
            request.num_prompt_logprob_positions = item.prompt_logprob_positions.stop
            state = self._states[request.req_id]
            if state.prompt_logprobs is None:
                state.prompt_logprobs = []
            state.prompt_logprobs.extend(prompt_logprobs[request.req_id])

    def _fail_requests(self, errors: dict[str, str]) -> list[RequestOutput]:
        """Finish the requests in ``errors`` with FINISHED_ERROR (their blocks leave the prefix
        cache) and return their final outputs."""
        if not errors:
            return []
        finished = self.scheduler.finish_requests(errors, RequestStatus.FINISHED_ERROR)
        outputs = []
        for request in finished:
            request.error = errors[request.req_id]
            logger.warning("req_id=%s failed in the engine: %s", request.req_id, request.error)
            outputs.append(self._states.pop(request.req_id).output([]))
        return outputs
