"""``DecodeWorker`` gRPC service: the engine in decode role.

A request arrives with its prompt and the tokens already sampled (the prefill worker's first
token). With a ``KVRef`` the prompt's KV is pulled (see ``kv_puller``); without one, or when the
pull fails, the prompt is prefilled here (colocated mode, no prefill worker, failed transfer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
from opentelemetry.trace import Span

from engine.backend import EngineBackend
from engine.outputs import RequestOutput
from kvtransfer.base import KVRef
from services.common.convert import (
    kv_ref_from_proto,
    load_to_proto,
    logprobs_to_proto,
    peer_info_from_proto,
)
from services.common.failures import FailureKind, abort_with
from services.common.roles import Role
from services.common.stream_writer import StreamWriter
from services.common.tracing import ending
from services.decode.spans import record_decode
from services.worker.config import WorkerConfig
from services.worker.kv_puller import PullResult
from services.worker.runtime import RunningWorker, WorkerService, start_worker
from services.worker.servicer import WorkerServicerBase, engine_errors
from splitserve.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)


class DecodeServicer(WorkerServicerBase, worker_pb2_grpc.DecodeWorkerServicer):
    """Handlers run on the asyncio loop; the engine runs on ``runtime.loop``'s thread, with
    the KV puller and leases (``hooks``) around its steps."""

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Stream the request's tokens with ``context.write``; a write its reader leaves
        blocked for ``--stream-idle-timeout-s`` aborts the request (ABORTED, not retried).
        Traced under the router's call when it carries a trace context."""
        with ending(self.runtime.start_call_span("decode", context, request.request_id)) as span:
            await self._decode(request, context, span)

    async def _decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext, span: Span
    ) -> None:
        req_id = request.request_id
        params = await self.sampling_params(request.sampling, context)
        prompt = list(request.prompt_token_ids)
        output_token_ids = list(request.output_token_ids)
        src: KVRef | None = None
        if request.HasField("kv_ref"):
            src = kv_ref_from_proto(request.kv_ref)
            error = self._check_kv_ref(src, len(prompt), params.prompt_logprobs)
            if error:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        peer = peer_info_from_proto(request.kv_peer)

        salt = request.cache_salt

        def add(engine: EngineBackend) -> None:
            self.hooks.puller.add_request(
                engine,
                req_id,
                src,
                peer,
                lambda num_external_tokens: engine.add_request(
                    req_id,
                    prompt,
                    params,
                    output_token_ids=output_token_ids,
                    num_external_tokens=num_external_tokens,
                    cache_salt=salt,
                    priority=request.priority,
                    lora_name=request.lora_name,
                ),
            )

        outputs = self.runtime.loop.generate(req_id, add)
        stalled = False
        writer = StreamWriter(context, self.runtime.config.stream_idle_timeout_s)
        num_generated_tokens = 0
        last_output_s: float | None = None
        metrics = self.runtime.metrics
        try:
            async with engine_errors(context), contextlib.aclosing(outputs):
                # Closing the outputs aborts an unfinished request.
                async for output in outputs:
                    now_s = time.perf_counter()
                    num_new_tokens = len(output.new_token_ids)
                    gap_s = None if last_output_s is None else now_s - last_output_s
                    if metrics is not None:
                        metrics.tokens_streamed(num_new_tokens, gap_s)
                    num_generated_tokens += num_new_tokens
                    if num_new_tokens:
                        last_output_s = now_s
                    if output.error is not None:
                        await abort_with(
                            context, grpc.StatusCode.INTERNAL, FailureKind.REQUEST, output.error
                        )
                    # Taken with the final output; a request that ended otherwise leaves it.
                    pull = self.hooks.puller.take_result(req_id) if output.finished else None
                    response = self._response(output, pull)
                    if output.finished:
                        record_decode(
                            self.runtime.tracing, span, output, num_generated_tokens, pull
                        )
                        if metrics is not None:
                            metrics.engine_request_finished(output, num_generated_tokens)
                    if not await writer.write(response):
                        stalled = True
                        break
        except asyncio.CancelledError:
            logger.info("req_id=%s cancelled by the caller", req_id)
            raise
        finally:
            self.hooks.puller.take_result(req_id)
        if stalled:
            idle_s = writer.idle_s
            logger.warning("req_id=%s aborted: its reader took no output for %g s", req_id, idle_s)
            # The request is aborted already (its KV freed); the status reaches the reader
            # after the message it has not taken (StreamWriter).
            await writer.abort(
                grpc.StatusCode.ABORTED,
                FailureKind.REQUEST,
                f"the reader took no output for {idle_s:g} s (--stream-idle-timeout-s)",
            )

    def _check_kv_ref(
        self, src: KVRef, num_prompt_tokens: int, prompt_logprobs: int | None
    ) -> str | None:
        block_size = self.runtime.engine.info.block_size
        if prompt_logprobs is not None:
            # A pulled prompt is not computed here: its logprobs are the prefill worker's.
            return "kv_ref: a prompt pulled from a prefill worker has no prompt_logprobs here"
        if src.num_tokens != num_prompt_tokens:
            return f"kv_ref: covers {src.num_tokens} tokens, the prompt has {num_prompt_tokens}"
        if len(src.block_ids) != -(-src.num_tokens // block_size):
            return (
                f"kv_ref: {len(src.block_ids)} blocks cannot hold {src.num_tokens} tokens "
                f"of block_size {block_size}"
            )
        return None

    @staticmethod
    def _response(output: RequestOutput, pull: PullResult | None) -> worker_pb2.DecodeResponse:
        new_ids = output.new_token_ids
        response = worker_pb2.DecodeResponse(token_ids=new_ids, finished=output.finished)
        if output.new_logprobs:
            response.logprobs.extend(logprobs_to_proto(lp) for lp in output.new_logprobs)
        if output.prompt_logprobs:
            response.prompt_logprobs.extend(map(logprobs_to_proto, output.prompt_logprobs))
        if output.finished:
            response.finish_reason = output.finish_reason or ""
            if output.stop_reason is not None:
                response.stop_reason = str(output.stop_reason)
            response.num_cached_tokens = output.num_cached_tokens
            response.num_tier_tokens = output.num_tier_tokens
            if pull is not None:
                response.num_transferred_blocks = pull.num_transferred_blocks
                response.kv_transfer_failed = pull.failed
        return response

    def load(self) -> worker_pb2.WorkerLoad:
        return load_to_proto(
            self.runtime.loop.stats,
            num_transfers_failed=self.hooks.puller.num_transfers_failed,
            num_kv_leases=self.hooks.leases.num_leases,
            num_leases_expired=self.hooks.leases.num_leases_expired,
            shutting_down=self.runtime.shutting_down,
        )


DECODE_WORKER = WorkerService(
    Role.DECODE,
    "splitserve.v1.DecodeWorker",
    DecodeServicer,
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server,
)


async def start_decode_worker(config: WorkerConfig) -> RunningWorker:
    """Load the engine and serve ``DecodeWorker``; health is SERVING on return."""
    return await start_worker(config, DECODE_WORKER)
