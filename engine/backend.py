"""The engine boundary: everything a serving worker needs from an engine, as one protocol.

The prefill and decode workers (``services/``) hold their engine as an ``EngineBackend`` and
touch nothing else of it (``tests/services/test_engine_boundary.py`` enforces that). The
native engine, ``engine.llm_engine.LLMEngine``, implements it; so must any other engine a
worker runs.

Threading. A worker builds its engine on its engine thread and steps it there
(``services/worker/engine_loop.py``). Unless a member says otherwise, call it on that thread
only, between steps. Members marked *any thread* are fixed at load or thread-safe.

Request life, as the workers drive it: ``add_request``; then each ``step`` returns an output
for every request that got tokens or finished, until its finished output. ``abort_requests``
ends requests in any state. A request added with ``hold_kv`` keeps its KV blocks after it
finishes, under a lease, until ``release_held_kv``; one added with ``num_external_tokens``
waits for those tokens' KV to arrive (``take_kv_loads``, then ``finish_kv_load``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from prometheus_client.registry import Collector

from engine.block_hash import BlockHash
from engine.block_pool import KVCacheEvent, KVMedium
from engine.constraint import Constraint
from engine.kv_cache_spec import KVCacheSpec
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler_output import KVLoad
from engine.stats import EngineStats


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What an engine serves and how, fixed at load (``WorkerInfo`` carries it to routers)."""

    served_model_name: str  # the name clients use: --served-model-name, else --model
    vocab_size: int
    max_model_len: int
    block_size: int  # tokens per KV block
    dtype: str  # the model's compute dtype, made concrete ("bfloat16", not "auto")
    cpu_isa: str  # the CPU level its kernels were chosen for; "" off CPU
    kernels: str  # which implementation runs each part of the model, in a line


class EngineBackend(Protocol):
    """One model on one engine, driven by one worker; see the module for threading."""

    # ----------------------------------------------------------------------------- facts
    @property
    def info(self) -> EngineInfo:
        """*Any thread.* What the engine serves; fixed at load."""

    @property
    def kv_cache(self) -> torch.Tensor | None:
        """*Any thread.* The paged KV cache memory a KV transfer backend registers, laid out
        as ``kv_cache_spec`` says; allocated once at load, so its storage never moves. None
        when this engine's KV cannot move between workers: its worker prefills every prompt
        itself, and a prefill worker cannot run it."""

    @property
    def kv_cache_spec(self) -> KVCacheSpec | None:
        """*Any thread.* The layout of ``kv_cache``: block shape, dtype, bytes per block (None
        with ``kv_cache``)."""

    @property
    def metrics(self) -> Collector | None:
        """*Any thread.* The engine's own ``vllm:`` serving metrics, collected at scrape time
        (vLLM: its stat logger's, as ``vllm serve`` exports them); None when the worker
        computes them from outputs and ``stats`` (``services.common.serving_metrics``)."""

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
        """Queue a request. ``output_token_ids`` were sampled elsewhere (a prefill worker's
        first token): they count towards ``max_tokens`` and are not reported again. The first
        ``num_external_tokens`` tokens' KV is loaded from a peer, not computed. With
        ``hold_kv`` the blocks outlive the request until ``release_held_kv``. Requests share
        prefix-cache blocks only under the same ``cache_salt`` and LoRA adapter (``lora_name``,
        one of ``lora_adapters``; "" for the base model). ``priority`` orders it under
        ``--scheduling-policy priority`` (lower first). ``ValueError`` naming the field
        when the request cannot run here; ``DuplicateRequestError`` (a ``ValueError``) when
        ``req_id`` is in flight or holds KV."""

    def abort_requests(self, req_ids: Iterable[str]) -> list[RequestOutput]:
        """End requests in any state, freeing their blocks at once; the finished outputs of
        those that were live (unknown ids are ignored)."""

    def set_paused(self, req_id: str, paused: bool) -> None:
        """Stop (or resume) giving running request ``req_id`` tokens: its reader fell behind.
        It keeps its blocks but may be preempted; unknown or finished ids are ignored."""

    async def prepare_constraint(self, constraint: Constraint) -> None:
        """*On the asyncio loop.* Compile ``constraint`` off the engine thread, so that the
        request that carries it starts at once; ``ValueError`` naming the field when it is
        over its budget (size or time) or does not compile."""

    on_constraint_compiled: Callable[[], object] | None
    """Called on a compile thread when a grammar a held request waits for is done (or failed):
    a loop idling between steps wakes up to admit it."""

    # ----------------------------------------------------------------------------- adapters
    @property
    def lora_adapters(self) -> dict[str, str]:
        """*Any thread.* The LoRA adapters a request may name, in load order, each with the key
        it puts into its blocks' hashes (``engine.block_hash.block_extra_key``). A copy."""

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at ``path`` as ``name`` from the next step; ``ValueError``
        saying why it cannot be served."""

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving adapter ``name``; ``ValueError`` if it is not loaded or in use."""

    # ----------------------------------------------------------------------------- stepping
    def step(self) -> list[RequestOutput]:
        """Run one batch; an output for every request that got tokens or finished. A failure
        confined to some requests finishes them with ``finish_reason == "error"``; any other
        exception means no request can run here any more."""

    def has_unfinished_requests(self) -> bool:
        """Whether a ``step`` has anything to do (or wait for)."""

    @property
    def last_num_scheduled_tokens(self) -> int:
        """Tokens the latest ``step`` computed: 0 when it did no work (the loop may idle)."""

    def stats(self) -> EngineStats:
        """A snapshot of the load, for routing and ``GetLoad``. No side effects."""

    # ----------------------------------------------------------------------------- prefix cache
    def take_kv_cache_events(self) -> list[KVCacheEvent]:
        """Prefix-cache changes since the last call, in order, each returned once: drain them
        every step (the router's prefix index is built from them)."""

    def prefix_cache_blocks(self) -> dict[BlockHash, KVMedium]:
        """Every block a prefix hit can use now, and where it is (its cache, or its second tier
        alone): the state ``take_kv_cache_events`` reports the changes of. No side effects."""

    # ----------------------------------------------------------------------------- KV transfer
    def holds_kv(self, req_id: str) -> bool:
        """Whether finished ``hold_kv`` request ``req_id`` still keeps its blocks."""

    def held_kv_block_ids(self, req_id: str) -> list[int]:
        """The blocks a finished ``hold_kv`` request keeps, in token order ([] if none): what a
        peer reads, by index into ``kv_cache``."""

    def release_held_kv(self, req_id: str) -> bool:
        """Free the blocks a finished ``hold_kv`` request keeps; False if it held none."""

    def pin_prefix(
        self,
        pin_id: str,
        prompt_token_ids: Sequence[int],
        max_blocks: int,
        *,
        cache_salt: str = "",
        lora_name: str = "",
    ) -> list[int]:
        """Hold the longest run, at most ``max_blocks``, of the prompt's full blocks this
        engine holds (its cache, then its second tier) under ``pin_id`` as a finished
        ``hold_kv`` request (``release_held_kv`` frees them): what a peer pulls the prefix
        from. [] when it holds none or cannot pin by prefix (then nothing is held)."""

    def take_kv_loads(self) -> list[KVLoad]:
        """Transfers into ``kv_cache`` the engine started since the last call (each reported
        once): the blocks to fill for requests added with ``num_external_tokens``."""

    def finish_kv_load(self, req_id: str, success: bool) -> None:
        """End a transfer from ``take_kv_loads``: the request runs on the loaded blocks, or
        (``success`` False) computes those tokens itself."""
