"""``Router`` gRPC service: validate, tokenize, prefill on one worker, decode on another.

One generation (disaggregated mode)::

    Generate ─▶ prepare (INVALID_ARGUMENT on bad input) ─▶ pick prefill P, decode D
       P.Prefill ─▶ first token streamed to the client at once, KVRef of the leased prompt
       D.Decode(prompt, [first], KVRef) ─▶ D pulls the blocks, streams tokens 2.. ─▶ client

Failures degrade instead of failing the request: a prefill worker that is down or fails makes
the decode worker prefill locally; a decode worker that fails mid-stream is replaced by another
one that continues from the prompt plus the tokens already sent. With no routable decode worker
(none when the request arrives, or none other after a failure) the request waits up to
``--decode-failover-wait-s`` for one, and is not prefilled before one is there. A client cancel
or an expired deadline cancels the worker calls (which abort the request and free its blocks)
and releases a lease that no decode worker has consumed yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
from opentelemetry.trace import Span, SpanKind

from engine.tokenizer import Tokenizer
from services.common.background import BackgroundTasks
from services.common.convert import FINISH_REASON_NAMES, validate_client_constraint
from services.common.failures import FailureKind, abort
from services.common.prefix_index import RedisPrefixIndex
from services.common.roles import ClusterMode, Role
from services.common.serving_metrics import ServingMetrics
from services.common.stream_writer import StreamWriter
from services.common.tls import TlsMaterial
from services.common.tracing import Tracing, call_metadata, ending, trace_id_hex
from services.router import metrics
from services.router.auth import caller_name
from services.router.call_context import CallContext, StatusRecorder
from services.router.config import RouterConfig
from services.router.decode_choice import DecodeCandidate
from services.router.explain import explain_response
from services.router.failure_policy import FailurePolicy
from services.router.latency import LatencyWindow
from services.router.pool_metrics import PoolCollector
from services.router.request_log import RequestLog, call_status
from services.router.request_meter import RequestMeter
from services.router.request_prep import (
    MaxTokensDefault,
    ModelLimits,
    PreparedRequest,
    prepare_request,
)
from services.router.request_spans import (
    end_call_span,
    end_request_span,
    request_attributes,
    route_attributes,
)
from services.router.route_plan import PrefillPlace, build_planner
from services.router.routed_request import RoutedRequest, release_lease
from services.router.scaler import PoolScaler, reported_pool_sizes
from services.router.worker_pool import WorkerHandle, WorkerPool
from splitserve.v1 import router_pb2, router_pb2_grpc, worker_pb2

logger = logging.getLogger(__name__)

SERVICE_NAME = "splitserve.v1.Router"
# A decode call's error when its stream ended OK without a final message.
_ENDED_UNFINISHED = "ENDED_UNFINISHED"
# How often a router drops dead workers' prefix index entries (any router may: idempotent).
_REAP_INTERVAL_S = 10.0
# How often the pool metrics ask the orchestrator for the pools' sizes.
_POOL_SIZES_INTERVAL_S = 5.0


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Stateless per request except for the in-flight table used for admission.

    Pools start as the config's worker lists; an orchestrator changes them with ``set_pool``
    and serves ``Scale`` through ``scaler`` (None: a fixed cluster). With ``tls`` the calls to
    workers are mutual TLS.
    """

    def __init__(
        self,
        config: RouterConfig,
        tokenizer: Tokenizer,
        scaler: PoolScaler | None = None,
        tls: TlsMaterial | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
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
        # The last limits the decode workers reported: the model does not change when a pool
        # briefly has no worker that answered (a scale-down's survivor not yet polled).
        self._limits_seen: ModelLimits | None = None
        self.bounds = config.request_bounds()
        self.latency = LatencyWindow()
        self._background = BackgroundTasks()
        self._poller: asyncio.Task[None] | None = None
        # Redis only: the entries of workers that died without removing them are dropped here
        # (the in-process index is bounded instead).
        self._reaped_index = (
            RedisPrefixIndex.from_config(config.redis) if config.redis.enabled else None
        )
        self.serving_metrics = ServingMetrics(config.served_name, str(Role.ROUTER))
        self.pool_collector = PoolCollector(
            config.served_name, (self.prefill_pool, self.decode_pool)
        )
        self.tracing = Tracing(
            config.tracing,
            "splitserve-router",
            {"service.instance.id": self.router_id},
        )

    # ----------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self.planner.prefill_chooser.start()
        await self._poll_once()
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

    def limits(self) -> ModelLimits | None:
        """The model's limits as the decode workers report them: the tightest over those that
        answered, else the last seen (None until one has ever answered)."""
        infos = [w.info for w in self.decode_pool.workers if w.info is not None]
        if infos:
            self._limits_seen = ModelLimits(
                vocab_size=min(i.vocab_size for i in infos),
                max_model_len=min(i.max_model_len for i in infos),
            )
        return self._limits_seen

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
        limits = await self._admit(context)
        # Counted from here: a burst of expensive prompts is bounded while it is tokenized.
        self._num_inflight += 1
        metrics.INFLIGHT.inc()
        outcome = "invalid"
        log: RequestLog | None = None
        span = self.tracing.start_request_span("generate", context.invocation_metadata() or (), {})
        try:
            prepared = await self._prepare(request, limits, context, max_tokens_default)
            outcome = "error"
            if span.is_recording():
                span.set_attributes(request_attributes(prepared, self.config.served_name))
            log = RequestLog(
                prepared.req_id,
                prepared.client_request_id,
                len(prepared.prompt_token_ids),
                trace_id=trace_id_hex(span),
            )
            meter = RequestMeter(start_s, log, self.serving_metrics, self.latency)
            async for message in self._generate(prepared, context, log, span):
                meter.sent(message)
                if message.finish_reason:
                    outcome = FINISH_REASON_NAMES[message.finish_reason]
                    meter.finished(message, outcome)
                yield message
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            self._num_inflight -= 1
            metrics.INFLIGHT.dec()
            metrics.REQUESTS.labels(outcome).inc()
            if log is not None:
                log.emit(outcome, call_status(outcome, context.code))
            end_request_span(span, log, outcome)

    async def _admit(self, context: CallContext) -> ModelLimits:
        """The model's limits if a request may start now; else abort the call (UNAVAILABLE
        before any decode worker answered, RESOURCE_EXHAUSTED at --max-inflight-requests)."""
        limits = await self._limits(context)
        if self._num_inflight >= self.config.max_inflight_requests:
            metrics.REQUESTS.labels("rejected").inc()
            await abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._num_inflight} requests in flight (max_inflight_requests)",
            )
        return limits

    async def _limits(self, context: CallContext) -> ModelLimits:
        """The model's limits; the call is aborted (UNAVAILABLE) before any decode worker
        answered."""
        limits = self.limits()
        if limits is None:
            metrics.REQUESTS.labels("rejected").inc()
            await abort(context, grpc.StatusCode.UNAVAILABLE, "no decode worker has answered yet")
        return limits

    async def _prepare(
        self,
        request: router_pb2.GenerateRequest,
        limits: ModelLimits,
        context: CallContext,
        max_tokens_default: MaxTokensDefault = MaxTokensDefault.ENGINE,
    ) -> PreparedRequest:
        """Validate and tokenize ``request`` (off the event loop), then its constraint (on the
        shared validation threads: a slow one holds no thread that prepares requests);
        INVALID_ARGUMENT naming the field otherwise."""
        try:
            prepared = await asyncio.to_thread(
                prepare_request, request, self.tokenizer, limits, self.bounds, max_tokens_default
            )
        except ValueError as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            await validate_client_constraint(prepared.params.constraint)
        except ValueError as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"sampling.{exc}")
        return prepared

    async def _generate(
        self, prepared: PreparedRequest, context: CallContext, log: RequestLog, span: Span
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        if prepared.client_request_id != prepared.req_id:
            logger.info(
                "req_id=%s is the client's request_id %r",
                prepared.req_id,
                prepared.client_request_id,
            )
        routed = RoutedRequest(
            prepared, self.tokenizer, self.planner.prefill_chooser, self._background
        )
        try:
            if not self.decode_pool.routable_workers():
                # As in Dynamo, where a request enters through its decode worker: no prefill
                # (nor its lease) for a request that no decode worker can continue yet.
                await self._await_decode_worker(routed.req_id, 0, {}, set(), context)
            with ending(self.tracing.start_child(span, "route")) as route_span:
                routed.planned(
                    await self.planner.plan(
                        prepared.req_id, prepared.prompt_token_ids, prepared.cache_salt
                    )
                )
                assert routed.plan is not None
                if route_span.is_recording():
                    route_span.set_attributes(route_attributes(routed.plan))
            prefill = routed.plan.prefill_worker
            if prefill is not None:
                log.prefill_worker = prefill.address
                response = await self._prefill(prefill, routed, context, span)
                if response is not None:
                    yield routed.stream.push(
                        [response.token_id],
                        [response.logprob] if response.HasField("logprob") else [],
                        finish_reason=response.finish_reason if response.finished else "",
                        stop_reason=response.stop_reason,
                    )
                    routed.decode_request.output_token_ids.extend(routed.stream.output_token_ids)
                    if routed.stream.finished:
                        return
            async for message in self._decode(routed, context, log, span):
                routed.decode_started()
                yield message
            routed.finished()
        finally:
            await routed.close()

    async def _prefill(
        self, worker: WorkerHandle, routed: RoutedRequest, context: CallContext, span: Span
    ) -> worker_pb2.PrefillResponse | None:
        """Run the prefill; None when the worker failed (the decode worker prefills instead).
        The call is the span ``prefill_call`` under the request's ``span``."""
        request = worker_pb2.PrefillRequest(
            request_id=routed.req_id,
            prompt_token_ids=routed.prepared.prompt_token_ids,
            sampling=routed.worker_params,
            cache_salt=routed.prepared.cache_salt,
        )
        worker.num_inflight += 1
        call_span = self._call_span(span, "prefill_call", worker)
        call = worker.stub.Prefill(
            request, timeout=self._call_timeout_s(context), metadata=call_metadata(call_span)
        )
        worker.open_call(call)
        response: worker_pb2.PrefillResponse | None = None
        error = ""
        try:
            response = await call
        except grpc.aio.AioRpcError as exc:
            await self._worker_failed(worker, exc, context, routed.failures)
            error = exc.code().name
        except asyncio.CancelledError:
            if not worker.fenced(call):
                call.cancel()
                # A prefill that completed as we were cancelled leaves a lease; drop it now.
                self._background.spawn(release_lease(worker, routed.req_id))
                raise
            error = "fenced"
        finally:
            worker.close_call(call)
            worker.num_inflight -= 1
            end_call_span(call_span, error)
        await routed.prefill_done(worker, response)
        if response is not None:
            routed.stream.num_cached_tokens = response.num_cached_tokens
            return response
        metrics.PREFILL_FALLBACKS.inc()
        span.add_event("prefill_fallback", {"splitserve.worker": worker.address, "error": error})
        logger.warning(
            "req_id=%s prefill on %s failed (%s); the decode worker prefills locally",
            routed.req_id,
            worker.address,
            error,
        )
        return None

    async def _decode(
        self, routed: RoutedRequest, context: CallContext, log: RequestLog, span: Span
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Stream the decode on the planned worker (``routed.slot``'s); on a failure continue
        on another one, moving the slot along, from the prompt and the tokens sent so far (the
        next decode worker computes the prompt: the prefill worker's lease is released). A
        stream that ends without its final message counts as a failure. With no worker to go
        on to, it waits for one (``_await_decode_worker``). Each call is a span ``decode_call``
        under the request's ``span``; a failover is its event."""
        assert routed.plan is not None
        plan, slot, stream, request = routed.plan, routed.slot, routed.stream, routed.decode_request
        tried: set[str] = set()
        prompt_blocks = len(plan.prefill.block_hashes)
        for _ in range(self.config.max_decode_retries + 1):
            worker = slot.worker
            if worker is None or tried or not worker.routable:
                candidate = self.planner.decode_chooser.choose(
                    prompt_blocks, plan.prefill.matched, exclude=tried
                )
                if candidate is None:
                    candidate = await self._await_decode_worker(
                        routed.req_id, prompt_blocks, plan.prefill.matched, tried, context
                    )
                worker = candidate.worker
                slot.move_to(worker)
            tried.add(worker.address)
            log.decode_workers.append(worker.address)
            call_span = self._call_span(span, "decode_call", worker)
            call = worker.stub.Decode(
                request, timeout=self._call_timeout_s(context), metadata=call_metadata(call_span)
            )
            worker.open_call(call)
            error = ""
            try:
                async for response in call:
                    if response.finished and not request.HasField("kv_ref"):
                        stream.num_cached_tokens = response.num_cached_tokens
                    message = stream.push(
                        response.token_ids,
                        response.logprobs,
                        finish_reason=response.finish_reason if response.finished else "",
                        stop_reason=response.stop_reason,
                    )
                    if message.token_ids or message.text or stream.finished:
                        yield message
                    if stream.finished:
                        return
                # A stream that ends without its final message is cut short like any failure.
                error = _ENDED_UNFINISHED
            except grpc.aio.AioRpcError as exc:
                await self._worker_failed(worker, exc, context, routed.failures)
                error = exc.code().name
            except asyncio.CancelledError:
                if not worker.fenced(call):
                    raise
                error = "fenced"
            finally:
                worker.close_call(call)
                # A no-op when the call completed; otherwise the worker aborts the request.
                call.cancel()
                end_call_span(call_span, error)
            if plan.place is PrefillPlace.COLOCATED:  # it may come back with an empty cache
                await self.planner.prefill_chooser.forget(worker)
            metrics.DECODE_FAILOVERS.inc()
            span.add_event(
                "decode_failover",
                {
                    "splitserve.worker": worker.address,
                    "splitserve.tokens_sent": len(stream.output_token_ids),
                    "error": error,
                },
            )
            logger.warning(
                "req_id=%s decode on %s failed after %d tokens (%s); moving on",
                routed.req_id,
                worker.address,
                len(stream.output_token_ids),
                error,
            )
            # Continue from what the client already has, prefilling it locally.
            del request.output_token_ids[:]
            request.output_token_ids.extend(stream.output_token_ids)
            routed.recompute_prompt()
        await abort(context, grpc.StatusCode.UNAVAILABLE, "no healthy decode worker")

    async def _await_decode_worker(
        self,
        req_id: str,
        prompt_blocks: int,
        matched: dict[str, int],
        tried: set[str],
        context: CallContext,
    ) -> DecodeCandidate:
        """A decode worker not in ``tried`` for a request that has none (none routable when it
        arrived, or its worker failed and no other is routable), waited for up to
        ``--decode-failover-wait-s`` (at most until the client's deadline). Aborts the call
        (UNAVAILABLE) if none came."""
        remaining_s = context.time_remaining()
        wait_s = self.config.decode_failover_wait_s
        if remaining_s is not None:
            wait_s = min(wait_s, remaining_s)
        logger.info(
            "req_id=%s no%s decode worker is routable; waiting up to %.1f s for one",
            req_id,
            " other" if tried else "",
            wait_s,
        )
        candidate = await self.planner.decode_chooser.wait_for(
            prompt_blocks, matched, tried, wait_s, self.config.health_check_interval_s
        )
        if candidate is None:
            await abort(context, grpc.StatusCode.UNAVAILABLE, "no healthy decode worker")
        return candidate

    def _call_span(self, parent: Span, name: str, worker: WorkerHandle) -> Span:
        """The CLIENT span of one worker call; its context goes out as the call's metadata."""
        return self.tracing.start_child(
            parent, name, kind=SpanKind.CLIENT, attributes={"splitserve.worker": worker.address}
        )

    def _call_timeout_s(self, context: CallContext) -> float:
        """A worker call's deadline: the client's, capped by ``--worker-call-timeout-s``."""
        remaining_s = context.time_remaining()
        cap_s = self.config.worker_call_timeout_s
        return cap_s if remaining_s is None else min(remaining_s, cap_s)

    @staticmethod
    async def _worker_failed(
        worker: WorkerHandle,
        exc: grpc.aio.AioRpcError,
        context: CallContext,
        failures: FailurePolicy,
    ) -> None:
        """Fail the call if retrying cannot help (see ``FailurePolicy``); else mark the worker
        unhealthy (until a poll succeeds) so that the caller moves on to another path."""
        remaining_s = context.time_remaining()
        deadline_was_ours = remaining_s is None or remaining_s > 0
        failure = failures.judge(exc, worker.role, deadline_was_ours)
        if failure is not None:
            await abort(context, failure.code, failure.details)
        worker.mark_failed(f"{exc.code().name}: {exc.details()}")

    # ----------------------------------------------------------------------------- Explain
    async def Explain(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ExplainResponse:
        """Score the prefill candidates for ``request`` as ``Generate`` would, reserving none."""
        limits = await self._limits(context)
        prepared = await self._prepare(request, limits, context)
        plan = await self.planner.plan(None, prepared.prompt_token_ids, prepared.cache_salt)
        return explain_response(plan, len(prepared.prompt_token_ids))

    # ----------------------------------------------------------------------------- Scale
    async def Scale(
        self, request: router_pb2.ScaleRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ScaleResponse:
        """Hand the pool's new size to the orchestrator (which starts or drains workers)."""
        try:
            role = Role.from_proto(request.role)
        except ValueError as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if self.scaler is None:
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "this cluster has no orchestrator to scale it (it runs as plain processes; "
                "start it with Ray: splitserve up without --no-ray)",
            )
        who = caller_name(context)
        try:
            pools = await self.scaler.scale(role, request.num_workers)
        except ValueError as exc:
            logger.info("scale by %s refused: %s", who, exc)
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        logger.info("scale by %s: %s pool to %d workers", who, role, request.num_workers)
        return router_pb2.ScaleResponse(pools=[p.to_proto() for p in pools])

    # ----------------------------------------------------------------------------- Status
    async def Status(
        self, request: router_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.StatusResponse:
        """Fresh load of every worker (polled now, not the last periodic poll)."""
        await self._poll_once()
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
            model=self.config.served_name,
            workers=workers,
            num_inflight_requests=self._num_inflight,
            prefix_hit_blocks_predicted=self.planner.prefill_chooser.num_hit_blocks_predicted,
            prefix_hit_blocks_realized=self.planner.prefill_chooser.num_hit_blocks_realized,
            pools=[p.to_proto() for p in pools],
        )
