"""What the prefill and decode servicers share: a call's sampling parameters, the engine's
errors as the call's status, ``GetInfo`` and ``GetLoad``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Generic

import grpc

from engine.sampling_params import SamplingParams
from engine.scheduler import DuplicateRequestError
from services.common.convert import sampling_params_from_worker
from services.common.failures import FailureKind, abort_with
from services.worker.engine_loop import EngineDeadError, StreamEndedError
from services.worker.runtime import HooksT, WorkerRuntime
from splitserve.v1 import worker_pb2


class WorkerServicerBase(Generic[HooksT]):
    """The part of a worker's gRPC servicer that does not depend on its role; a role's
    servicer adds its calls and ``load``. ``hooks`` are the role's engine-loop hooks (they
    run on the engine thread). Handlers run on the asyncio loop."""

    def __init__(self, runtime: WorkerRuntime, hooks: HooksT) -> None:
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
