"""What the prefill and decode servicers share: a call's sampling parameters, the engine's
errors as the call's status, ``PinPrefix`` and ``Release`` (every worker is a KV source),
``GetInfo``, ``GetLoad`` and the LoRA calls."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from engine.backend import EngineBackend
from engine.sampling_params import SamplingParams
from engine.scheduler import DuplicateRequestError
from kvtransfer.base import KVRef
from services.common.convert import kv_ref_to_proto, peer_info_to_proto, sampling_params_from_worker
from services.common.failures import FailureKind, abort_with
from services.worker.engine_loop import EngineDeadError, StreamEndedError
from services.worker.kv_hooks import KVHooks
from services.worker.kv_leases import Lease
from services.worker.runtime import WorkerRuntime
from splitserve.v1 import worker_pb2


class WorkerServicerBase:
    """The part of a worker's gRPC servicer that does not depend on its role; a role's
    servicer adds its calls and ``load``. ``hooks`` are the engine loop's KV hooks (they run
    on the engine thread). Handlers run on the asyncio loop."""

    def __init__(self, runtime: WorkerRuntime, hooks: KVHooks) -> None:
        self.runtime = runtime
        self.hooks = hooks

    async def sampling_params(
        self, sampling: worker_pb2.WorkerSamplingParams, context: grpc.aio.ServicerContext
    ) -> SamplingParams:
        """A new call's parameters: UNAVAILABLE while the worker drains, INVALID_ARGUMENT
        naming the field when ``sampling`` is not valid or its constraint does not compile
        (compiled here, off the engine thread)."""
        await self.runtime.refuse_if_shutting_down(context)
        try:
            params = sampling_params_from_worker(sampling)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.{exc}")
        await self.runtime.compile_constraint(params, context)
        return params

    async def PinPrefix(
        self, request: worker_pb2.PinPrefixRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PinPrefixResponse:
        """Lease the longest cached run of the prompt's blocks for a peer (see
        ``LeaseHooks.pin``); no ``kv_ref`` when none is cached or the engine's KV does not
        move. ALREADY_EXISTS when ``pin_id`` is in use here."""
        await self.runtime.refuse_if_shutting_down(context)
        kv_peer = self.runtime.kv_peer
        response = worker_pb2.PinPrefixResponse()
        if kv_peer is None or request.max_blocks == 0:
            return response
        pin_id, prompt = request.pin_id, list(request.prompt_token_ids)
        if not pin_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "pin_id: must not be empty")

        def pin(engine: EngineBackend) -> Lease | None:
            return self.hooks.leases.pin(
                engine,
                pin_id,
                prompt,
                request.max_blocks,
                cache_salt=request.cache_salt,
                lora_name=request.lora_name,
                ttl_s=max(request.ttl_s, 0.0),
            )

        async with engine_errors(context):
            lease = await self.runtime.loop.call(pin)
        if lease is None:
            return response
        block_size = self.runtime.engine.info.block_size
        ref = KVRef(
            engine_id=kv_peer.engine_id,
            req_id=pin_id,
            block_ids=lease.block_ids,
            num_tokens=len(lease.block_ids) * block_size,
            grant=lease.grant,
        )
        response.kv_ref.CopyFrom(kv_ref_to_proto(ref))
        response.kv_peer.CopyFrom(peer_info_to_proto(kv_peer))
        return response

    async def Release(
        self, request: worker_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseResponse:
        """Drop ``request_id``: end its lease (a finished prefill's, a pinned prefix's) and
        abort it if it runs. Idempotent."""
        req_id = request.request_id
        loop = self.runtime.loop
        released = await loop.call(lambda e: self.hooks.leases.release(e, req_id))
        aborted = await loop.abort_and_wait(req_id)
        return worker_pb2.ReleaseResponse(released=released or aborted)

    async def GetInfo(
        self, request: worker_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        return self.runtime.info()

    async def GetLoad(
        self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerLoad:
        load = self.load()
        load.lora_adapters.extend(self._lora_adapters())
        return load

    async def LoadLoraAdapter(
        self, request: worker_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.LoraAdapterResponse:
        """Load on the engine thread, between steps; INVALID_ARGUMENT saying why not."""
        name, path = request.lora_name, request.lora_path
        async with engine_errors(context):
            await self.runtime.loop.call(lambda engine: engine.load_lora_adapter(name, path))
        return worker_pb2.LoraAdapterResponse(lora_adapters=self._lora_adapters())

    async def UnloadLoraAdapter(
        self, request: worker_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.LoraAdapterResponse:
        """Unload on the engine thread; INVALID_ARGUMENT when not loaded or in use."""
        name = request.lora_name
        async with engine_errors(context):
            await self.runtime.loop.call(lambda engine: engine.unload_lora_adapter(name))
        return worker_pb2.LoraAdapterResponse(lora_adapters=self._lora_adapters())

    def _lora_adapters(self) -> list[worker_pb2.LoraAdapterInfo]:
        return [
            worker_pb2.LoraAdapterInfo(name=name, block_key=key)
            for name, key in self.runtime.engine.lora_adapters.items()
        ]

    def load(self) -> worker_pb2.WorkerLoad:
        """What ``GetLoad`` returns: the engine's latest stats plus the role's counters."""
        raise NotImplementedError


@contextlib.asynccontextmanager
async def engine_errors(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """End the call with the status of an engine error raised inside: ALREADY_EXISTS for a
    request id in flight or holding KV, INVALID_ARGUMENT for a request the engine refuses,
    UNAVAILABLE (marked, so that routers retry elsewhere) when the engine died or the worker
    ended the stream to shut down."""
    try:
        yield
    except DuplicateRequestError as exc:
        await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
    except ValueError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    except EngineDeadError as exc:
        await abort_with(context, grpc.StatusCode.UNAVAILABLE, FailureKind.ENGINE_DEAD, str(exc))
    except StreamEndedError as exc:
        await abort_with(context, grpc.StatusCode.UNAVAILABLE, FailureKind.SHUTDOWN, str(exc))
