"""splitserve's KV connector for vLLM: how a vLLM engine keeps, shares and receives KV blocks.

vLLM asks a KV connector (its ``KVConnectorBase_V1`` API) what to do around each request:
whether some of a new request's tokens arrive from elsewhere, and whether a finished request's
blocks may be freed now. ``SplitserveConnector`` answers from a ``KVChannel`` that
``VLLMEngine`` fills from the worker's calls, so vLLM's scheduler does what
``EngineBackend`` promises:

- a request added with ``hold_kv`` keeps its blocks when it finishes (``request_finished``
  delays their freeing) until ``release_held_kv``, reported as "finished sending";
- a request added with ``num_external_tokens`` waits in vLLM's WAITING_FOR_REMOTE_KVS state on
  the blocks vLLM allocates past its own prefix-cache hits, which the worker's puller fills
  (``take_kv_loads``); ``finish_kv_load`` reports it "finished receiving", or failed, and then
  vLLM recomputes the prompt past its own prefix cache (``kv_load_failure_policy=recompute``).

The bytes never pass through vLLM: the worker registers vLLM's cache with its KV transfer
backend (grants, mutual TLS, leases) as it does the native engine's. That needs the connector's
two halves (vLLM's scheduler and its model worker) in the worker's process, on its engine
thread: tensor and pipeline parallel size 1, vLLM's multiprocessing off (``attach``).
"""

from __future__ import annotations

import logging
import threading
import uuid
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from engine.kv_cache_spec import DTYPE_SIZE_BYTES, KVCacheSpec, KVLayout
from engine.scheduler_output import KVLoad
from engine.vllm_engine.args import kv_stays_reason

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

_CHANNEL_KEY = "splitserve_kv_channel"
# Channels of the live engines of this process, by the key their vLLM config carries (each
# engine holds its own: a dropped engine's cache is not kept alive from here).
_channels: weakref.WeakValueDictionary[str, KVChannel] = weakref.WeakValueDictionary()
_channels_lock = threading.Lock()


@dataclass(slots=True, weakref_slot=True)
class KVChannel:
    """What ``VLLMEngine`` and its connector's two halves share, per request id.

    Used on the worker's engine thread only (vLLM's scheduler and model worker run there too).
    Invariants: an id is in at most one of ``_expected`` (added, blocks not yet allocated) and
    ``_loading`` (blocks being filled); ``_held`` ids are finished requests vLLM has not freed.
    """

    kv_caches: dict[str, torch.Tensor] = field(default_factory=dict)
    _expected: dict[str, int] = field(default_factory=dict)  # -> num_external_tokens
    _hold: set[str] = field(default_factory=set)  # hold_kv requests not finished yet
    _held: dict[str, list[int]] = field(default_factory=dict)  # finished, blocks kept
    _loads: list[KVLoad] = field(default_factory=list)  # announced, not yet taken
    _loading: set[str] = field(default_factory=set)  # vLLM waits on these
    _released: set[str] = field(default_factory=set)  # to report as finished sending
    _received: set[str] = field(default_factory=set)  # to report as finished receiving
    _failed: set[str] = field(default_factory=set)  # to report as failed receiving

    # ----------------------------------------------------------------------------- the engine
    def add(self, req_id: str, num_external_tokens: int, hold_kv: bool) -> None:
        """A request is being added: its first ``num_external_tokens`` come from a peer, and
        (``hold_kv``) it keeps its blocks when it finishes."""
        if num_external_tokens:
            self._expected[req_id] = num_external_tokens
        if hold_kv:
            self._hold.add(req_id)

    def abort(self, req_id: str) -> None:
        """A live request is being aborted: vLLM frees a loading request's blocks only once
        its load is reported over, so report it (failed) at the next step."""
        self._expected.pop(req_id, None)
        self._hold.discard(req_id)
        if req_id in self._loading:
            self._loading.discard(req_id)
            self._failed.add(req_id)

    def held_block_ids(self, req_id: str) -> list[int]:
        return self._held.get(req_id, [])

    def release(self, req_id: str) -> bool:
        """Let vLLM free a finished request's kept blocks (at the next step); False if none."""
        if self._held.pop(req_id, None) is None:
            return False
        self._released.add(req_id)
        return True

    def take_loads(self) -> list[KVLoad]:
        loads, self._loads = self._loads, []
        return loads

    def finish_load(self, req_id: str, success: bool) -> None:
        """End a load from ``take_loads``; one vLLM was not waiting on (its own prefix cache
        already held every external token) needs no report."""
        if req_id in self._loading:
            self._loading.discard(req_id)
            (self._received if success else self._failed).add(req_id)

    def has_reports(self) -> bool:
        """Whether the next step has something to tell vLLM's scheduler."""
        return bool(self._released or self._received or self._failed)

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    @property
    def num_held(self) -> int:
        return len(self._held)

    # ----------------------------------------------------------------------------- vLLM
    def num_new_matched_tokens(self, req_id: str, num_computed_tokens: int) -> int:
        """External tokens past ``num_computed_tokens`` (vLLM's own prefix-cache hit)."""
        return max(self._expected.get(req_id, 0) - num_computed_tokens, 0)

    def allocated(self, req_id: str, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM allocated ``req_id``'s blocks; ``num_external_tokens`` of them are to fill."""
        num_tokens = self._expected.pop(req_id, None)
        if num_tokens is None:
            return
        if num_external_tokens:
            self._loading.add(req_id)
        self._loads.append(KVLoad(req_id, block_ids, num_tokens - num_external_tokens, num_tokens))

    def finished(self, req_id: str, block_ids: list[int], completed: bool) -> bool:
        """vLLM finished ``req_id`` (``completed``: not aborted or failed); True when its
        ``block_ids`` are kept until ``release``."""
        self._expected.pop(req_id, None)
        if req_id not in self._hold:
            return False
        self._hold.discard(req_id)
        if not completed or not block_ids:
            return False
        self._held[req_id] = block_ids
        return True

    def take_results(self) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults(
            finished_sending=self._released,
            finished_recving=self._received | self._failed,
            failed_recving=self._failed,
        )
        self._released, self._received, self._failed = set(), set(), set()
        return results


def attach(args: EngineArgs) -> KVChannel | None:
    """Configure ``args`` with ``SplitserveConnector`` and return the channel it reads, or
    None (logged) when splitserve cannot reach this engine's cache (``kv_stays_reason``)."""
    reason = kv_stays_reason(args)
    if reason is not None:
        logger.info("vLLM engine: this worker prefills its own prompts: %s", reason)
        return None
    from vllm.config import KVTransferConfig

    key = uuid.uuid4().hex
    channel = KVChannel()
    with _channels_lock:
        _channels[key] = channel
    args.kv_transfer_config = KVTransferConfig(
        kv_connector=SplitserveConnector.__name__,
        kv_connector_module_path=__name__,
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={_CHANNEL_KEY: key},
    )
    return channel


def layer_major_cache(
    kv_caches: dict[str, torch.Tensor], block_size: int
) -> tuple[torch.Tensor, KVCacheSpec] | str:
    """vLLM's registered cache as splitserve's ``[num_blocks, *spec.block_shape]`` tensor (a
    view) and its spec; or why it cannot be (a line for the log).

    vLLM's CPU attention keeps each layer as ``[num_blocks, num_kv_heads, block_size,
    2 * head_dim]`` (per head: the block's K rows, then its V rows), the layers one after
    another in one allocation: ``KVLayout.VLLM_CPU``. Any other placement is refused.
    """
    layers = sorted(kv_caches.values(), key=lambda t: t.data_ptr())
    if not layers:
        return "vLLM registered no KV cache"
    first = layers[0]
    dtype = str(first.dtype).removeprefix("torch.")
    if first.dim() != 4 or first.shape[2] != block_size or dtype not in DTYPE_SIZE_BYTES:
        return f"its KV cache per layer is {dtype} {tuple(first.shape)}, not vLLM CPU's"
    num_blocks, num_kv_heads, _, two_head_dim = first.shape
    layer_bytes = first.numel() * first.element_size()
    for index, layer in enumerate(layers):
        if (
            layer.shape != first.shape
            or not layer.is_contiguous()
            or layer.data_ptr() != first.data_ptr() + index * layer_bytes
        ):
            return "its layers do not lie one after another in one allocation"
    head_dim = two_head_dim // 2
    spec = KVCacheSpec(
        num_layers=len(layers),
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        layout=KVLayout.VLLM_CPU,
    )
    per_head = block_size * two_head_dim  # elements: the block's K rows, then its V rows
    page = num_kv_heads * per_head
    strides = (page, num_blocks * page, per_head, block_size * head_dim, head_dim, 1)
    kv_cache = torch.as_strided(first, size=(num_blocks, *spec.block_shape), stride=strides)
    return kv_cache, spec


class _NoMetadata(KVConnectorMetadata):
    """Nothing travels from vLLM's scheduler to its model worker: both read the channel."""


class SplitserveConnector(KVConnectorBase_V1):
    """vLLM's view of splitserve's KV transfer; see the module. Both halves (scheduler and
    worker role) read the ``KVChannel`` their engine's config names."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        with _channels_lock:
            channel = _channels.get(str(extra.get(_CHANNEL_KEY)))
        if channel is None:
            raise RuntimeError(
                "SplitserveConnector runs inside a splitserve worker's vLLM engine only"
            )
        self._channel = channel

    # ----------------------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._channel.kv_caches = dict(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Loads run on the worker's transfer backend, not in the forward pass."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing loads during the forward pass."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Peers read the blocks in place: nothing is saved."""

    def wait_for_save(self) -> None:
        """Nothing is saved."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._channel.take_results()

    # ----------------------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        count = self._channel.num_new_matched_tokens(request.request_id, num_computed_tokens)
        return count, count > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        block_ids = list(blocks.get_block_ids()[0])
        self._channel.allocated(request.request_id, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return _NoMetadata()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        completed = request.status in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH_CAPPED,
        )
        kept = self._channel.finished(request.request_id, list(block_ids), completed)
        return kept, None
