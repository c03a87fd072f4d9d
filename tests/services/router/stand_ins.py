"""Stand-in prefill and decode workers: real gRPC servers (``start_server``) that answer the
router's calls without an engine, for router tests that need worker behaviour the real workers
do not show on demand (a stream ending without its final message, a pool that is not routable).

Both generate the same deterministic tokens: the token at output position ``i`` of a prompt of
``n`` tokens is ``token_at(n, i)``, so a decode worker continues exactly where another one, or
the prefill worker, left off, as real workers do under greedy sampling.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from services.common.grpc_server import ServingServer, start_server
from splitserve.v1 import worker_pb2, worker_pb2_grpc

VOCAB_SIZE = 489  # the tiny test model's
MAX_MODEL_LEN = 256
BLOCK_SIZE = 16
PREFILL_SERVICE = "splitserve.v1.PrefillWorker"
DECODE_SERVICE = "splitserve.v1.DecodeWorker"


def token_at(prompt_len: int, position: int) -> int:
    """The token every stand-in generates at output ``position`` after a prompt of
    ``prompt_len`` tokens (never a special token of the tiny model)."""
    return 3 + (prompt_len * 7 + position) % 100


def _info(
    worker_id: str, role: worker_pb2.WorkerRole, model: str, scheduling_policy: str = "fcfs"
) -> worker_pb2.WorkerInfo:
    return worker_pb2.WorkerInfo(
        worker_id=worker_id,
        role=role,
        served_model_name=model,
        scheduling_policy=scheduling_policy,
        vocab_size=VOCAB_SIZE,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        kv_peer=worker_pb2.KVPeerInfo(backend="tcp", compat_hash="stand-in"),
    )


@dataclass
class StandInDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """A decode worker: streams one token per message up to ``max_tokens``, the last one as the
    final message (``finish_reason`` length).

    ``routable`` False reports the worker shutting down (the router sends it nothing new);
    ``end_after`` ends each stream OK after that many tokens without a final message;
    ``running`` is the load it reports. ``requests`` records every ``Decode`` call.
    """

    worker_id: str
    # The served model it reports (the harness sets the router's --model).
    model: str = ""
    scheduling_policy: str = "fcfs"
    routable: bool = True
    end_after: int | None = None
    running: int = 0
    requests: list[worker_pb2.DecodeRequest] = field(default_factory=list)

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        self.requests.append(request)
        prompt_len = len(request.prompt_token_ids)
        max_tokens = request.sampling.max_tokens
        for sent, position in enumerate(range(len(request.output_token_ids), max_tokens)):
            if self.end_after is not None and sent == self.end_after:
                return
            last = position == max_tokens - 1
            yield worker_pb2.DecodeResponse(
                token_ids=[token_at(prompt_len, position)],
                finished=last,
                finish_reason="length" if last else "",
            )

    async def GetInfo(
        self, request: worker_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        return _info(
            self.worker_id, worker_pb2.WORKER_ROLE_DECODE, self.model, self.scheduling_policy
        )

    async def GetLoad(
        self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerLoad:
        return worker_pb2.WorkerLoad(num_running=self.running, shutting_down=not self.routable)


@dataclass
class StandInPrefill(worker_pb2_grpc.PrefillWorkerServicer):
    """A prefill worker: answers each ``Prefill`` with the first token and a lease (a ``KVRef``
    of one block per ``BLOCK_SIZE`` prompt tokens). ``requests`` records every ``Prefill``
    call, ``released`` every ``Release``."""

    worker_id: str
    model: str = ""  # as StandInDecode's
    requests: list[worker_pb2.PrefillRequest] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    # Set: each Prefill answers only once it is (a long prefill step in progress).
    hold: asyncio.Event | None = None

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        self.requests.append(request)
        if self.hold is not None:
            await self.hold.wait()
        prompt_len = len(request.prompt_token_ids)
        return worker_pb2.PrefillResponse(
            token_id=token_at(prompt_len, 0),
            kv_ref=worker_pb2.KVRef(
                engine_id=self.worker_id,
                req_id=request.request_id,
                block_ids=range(prompt_len // BLOCK_SIZE),
                num_tokens=prompt_len,
                grant=b"stand-in grant",
            ),
            kv_peer=worker_pb2.KVPeerInfo(engine_id=self.worker_id, backend="inproc"),
        )

    async def Release(
        self, request: worker_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseResponse:
        self.released.append(request.request_id)
        return worker_pb2.ReleaseResponse(released=True)

    async def GetInfo(
        self, request: worker_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        return _info(self.worker_id, worker_pb2.WORKER_ROLE_PREFILL, self.model)

    async def GetLoad(
        self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerLoad:
        return worker_pb2.WorkerLoad()


async def serve_decode(servicer: StandInDecode) -> ServingServer:
    """Serve ``servicer`` on a free loopback port (``ServingServer.port``), SERVING."""
    serving = await start_server(
        "127.0.0.1",
        0,
        lambda server: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server),
        (DECODE_SERVICE,),
    )
    await serving.set_serving((DECODE_SERVICE,))
    return serving


async def serve_prefill(servicer: StandInPrefill) -> ServingServer:
    """Serve ``servicer`` on a free loopback port (``ServingServer.port``), SERVING."""
    serving = await start_server(
        "127.0.0.1",
        0,
        lambda server: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server),
        (PREFILL_SERVICE,),
    )
    await serving.set_serving((PREFILL_SERVICE,))
    return serving
