"""``RoutedRequest``: one generation's run in the router, from its route to its last token.

One generation (disaggregated mode)::

    run ─▶ no routable decode worker? wait for one (no prefill, no lease before)
        ─▶ plan: prefill worker P (maybe), decode worker D, peer W (maybe)
        ─▶ W.PinPrefix ─▶ the KVRef of the prefix W caches (see peer_pin)
        ─▶ P.Prefill(W's KVRef) ─▶ P pulls the prefix, computes the rest; the first token
           is yielded at once, with the KVRef of the leased prompt
        ─▶ D.Decode(prompt, [first], KVRef) ─▶ D pulls the blocks, streams tokens 2..

Failures degrade instead of failing the request: a prefill worker that is down or fails makes
the decode worker prefill locally; a decode worker that fails mid-stream is replaced by another
one that continues from the prompt plus the tokens already sent. With no routable decode worker
(none when the request arrives, or none other after a failure) the request waits up to
``--decode-failover-wait-s`` for one. A client cancel or an expired deadline cancels the worker
calls (which abort the request and free its blocks); what the request holds on workers (slot,
reservation, lease: ``Holdings``) is released whichever way ``run`` ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import grpc
from opentelemetry.trace import Span, SpanKind

from engine.tokenizer import Tokenizer
from services.common.background import BackgroundTasks
from services.common.convert import sampling_params_to_worker
from services.common.failures import abort
from services.common.tracing import Tracing, call_metadata, ending
from services.router import metrics
from services.router.call_context import CallContext
from services.router.config import RouterConfig
from services.router.decode_choice import DecodeCandidate
from services.router.failure_policy import FailurePolicy
from services.router.peer_pin import PeerPullOutcome, count, pin_id, pin_peer_prefix
from services.router.request_holdings import Holdings, release_lease
from services.router.request_log import RequestLog
from services.router.request_prep import PreparedRequest
from services.router.request_spans import end_call_span, route_attributes
from services.router.response_stream import ResponseStream
from services.router.route_plan import PeerPull, PrefillPlace, RoutePlan, RoutePlanner
from services.router.worker_pool import WorkerHandle
from splitserve.v1 import router_pb2, worker_pb2

logger = logging.getLogger(__name__)

# A decode call's error when its stream ended OK without a final message.
_ENDED_UNFINISHED = "ENDED_UNFINISHED"


@dataclass(frozen=True, slots=True)
class Routing:
    """What every request of one served model shares: the router's flags, the model's
    tokenizer, the planner (whose choosers hold both pools, every model's), tracing, and the
    tasks nobody waits for."""

    config: RouterConfig
    tokenizer: Tokenizer
    planner: RoutePlanner
    tracing: Tracing
    background: BackgroundTasks


class RoutedRequest:
    """A prepared request on its way through a prefill worker (maybe) and decode workers.

    ``stream`` turns worker tokens into client messages; ``decode_request`` is what the next
    decode worker is sent (the prompt, the tokens the client already has, the KV to pull);
    ``failures`` judges worker errors across the whole request. ``context`` is the client's
    call: its deadline bounds every worker call, and a refusal aborts it.
    """

    def __init__(
        self,
        prepared: PreparedRequest,
        routing: Routing,
        context: CallContext,
        log: RequestLog,
        span: Span,
    ) -> None:
        self.prepared = prepared
        self.req_id = prepared.req_id
        self._routing = routing
        self._config = routing.config
        self._planner = routing.planner
        self._context = context
        self._log = log
        self._span = span
        self.stream = ResponseStream(
            prepared.client_request_id,
            routing.tokenizer,
            prepared.prompt_token_ids,
            prepared.params,
            prepared.tools,
        )
        self.worker_params = sampling_params_to_worker(prepared.params)
        self.decode_request = worker_pb2.DecodeRequest(
            request_id=self.req_id,
            prompt_token_ids=prepared.prompt_token_ids,
            sampling=self.worker_params,
            cache_salt=prepared.cache_salt,
            priority=prepared.priority,
            lora_name=prepared.lora_name,
        )
        self.failures = FailurePolicy()
        self.holdings = Holdings(self.req_id, self._planner.prefill_chooser, routing.background)

    async def run(self) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
        """The client's messages: the first token from the prefill worker (when one runs),
        then the decode workers' tokens. Aborts the call when no decode worker can go on."""
        if self.prepared.client_request_id != self.req_id:
            logger.info(
                "req_id=%s is the client's request_id %r",
                self.req_id,
                self.prepared.client_request_id,
            )
        try:
            if not self._planner.decode_chooser.pool.routable_workers(self.prepared.target):
                # As in Dynamo, where a request enters through its decode worker: no prefill
                # (nor its lease) for a request that no decode worker can continue yet.
                await self._await_decode_worker(0, {}, set())
            plan = await self._plan()
            prefill = plan.prefill_worker
            if prefill is not None:
                self._log.prefill_worker = prefill.address
                response = await self._prefill(plan, prefill)
                if response is not None:
                    yield self.stream.push(
                        [response.token_id],
                        [response.logprob] if response.HasField("logprob") else [],
                        finish_reason=response.finish_reason if response.finished else "",
                        stop_reason=response.stop_reason,
                        prompt_logprobs=response.prompt_logprobs,
                    )
                    self.decode_request.output_token_ids.extend(self.stream.output_token_ids)
                    self.decode_request.sampling.ClearField("prompt_logprobs")
                    if self.stream.finished:
                        return
            async for message in self._decode(plan):
                self.holdings.decode_started()
                yield message
            if plan.place is PrefillPlace.COLOCATED:  # the replica's prefix hits, now known
                self._planner.prefill_chooser.record_hits(
                    plan.prefill, self.stream.num_cached_tokens, self.stream.num_tier_tokens
                )
        finally:
            await self.holdings.close()

    async def _plan(self) -> RoutePlan:
        """Where the request runs (the span ``route``); the plan's reservation and decode
        worker become its holdings."""
        prepared = self.prepared
        with ending(self._routing.tracing.start_child(self._span, "route")) as route_span:
            plan = await self._planner.plan(
                self.req_id,
                prepared.prompt_token_ids,
                prepared.block_extra_key,
                prepared.target,
                prepared.priority,
            )
            self.holdings.planned(plan)
            if route_span.is_recording():
                route_span.set_attributes(route_attributes(plan))
        return plan

    async def _prefill(
        self, plan: RoutePlan, worker: WorkerHandle
    ) -> worker_pb2.PrefillResponse | None:
        """Run the prefill (the span ``prefill_call``); None when the worker failed (the
        decode worker prefills instead)."""
        request = worker_pb2.PrefillRequest(
            request_id=self.req_id,
            prompt_token_ids=self.prepared.prompt_token_ids,
            sampling=self.worker_params,
            cache_salt=self.prepared.cache_salt,
            priority=self.prepared.priority,
            lora_name=self.prepared.lora_name,
            # The decode worker may queue the request before it pulls the prefill's KV.
            kv_lease_ttl_s=self._call_timeout_s(),
        )
        pull = plan.peer_pull
        pinned = None
        if pull is not None and not self.worker_params.HasField("prompt_logprobs"):
            pinned = await pin_peer_prefix(pull, self.prepared, self._call_timeout_s())
        if pinned is not None:
            request.peer_kv_ref.CopyFrom(pinned.kv_ref)
            request.peer_kv_peer.CopyFrom(pinned.kv_peer)
        worker.num_inflight += 1
        priority = self.prepared.priority or 0
        worker.prefill_priorities[priority] += 1
        call_span = self._call_span("prefill_call", worker)
        call = worker.stub.Prefill(
            request, timeout=self._call_timeout_s(), metadata=call_metadata(call_span)
        )
        worker.open_call(call)
        response: worker_pb2.PrefillResponse | None = None
        error = ""
        try:
            response = await call
        except grpc.aio.AioRpcError as exc:
            await self._worker_failed(worker, exc)
            error = exc.code().name
        except asyncio.CancelledError:
            if not worker.fenced(call):
                call.cancel()
                # A prefill that completed as we were cancelled leaves a lease; drop it now.
                self._routing.background.spawn(release_lease(worker, self.req_id))
                raise
            error = "fenced"
        finally:
            worker.close_call(call)
            worker.num_inflight -= 1
            worker.prefill_priorities[priority] -= 1
            if not worker.prefill_priorities[priority]:
                del worker.prefill_priorities[priority]
            end_call_span(call_span, error)
            if pull is not None and pinned is not None:
                self._peer_pull_done(pull, response)
        await self.holdings.prefill_done(plan, worker, response)
        if response is not None:
            if response.HasField("kv_ref"):
                self.decode_request.kv_ref.CopyFrom(response.kv_ref)
                self.decode_request.kv_peer.CopyFrom(response.kv_peer)
            self.stream.num_cached_tokens = response.num_cached_tokens
            return response
        metrics.PREFILL_FALLBACKS.inc()
        self._span.add_event(
            "prefill_fallback", {"splitserve.worker": worker.address, "error": error}
        )
        logger.warning(
            "req_id=%s prefill on %s failed (%s); the decode worker prefills locally",
            self.req_id,
            worker.address,
            error,
        )
        return None

    def _peer_pull_done(self, pull: PeerPull, response: worker_pb2.PrefillResponse | None) -> None:
        """Count how the pull of a pinned prefix ended; release the pin at its source unless
        the reader did (it does once its read ends). ``response`` is None when the prefill
        failed or was cancelled."""
        if response is not None and response.num_peer_blocks:
            count(PeerPullOutcome.PULLED, response.num_peer_blocks)
            self._span.add_event(
                "peer_pull",
                {"splitserve.worker": pull.source.address, "blocks": response.num_peer_blocks},
            )
            return
        if response is not None and response.peer_pull_failed:
            count(PeerPullOutcome.PULL_FAILED)
        self._routing.background.spawn(release_lease(pull.source, pin_id(self.req_id)))

    async def _decode(self, plan: RoutePlan) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Stream the decode on the planned worker (the slot's); on a failure continue on
        another one, moving the slot along, from the prompt and the tokens sent so far (the
        next decode worker computes the prompt: the lease is released). A stream that ends
        without its final message counts as a failure. Each call is a span ``decode_call``;
        a failover is an event of the request's span."""
        slot, stream, request = self.holdings.slot, self.stream, self.decode_request
        tried: set[str] = set()
        prompt_blocks = len(plan.prefill.block_hashes)
        for _ in range(self._config.max_decode_retries + 1):
            worker = slot.worker
            if worker is None or tried or not worker.routable:
                candidate = self._planner.decode_chooser.choose(
                    prompt_blocks, plan.prefill.matched, tried, self.prepared.target
                )
                if candidate is None:
                    candidate = await self._await_decode_worker(
                        prompt_blocks, plan.prefill.matched, tried
                    )
                worker = candidate.worker
                slot.move_to(worker)
            tried.add(worker.address)
            self._log.decode_workers.append(worker.address)
            call_span = self._call_span("decode_call", worker)
            call = worker.stub.Decode(
                request, timeout=self._call_timeout_s(), metadata=call_metadata(call_span)
            )
            worker.open_call(call)
            error = ""
            try:
                async for response in call:
                    if response.finished and not request.HasField("kv_ref"):
                        stream.num_cached_tokens = response.num_cached_tokens
                        stream.num_tier_tokens = response.num_tier_tokens
                    message = stream.push(
                        response.token_ids,
                        response.logprobs,
                        finish_reason=response.finish_reason if response.finished else "",
                        stop_reason=response.stop_reason,
                        prompt_logprobs=response.prompt_logprobs,
                    )
                    if response.prompt_logprobs:  # sent: a worker taking over needs none
                        request.sampling.ClearField("prompt_logprobs")
                    if message.token_ids or message.text or message.tool_calls or stream.finished:
                        yield message
                    if stream.finished:
                        return
                # A stream that ends without its final message is cut short like any failure.
                error = _ENDED_UNFINISHED
            except grpc.aio.AioRpcError as exc:
                await self._worker_failed(worker, exc)
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
            await self._failed_over(plan, worker, error)
        await abort(self._context, grpc.StatusCode.UNAVAILABLE, "no healthy decode worker")

    async def _failed_over(self, plan: RoutePlan, worker: WorkerHandle, error: str) -> None:
        """Decode ``worker`` failed with ``error``: the next one continues from what the
        client already has, computing the prompt itself."""
        if plan.place is PrefillPlace.COLOCATED:  # it may come back with an empty cache
            await self._planner.prefill_chooser.forget(worker)
        metrics.DECODE_FAILOVERS.inc()
        tokens_sent = self.stream.output_token_ids
        self._span.add_event(
            "decode_failover",
            {
                "splitserve.worker": worker.address,
                "splitserve.tokens_sent": len(tokens_sent),
                "error": error,
            },
        )
        logger.warning(
            "req_id=%s decode on %s failed after %d tokens (%s); moving on",
            self.req_id,
            worker.address,
            len(tokens_sent),
            error,
        )
        del self.decode_request.output_token_ids[:]
        self.decode_request.output_token_ids.extend(tokens_sent)
        self.decode_request.ClearField("kv_ref")
        self.decode_request.ClearField("kv_peer")
        self.holdings.drop_lease()

    async def _await_decode_worker(
        self, prompt_blocks: int, matched: dict[str, int], tried: set[str]
    ) -> DecodeCandidate:
        """A decode worker not in ``tried`` for a request that has none (none routable when it
        arrived, or its worker failed and no other is routable), waited for up to
        ``--decode-failover-wait-s`` (at most until the client's deadline). Aborts the call
        (UNAVAILABLE) if none came."""
        remaining_s = self._context.time_remaining()
        wait_s = self._config.decode_failover_wait_s
        if remaining_s is not None:
            wait_s = min(wait_s, remaining_s)
        logger.info(
            "req_id=%s no%s decode worker is routable; waiting up to %.1f s for one",
            self.req_id,
            " other" if tried else "",
            wait_s,
        )
        candidate = await self._planner.decode_chooser.wait_for(
            prompt_blocks,
            matched,
            tried,
            wait_s,
            self._config.health_check_interval_s,
            self.prepared.target,
        )
        if candidate is None:
            await abort(self._context, grpc.StatusCode.UNAVAILABLE, "no healthy decode worker")
        return candidate

    def _call_span(self, name: str, worker: WorkerHandle) -> Span:
        """The CLIENT span of one worker call, under the request's; its context goes out as
        the call's metadata."""
        return self._routing.tracing.start_child(
            self._span,
            name,
            kind=SpanKind.CLIENT,
            attributes={"splitserve.worker": worker.address},
        )

    def _call_timeout_s(self) -> float:
        """A worker call's deadline: the client's, capped by ``--worker-call-timeout-s``."""
        remaining_s = self._context.time_remaining()
        cap_s = self._config.worker_call_timeout_s
        return cap_s if remaining_s is None else min(remaining_s, cap_s)

    async def _worker_failed(self, worker: WorkerHandle, exc: grpc.aio.AioRpcError) -> None:
        """Fail the call if retrying cannot help (see ``FailurePolicy``); else mark the worker
        unhealthy (until a poll succeeds) so that the run moves on to another path."""
        remaining_s = self._context.time_remaining()
        deadline_was_ours = remaining_s is None or remaining_s > 0
        failure = self.failures.judge(exc, worker.role, deadline_was_ours)
        if failure is not None:
            await abort(self._context, failure.code, failure.details)
        worker.mark_failed(f"{exc.code().name}: {exc.details()}")
