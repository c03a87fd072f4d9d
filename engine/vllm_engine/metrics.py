"""vLLM's own Prometheus metrics of one in-process engine core, as ``vllm serve`` computes them.

``vllm serve`` feeds its ``PrometheusStatLogger`` from the engine core's outputs: the
scheduler's stats of each step, and per-request ``IterationStats`` its output processor builds.
Here the worker reads the core's outputs itself (vLLM's output processor is not used: see
``engine``), so ``VLLMStatLogger`` builds the same ``IterationStats`` with vLLM's own functions
and hands both to vLLM's logger: every ``vllm:`` family vLLM exports, with vLLM's semantics
(e.g. TTFT from the frontend's arrival stamp, aborted requests not counted as finished).

vLLM's logger registers in ``prometheus_client``'s default registry and first unregisters every
``vllm:`` metric it finds there. Here it writes to its own registry instead (the class
attributes vLLM provides for other registries: ``_gauge_cls`` and the like), so two engines of
one process, and splitserve's own families, never clash; the worker exports that registry with
its ``pool`` and ``worker_id`` labels (``services.common.serving_metrics``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass(slots=True)
class _Tracked:
    """What vLLM's output processor keeps of a request for its stats."""

    stats: Any  # vllm.v1.metrics.stats.RequestStateStats
    num_prompt_tokens: int
    max_tokens: int | None
    is_prefilling: bool = True
    num_cached_tokens: int = 0


class VLLMStatLogger:
    """vLLM's ``PrometheusStatLogger`` for one engine core, in its own ``registry``.

    Call on the engine thread: ``request_added`` when a request enters the core,
    ``request_aborted`` when the worker aborts it, ``record`` with each step's outputs. The
    registry is read at scrape time from any thread (prometheus_client's metrics lock).
    """

    def __init__(self, vllm_config: Any) -> None:
        from vllm.v1.metrics.stats import LoRARequestStates

        self.registry = CollectorRegistry(auto_describe=True)
        self._logger = _logger_class(self.registry)(vllm_config)
        self._logger.log_engine_initialized()
        self._lora_states = LoRARequestStates(log_stats=True)
        self._requests: dict[str, _Tracked] = {}

    def request_added(self, request: Any) -> None:
        """``request`` (vLLM's ``EngineCoreRequest``) entered the core."""
        from vllm.v1.metrics.stats import RequestStateStats

        params = request.sampling_params
        self._requests[request.request_id] = _Tracked(
            stats=RequestStateStats(arrival_time=request.arrival_time),
            num_prompt_tokens=len(request.prompt_token_ids or ()),
            max_tokens=None if params is None else params.max_tokens,
        )

    def request_aborted(self, req_id: str) -> None:
        """The worker aborted ``req_id``: vLLM counts no finish for it."""
        self._requests.pop(req_id, None)

    def record(self, core_outputs: Any) -> None:
        """One step's ``EngineCoreOutputs``: its scheduler stats, and the iteration stats of
        its requests' outputs, as vLLM's ``AsyncLLM`` output handler records them."""
        from vllm.v1.metrics.stats import IterationStats

        iteration = None
        if core_outputs.outputs:
            iteration = IterationStats()
            for output in core_outputs.outputs:
                self._count(iteration, output, core_outputs.timestamp)
        self._lora_states.update_scheduler_stats(core_outputs.scheduler_stats)
        self._logger.record(scheduler_stats=core_outputs.scheduler_stats, iteration_stats=iteration)

    def _count(self, iteration: Any, output: Any, timestamp: float) -> None:
        """Add one request's output (and its finish) to the step's ``iteration`` stats."""
        from vllm.v1.engine.parallel_sampling import ParentRequest

        tracked = self._requests.get(output.request_id)
        if tracked is None:
            return
        iteration.update_from_output(
            output, timestamp, tracked.is_prefilling, tracked.stats, self._lora_states, None
        )
        if tracked.is_prefilling and output.prefill_stats is not None:
            tracked.num_cached_tokens = output.prefill_stats.num_cached_tokens
        tracked.is_prefilling = False
        if output.finish_reason is None:
            return
        del self._requests[output.request_id]
        iteration.update_from_finished_request(
            finish_reason=output.finish_reason,
            request_id=output.request_id,
            num_prompt_tokens=tracked.num_prompt_tokens,
            max_tokens_param=tracked.max_tokens,
            req_stats=tracked.stats,
            num_cached_tokens=tracked.num_cached_tokens,
        )
        ParentRequest.observe_finished_request(None, iteration, tracked.stats.num_generation_tokens)


def _logger_class(registry: CollectorRegistry) -> type[Any]:
    """vLLM's ``PrometheusStatLogger``, and the metric groups it builds, writing to
    ``registry``; and leaving ``prometheus_client``'s default registry alone."""
    from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorProm
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.perf import PerfMetricsProm
    from vllm.v1.spec_decode.metrics import SpecDecodingProm

    metric_classes: dict[str, object] = {
        "_gauge_cls": functools.partial(Gauge, registry=registry),
        "_counter_cls": functools.partial(Counter, registry=registry),
        "_histogram_cls": functools.partial(Histogram, registry=registry),
    }

    def in_registry(base: type[Any], **more: object) -> type[Any]:
        return type(base.__name__, (base,), {**metric_classes, **more})

    return in_registry(
        PrometheusStatLogger,
        _spec_decoding_cls=in_registry(SpecDecodingProm),
        _kv_connector_cls=in_registry(KVConnectorProm),
        _ec_connector_cls=in_registry(ECConnectorProm),
        _perf_metrics_cls=in_registry(PerfMetricsProm),
    )
