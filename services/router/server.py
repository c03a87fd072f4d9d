"""``Router`` gRPC service: admission, validation and metrics around each generation, the
worker pools and their polling, ``Explain``, ``Scale`` and ``Status``.

A generation's run (route, prefill, decode, failover) is its ``RoutedRequest``
(``services/router/routed_request.py``); ``generate`` is where every API enters it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import AsyncGenerator, Awaitable

import grpc

from engine.loader.models import resolve_model
from engine.tokenizer import Tokenizer
from services.common.api_keys import DEFAULT_TENANT
from services.common.background import BackgroundTasks
from services.common.convert import validate_client_constraint
from services.common.failures import FailureKind, abort, abort_retry_after
from services.common.prefix_index import RedisPrefixIndex
from services.common.roles import ClusterMode, Role
from services.common.serving_metrics import ServingMetrics
from services.common.stream_writer import StreamWriter
from services.common.tls import TlsMaterial
from services.common.tracing import Tracing, trace_id_hex
from services.router import metrics
from services.router.auth import CALLER, caller_name
from services.router.call_context import CallContext, StatusRecorder
from services.router.config import RouterConfig
from services.router.explain import explain_response
from services.router.latency import LatencyWindow
from services.router.lora_adapters import LoraAdapters, RuntimeUpdatesDisabledError
from services.router.pool_metrics import PoolCollector
from services.router.request_log import Outcome, RequestLog, call_status
from services.router.request_meter import RequestMeter
from services.router.request_prep import (
    MaxTokensDefault,
    ModelLimits,
    PreparedRequest,
    prepare_request,
)
from services.router.request_spans import (
    end_request_span,
    request_attributes,
)
from services.router.route_plan import build_planner
from services.router.routed_request import RoutedRequest, Routing
from services.router.scaler import PoolScaler, reported_pool_sizes
from services.router.served_models import (
    ModelNotFoundError,
    ResolvedModel,
    ServedModel,
    ServedModels,
)
from services.router.tenants import TenantGate, parse_tenant_limits, tenant_cache_salt
from services.router.tool_calls.rendering import detect_format
from services.router.worker_pool import WorkerPool
from splitserve.v1 import router_pb2, router_pb2_grpc, worker_pb2

logger = logging.getLogger(__name__)

SERVICE_NAME = "splitserve.v1.Router"
# How often a router drops dead workers' prefix index entries (any router may: idempotent).
_REAP_INTERVAL_S = 10.0
# How often the pool metrics ask the orchestrator for the pools' sizes.
_POOL_SIZES_INTERVAL_S = 5.0


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Stateless per request except for the in-flight table used for admission.

    Pools start as the config's worker lists; an orchestrator changes them with ``set_pool``
    and serves ``Scale`` through ``scaler`` (None: a fixed cluster). A pool may hold several
    models' workers: ``models`` serves ``tokenizer``'s model (``--model``) and each one its
    workers report. With ``tls`` the calls to workers are mutual TLS.
    """

    def __init__(
        self,
        config: RouterConfig,
        tokenizer: Tokenizer,
        scaler: PoolScaler | None = None,
        tls: TlsMaterial | None = None,
    ) -> None:
        self.config = config
        self.scaler = scaler
        rng = random.Random(config.seed)
        # Resolved once: the id names both the router's Redis ledger entries and its traces.
        self.router_id = config.resolved_router_id()
        prefill = config.prefill_address_list if config.mode is ClusterMode.DISAGGREGATED else ()
        fence_after = config.worker_fence_after_failed_polls
        self.prefill_pool = WorkerPool(Role.PREFILL, prefill, fence_after, tls)
        self.decode_pool = WorkerPool(Role.DECODE, config.decode_address_list, fence_after, tls)
        self.planner = build_planner(
            config, self.router_id, self.prefill_pool, self.decode_pool, rng
        )
        self._num_inflight = 0
        self.bounds = config.request_bounds()
        self.tenants = TenantGate(parse_tenant_limits(config.tenant_limits))
        self._poller: asyncio.Task[None] | None = None
        # Redis only: the entries of workers that died without removing them are dropped here
        # (the in-process index is bounded instead).
        self._reaped_index = (
            RedisPrefixIndex.from_config(config.redis) if config.redis.enabled else None
        )
        pools = (self.prefill_pool, self.decode_pool)
        self.pool_collector = PoolCollector(pools)
        self.tracing = Tracing(
            config.tracing,
            "splitserve-router",
            {"service.instance.id": self.router_id},
        )
        self._background = BackgroundTasks()
        self.models = ServedModels(
            self._served_model(config.served_name, config.model, tokenizer),
            pools,
            self.decode_pool,
            LoraAdapters(pools, config.allow_runtime_lora_updating),
            self._load_model,
        )

    def _load_model(self, name: str, model: str, revision: str | None) -> ServedModel:
        """A model learnt from its workers (``ServedModels.discover``): loads its tokenizer."""
        tokenizer = Tokenizer(resolve_model(model, revision=revision, tokenizer_only=True))
        return self._served_model(name, model, tokenizer)

    def _served_model(self, name: str, model: str, tokenizer: Tokenizer) -> ServedModel:
        tool_call_format = self.config.tool_call_parser or detect_format(tokenizer.chat_template)
        routing = Routing(self.config, tokenizer, self.planner, self.tracing, self._background)
        metrics = ServingMetrics(name, str(Role.ROUTER))
        return ServedModel(
            name, model, tokenizer, tool_call_format, routing, metrics, LatencyWindow()
        )

    # ----------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self.planner.prefill_chooser.start()
        await self._poll_once()
        await self.models.discover()
        self._poller = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        if self._reaped_index is not None:
            await self._reaped_index.close()
        await self.prefill_pool.close()
        await self.decode_pool.close()
        await self.planner.prefill_chooser.close()
        await self.tracing.shutdown()

    async def _poll_once(self) -> None:
        await asyncio.gather(self.prefill_pool.poll_all(), self.decode_pool.poll_all())

    async def set_pool(self, role: Role, members: dict[str, bool]) -> None:
        """Make the ``prefill`` or ``decode`` pool exactly ``members`` (address -> draining).
        Added workers are routable once healthy; draining ones get nothing new."""
        pool = self.prefill_pool if role is Role.PREFILL else self.decode_pool
        await pool.set_members(members)
        await self.models.discover()

    def num_inflight_by_worker(self) -> dict[str, int]:
        """This router's requests in flight on each worker (address), prefill and decode."""
        return {
            w.address: w.num_inflight
            for w in (*self.prefill_pool.workers, *self.decode_pool.workers)
        }

    async def _poll_forever(self) -> None:
        loop = asyncio.get_running_loop()
        next_reap_s = next_sizes_s = loop.time()
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            await self._poll_once()
            # A new model's tokenizer loads beside the health polls, never in their way.
            self._background.spawn(self.models.discover())
            await self.models.adapters.reconcile()
            if self._reaped_index is not None and loop.time() >= next_reap_s:
                next_reap_s = loop.time() + _REAP_INTERVAL_S
                await self._reap_dead_workers(self._reaped_index)
            if self.scaler is not None and loop.time() >= next_sizes_s:
                next_sizes_s = loop.time() + _POOL_SIZES_INTERVAL_S
                self.pool_collector.sizes = await reported_pool_sizes(self.scaler)

    @staticmethod
    async def _reap_dead_workers(index: RedisPrefixIndex) -> None:
        try:
            dead = await index.reap()
        except Exception as exc:  # Redis down: the next round tries again
            logger.debug("prefix index reaping failed: %r", exc)
            return
        if dead:
            logger.info("prefix index: removed the entries of dead workers %s", dead)

    def routable_addresses(self) -> set[str]:
        """The workers of both pools this router would choose for a new request now."""
        return {
            w.address
            for pool in (self.prefill_pool, self.decode_pool)
            for w in pool.routable_workers()
        }

    # ----------------------------------------------------------------------------- Generate
    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """``generate``'s messages, each sent within ``--stream-idle-timeout-s``: a client that
        takes none for that long (its flow-control window full) has its request freed on every
        worker at once, and its call ends ABORTED once it reads again or leaves
        (``StreamWriter``), as the HTTP API does."""
        writer = StreamWriter(context, self.config.stream_idle_timeout_s)
        async with contextlib.aclosing(self.generate(request, context)) as messages:
            async for message in messages:
                if not await writer.write(message):
                    break
            else:
                return
        logger.info(
            "gRPC client %s took no output for %.1f s; its request is cancelled "
            "(stream_idle_timeout_s)",
            context.peer(),
            writer.idle_s,
        )
        await writer.abort(
            grpc.StatusCode.ABORTED,
            FailureKind.REQUEST,
            f"the client took no output for {writer.idle_s:g} s (stream_idle_timeout_s)",
        )

    async def generate(
        self,
        request: router_pb2.GenerateRequest,
        context: CallContext,
        max_tokens_default: MaxTokensDefault = MaxTokensDefault.ENGINE,
    ) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
        """One generation's life, whichever API it came through (gRPC ``Generate``, the HTTP
        API): admission, validation, routing, failover and metrics. Refusals end the call
        through ``context.abort``; cancelling the iteration (or closing it) aborts the request
        on every worker and frees its blocks. ``max_tokens_default`` applies when the request
        sets no ``max_tokens``."""
        start_s = time.perf_counter()
        context = StatusRecorder(context)
        tenant = _caller_tenant()
        resolved = await self._resolve(request.model, context)
        served = resolved.served
        limits = await self._admit(context, tenant, served.name)
        # Counted from here: a burst of expensive prompts is bounded while it is tokenized.
        self._num_inflight += 1
        metrics.INFLIGHT.inc()
        outcome = Outcome.INVALID
        log: RequestLog | None = None
        span = self.tracing.start_request_span("generate", context.invocation_metadata() or (), {})
        try:
            prepared = await self._prepare(request, resolved, limits, context, max_tokens_default)
            self._tenant_tokens(tenant, "prompt", len(prepared.prompt_token_ids))
            outcome = Outcome.ERROR
            if span.is_recording():
                span.set_attributes(request_attributes(prepared, served.name))
            log = RequestLog(
                prepared.req_id,
                prepared.client_request_id,
                len(prepared.prompt_token_ids),
                trace_id=trace_id_hex(span),
            )
            meter = RequestMeter(start_s, log, served.serving_metrics, served.latency)
            routed = RoutedRequest(prepared, served.routing, context, log, span)
            async with contextlib.aclosing(routed.run()) as messages:
                async for message in messages:
                    meter.sent(message)
                    self._tenant_tokens(tenant, "generated", len(message.token_ids))
                    if message.finish_reason:
                        outcome = Outcome.of_finish_reason(message.finish_reason)
                        meter.finished(message, outcome)
                        metrics.TENANT_TOKENS.labels(tenant, "cached").inc(
                            message.usage.cached_tokens
                        )
                    yield message
        except (asyncio.CancelledError, GeneratorExit):
            outcome = Outcome.CANCELLED
            raise
        finally:
            self.tenants.release(tenant)
            self._num_inflight -= 1
            metrics.INFLIGHT.dec()
            metrics.REQUESTS.labels(outcome.value).inc()
            if log is not None:
                log.emit(outcome, call_status(outcome, context.code))
            end_request_span(span, log, outcome)

    async def _resolve(self, model: str, context: CallContext) -> ResolvedModel:
        """What a request's ``model`` names (``ServedModels.resolve``); NOT_FOUND naming the
        models served otherwise."""
        try:
            return self.models.resolve(model)
        except ModelNotFoundError as exc:
            metrics.REQUESTS.labels(Outcome.INVALID.value).inc()
            await abort(context, grpc.StatusCode.NOT_FOUND, str(exc))

    async def _admit(self, context: CallContext, tenant: str, model: str) -> ModelLimits:
        """``model``'s limits if a request of ``tenant`` may start now (it then counts in
        the tenant's flight: release it); else abort the call (UNAVAILABLE before any decode
        worker of the model answered, RESOURCE_EXHAUSTED at --max-inflight-requests or over
        the tenant's --tenant-limits, with retry-after)."""
        limits = await self._limits(model, context)
        if self._num_inflight >= self.config.max_inflight_requests:
            metrics.REQUESTS.labels(Outcome.REJECTED.value).inc()
            await abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._num_inflight} requests in flight (max_inflight_requests)",
            )
        refusal = self.tenants.admit(tenant)
        if refusal is not None:
            metrics.REQUESTS.labels(Outcome.REJECTED.value).inc()
            metrics.TENANT_REJECTED.labels(tenant, refusal.reason.value).inc()
            await abort_retry_after(
                context, grpc.StatusCode.RESOURCE_EXHAUSTED, refusal.message, refusal.retry_after_s
            )
        return limits

    def _tenant_tokens(self, tenant: str, kind: str, num_tokens: int) -> None:
        """Count ``num_tokens`` of ``tenant``'s (its usage metrics, its token rate)."""
        if num_tokens:
            metrics.TENANT_TOKENS.labels(tenant, kind).inc(num_tokens)
            self.tenants.charge(tenant, num_tokens)

    async def _limits(self, model: str, context: CallContext) -> ModelLimits:
        """``model``'s limits; the call is aborted (UNAVAILABLE) before any of its decode
        workers answered."""
        limits = self.models.limits(model)
        if limits is None:
            metrics.REQUESTS.labels(Outcome.REJECTED.value).inc()
            await abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"no decode worker of model `{model}` has answered yet",
            )
        return limits

    async def _prepare(
        self,
        request: router_pb2.GenerateRequest,
        resolved: ResolvedModel,
        limits: ModelLimits,
        context: CallContext,
        max_tokens_default: MaxTokensDefault = MaxTokensDefault.ENGINE,
    ) -> PreparedRequest:
        """Validate and tokenize ``request`` for its ``resolved`` model (off the event loop),
        then its constraint (on the shared validation threads: a slow one holds no thread
        that prepares requests); INVALID_ARGUMENT naming the field otherwise. Its blocks are
        salted with the caller's tenant, and its priority is never better than the
        tenant's."""
        served = resolved.served
        try:
            prepared = await asyncio.to_thread(
                prepare_request,
                request,
                served.tokenizer,
                limits,
                self.bounds,
                max_tokens_default,
                served.tool_call_format,
            )
        except ValueError as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            await validate_client_constraint(prepared.params.constraint)
        except ValueError as exc:
            # A required or named tool choice's grammar is built from the tools' schemas.
            tool_grammar = prepared.tools is not None and prepared.tools.constraint() is not None
            where = "tools: the grammar of their schemas: " if tool_grammar else "sampling."
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{where}{exc}")
        tenant = _caller_tenant()
        best = self.tenants.priority(tenant)
        asked = prepared.priority
        return dataclasses.replace(
            prepared,
            cache_salt=tenant_cache_salt(tenant, prepared.cache_salt),
            priority=best if asked is None else max(asked, best),
            model=served.name,
            lora_name=resolved.lora_name,
            lora_block_key=resolved.lora_block_key,
        )

    # ----------------------------------------------------------------------------- Explain
    async def Explain(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ExplainResponse:
        """Score the prefill candidates for ``request`` as ``Generate`` would, reserving none."""
        resolved = await self._resolve(request.model, context)
        limits = await self._limits(resolved.served.name, context)
        prepared = await self._prepare(request, resolved, limits, context)
        plan = await self.planner.plan(
            None,
            prepared.prompt_token_ids,
            prepared.block_extra_key,
            prepared.target,
            prepared.priority,
        )
        return explain_response(plan, len(prepared.prompt_token_ids))

    # ----------------------------------------------------------------------------- Scale
    async def Scale(
        self, request: router_pb2.ScaleRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ScaleResponse:
        """Hand the pool's new size to the orchestrator (which starts or drains workers). The
        pool is ``request.model``'s (empty: the router's ``--model``)."""
        try:
            role = Role.from_proto(request.role)
        except ValueError as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        model = request.model or self.models.primary.name
        if self.scaler is None:
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "this cluster has no orchestrator to scale it (it runs as plain processes; "
                "start it with Ray: splitserve up without --no-ray)",
            )
        who = caller_name(context)
        try:
            pools = await self.scaler.scale(model, role, request.num_workers)
        except ValueError as exc:
            logger.info("scale by %s refused: %s", who, exc)
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        logger.info("scale by %s: %s %s pool to %d workers", who, model, role, request.num_workers)
        return router_pb2.ScaleResponse(pools=[p.to_proto() for p in pools])

    # ----------------------------------------------------------------------------- Status
    async def Status(
        self, request: router_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.StatusResponse:
        """Fresh load of every worker (polled now, not the last periodic poll)."""
        await self._poll_once()
        await self.models.discover()
        workers = [
            router_pb2.WorkerStatus(
                address=w.address,
                role=w.role.to_proto(),
                healthy=w.healthy,
                info=w.info,
                load=w.load,
                last_error=w.last_error,
                draining=w.draining,
            )
            for w in (*self.prefill_pool.workers, *self.decode_pool.workers)
        ]
        pools = await reported_pool_sizes(self.scaler)
        return router_pb2.StatusResponse(
            mode=self.config.mode,
            model=self.models.primary.name,
            workers=workers,
            num_inflight_requests=self._num_inflight,
            prefix_hit_blocks_predicted=self.planner.prefill_chooser.num_hit_blocks_predicted,
            prefix_hit_blocks_realized=self.planner.prefill_chooser.num_hit_blocks_realized,
            pools=[p.to_proto() for p in pools],
            lora_adapters=list(self.models.adapters.served()),
            models=self.models.names(),
        )

    # ----------------------------------------------------------------------------- LoRA
    async def LoadLoraAdapter(
        self, request: worker_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.LoraAdaptersResponse:
        """Serve an adapter on every worker of its base model (``LoraAdapters.load``; empty
        ``base_model_name``: the router's ``--model``)."""
        load = self.models.load_adapter(
            request.lora_name, request.lora_path, request.base_model_name
        )
        await self._update_adapters(load, context)
        logger.info("LoRA adapter %s loaded by %s", request.lora_name, caller_name(context))
        return router_pb2.LoraAdaptersResponse(lora_adapters=list(self.models.adapters.served()))

    async def UnloadLoraAdapter(
        self, request: worker_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.LoraAdaptersResponse:
        """Stop serving an adapter on every worker (``LoraAdapters.unload``)."""
        adapters = self.models.adapters
        await self._update_adapters(adapters.unload(request.lora_name), context)
        logger.info("LoRA adapter %s unloaded by %s", request.lora_name, caller_name(context))
        return router_pb2.LoraAdaptersResponse(lora_adapters=list(adapters.served()))

    @staticmethod
    async def _update_adapters(update: Awaitable[None], context: CallContext) -> None:
        """Await ``update``; its refusals end the call (FAILED_PRECONDITION when runtime
        updates are off, INVALID_ARGUMENT with the reason otherwise)."""
        try:
            await update
        except RuntimeUpdatesDisabledError as exc:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def _caller_tenant() -> str:
    """The tenant of the call being served: its API key's."""
    key = CALLER.get()
    return key.tenant if key is not None else DEFAULT_TENANT
