"""``PrefillWorker`` gRPC service: the engine in prefill role.

A prefill runs the request with ``max_tokens=1``: prefix-cache hits are reused, the rest of the
prompt is computed, the first token is sampled. Unless that token already ends the request, the
prompt's blocks stay pinned under a lease (see ``kv_leases``) and the response carries a
``KVRef`` the decode worker pulls them with, including the lease's grant, without which the KV
transfer backend refuses the pull.

With a ``peer_kv_ref`` (a prefix another worker pinned for this prompt: ``PinPrefix``) the
prefix's blocks past this worker's own hits are pulled from that peer instead of computed
(``kv_puller``); a failed pull computes them, with the same tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import grpc
from opentelemetry.trace import Span

from engine.backend import EngineBackend
from engine.outputs import RequestOutput
from kvtransfer.base import KVRef
from services.common.convert import (
    kv_ref_from_proto,
    kv_ref_to_proto,
    load_to_proto,
    logprobs_to_proto,
    peer_info_from_proto,
    peer_info_to_proto,
)
from services.common.failures import FailureKind, abort_with
from services.common.roles import Role
from services.common.tracing import ending
from services.prefill.spans import record_prefill
from services.worker.config import WorkerConfig
from services.worker.runtime import RunningWorker, WorkerService, start_worker
from services.worker.servicer import WorkerServicerBase, engine_errors
from splitserve.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)


class PrefillServicer(WorkerServicerBase, worker_pb2_grpc.PrefillWorkerServicer):
    """Handlers run on the asyncio loop; the engine, with the leases and the puller
    (``hooks``) around its steps, on ``runtime.loop``'s thread."""

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        """Prefill the prompt, sample its first token and lease its blocks (see the module);
        traced under the router's call when it carries a trace context."""
        with ending(self.runtime.start_call_span("prefill", context, request.request_id)) as span:
            return await self._prefill(request, context, span)

    async def _prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext, span: Span
    ) -> worker_pb2.PrefillResponse:
        req_id = request.request_id
        params = await self.sampling_params(request.sampling, context)
        prompt = list(request.prompt_token_ids)
        hold_kv = params.max_tokens > 1
        salt = request.cache_salt
        first_token_params = dataclasses.replace(params, max_tokens=1)
        src: KVRef | None = None
        if request.HasField("peer_kv_ref"):
            src = kv_ref_from_proto(request.peer_kv_ref)
            error = self._check_peer_kv_ref(src, len(prompt), params.prompt_logprobs)
            if error:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        peer = peer_info_from_proto(request.peer_kv_peer)
        puller, leases = self.hooks.puller, self.hooks.leases

        def add(engine: EngineBackend) -> None:
            puller.add_request(
                engine,
                req_id,
                src,
                peer,
                lambda num_external_tokens: engine.add_request(
                    req_id,
                    prompt,
                    first_token_params,
                    num_external_tokens=num_external_tokens,
                    hold_kv=hold_kv,
                    cache_salt=salt,
                    priority=request.priority,
                    lora_name=request.lora_name,
                ),
            )
            # Added: it finishes (and leases its blocks) on a later step of this thread.
            leases.wait_for_reader(req_id, request.kv_lease_ttl_s)

        loop = self.runtime.loop
        final: RequestOutput | None = None
        try:
            async with engine_errors(context):
                async for output in loop.generate(req_id, add):
                    final = output
        except asyncio.CancelledError:
            # The request may have finished (and leased its blocks) just before the cancel.
            loop.abort(req_id)
            raise
        finally:
            pull = puller.take_result(req_id)
        assert final is not None and final.finished
        record_prefill(self.runtime.tracing, span, final)
        if (metrics := self.runtime.metrics) is not None:
            metrics.tokens_streamed(len(final.token_ids), None)
            metrics.engine_request_finished(final, len(final.token_ids))
        if final.error is not None:
            await abort_with(context, grpc.StatusCode.INTERNAL, FailureKind.REQUEST, final.error)
        response = await self._respond(req_id, prompt, params.max_tokens, final)
        if pull is not None:
            response.num_peer_blocks = pull.num_transferred_blocks
            response.peer_pull_failed = pull.failed
        return response

    def _check_peer_kv_ref(
        self, src: KVRef, num_prompt_tokens: int, prompt_logprobs: int | None
    ) -> str | None:
        block_size = self.runtime.engine.info.block_size
        if prompt_logprobs is not None:
            return "peer_kv_ref: a prompt asking for prompt_logprobs computes every token"
        if not 0 < src.num_tokens < num_prompt_tokens or src.num_tokens % block_size:
            return (
                f"peer_kv_ref: covers {src.num_tokens} tokens; a peer's prefix is whole blocks "
                f"of {block_size} and shorter than the prompt's {num_prompt_tokens}"
            )
        if len(src.block_ids) != src.num_tokens // block_size:
            return f"peer_kv_ref: {len(src.block_ids)} blocks for {src.num_tokens} tokens"
        return None

    async def _respond(
        self, req_id: str, prompt: list[int], max_tokens: int, final: RequestOutput
    ) -> worker_pb2.PrefillResponse:
        token_id = final.token_ids[0]
        assert final.first_token_time_s is not None
        # A prefill worker's engine always has a KV cache to share (worker.config's
        # engine_unavailable refuses the others at start).
        kv_peer = self.runtime.kv_peer
        assert kv_peer is not None
        response = worker_pb2.PrefillResponse(
            token_id=token_id,
            num_cached_tokens=final.num_cached_tokens,
            num_tier_tokens=final.num_tier_tokens,
            kv_peer=peer_info_to_proto(kv_peer),
            prefill_time_s=final.first_token_time_s - final.arrival_time_s,
        )
        if final.logprobs:
            response.logprob.CopyFrom(logprobs_to_proto(final.logprobs[0]))
        if final.prompt_logprobs:
            response.prompt_logprobs.extend(map(logprobs_to_proto, final.prompt_logprobs))
        # "length" only means the max_tokens=1 cap of the prefill unless the client asked for 1.
        if final.finish_reason == "stop" or max_tokens == 1:
            response.finished = True
            response.finish_reason = final.finish_reason or "length"
            if final.stop_reason is not None:
                response.stop_reason = str(final.stop_reason)
            await self.runtime.loop.call(lambda e: self.hooks.leases.release(e, req_id))
            return response
        lease = self.hooks.leases.get(req_id)
        assert lease is not None, f"req_id={req_id} finished prefill without a lease"
        ref = KVRef(
            engine_id=kv_peer.engine_id,
            req_id=req_id,
            block_ids=lease.block_ids,
            num_tokens=len(prompt),
            grant=lease.grant,
        )
        response.kv_ref.CopyFrom(kv_ref_to_proto(ref))
        logger.debug("req_id=%s prefilled: %d blocks leased", req_id, len(lease.block_ids))
        return response

    def load(self) -> worker_pb2.WorkerLoad:
        return load_to_proto(
            self.runtime.loop.stats,
            num_kv_leases=self.hooks.leases.num_leases,
            num_leases_expired=self.hooks.leases.num_leases_expired,
            num_transfers_failed=self.hooks.puller.num_transfers_failed,
            shutting_down=self.runtime.shutting_down,
        )


PREFILL_WORKER = WorkerService(
    Role.PREFILL,
    "splitserve.v1.PrefillWorker",
    PrefillServicer,
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server,
)


async def start_prefill_worker(config: WorkerConfig) -> RunningWorker:
    """Load the engine and serve ``PrefillWorker``; health is SERVING on return."""
    return await start_worker(config, PREFILL_WORKER)
