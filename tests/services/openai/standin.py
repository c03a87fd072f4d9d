"""A real router, in this process, over a stand-in decode worker whose generation the test
controls: it streams ``max_tokens`` tokens as fast as they are read, or stops after
``stall_after`` of them until its call is cancelled (a generation that cannot finish, on any
host), and counts what it sent and which calls were cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from services.router.app import RunningRouter, start_router
from services.router.config import RouterConfig
from splitserve.v1 import worker_pb2, worker_pb2_grpc

MAX_MODEL_LEN = 100_000
# Token ids the stand-in cycles through (each decodes to text with the tiny model's tokenizer).
_TOKEN_IDS = tuple(range(300, 340))


class StandInDecodeWorker(worker_pb2_grpc.DecodeWorkerServicer):
    """A decode worker without an engine; every counter is read on the event loop's thread."""

    def __init__(self, vocab_size: int, stall_after: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.stall_after = stall_after
        # The served model it reports and where that model is (what a router loads its
        # tokenizer from): the router's --model unless set before ``standin_router``.
        self.model = ""
        self.model_path = ""
        self.num_calls = 0
        self.num_sent = 0
        self.num_cancelled = 0
        self.num_running = 0

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        self.num_calls += 1
        self.num_running += 1
        sampling = request.sampling
        sent_all = False
        try:
            for i in range(sampling.max_tokens):
                if self.stall_after is not None and i >= self.stall_after:
                    await asyncio.Event().wait()  # until the router cancels the call
                token_id = _TOKEN_IDS[i % len(_TOKEN_IDS)]
                last = i + 1 == sampling.max_tokens
                message = worker_pb2.DecodeResponse(
                    token_ids=[token_id], finished=last, finish_reason="length" if last else ""
                )
                if sampling.HasField("logprobs"):
                    top = [
                        worker_pb2.TopLogprob(token_id=t, logprob=-1.0 - k)
                        for k, t in enumerate(_TOKEN_IDS[: sampling.logprobs])
                    ]
                    message.logprobs.append(
                        worker_pb2.TokenLogprob(token_id=token_id, logprob=-0.5, rank=1, top=top)
                    )
                yield message
                self.num_sent += 1
            sent_all = True
        finally:
            # Ended early: grpc.aio closes a cancelled call's generator (GeneratorExit) or
            # cancels it, depending on where it waits.
            self.num_cancelled += not sent_all
            self.num_running -= 1

    async def GetInfo(
        self, request: worker_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(
            worker_id="stand-in",
            served_model_name=self.model,
            model=self.model_path,
            vocab_size=self.vocab_size,
            max_model_len=MAX_MODEL_LEN,
            block_size=16,
            kv_peer=worker_pb2.KVPeerInfo(backend="tcp", compat_hash="stand-in"),
        )

    async def GetLoad(
        self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerLoad:
        return worker_pb2.WorkerLoad(num_running=self.num_running, num_total_blocks=1024)


def vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


@contextlib.asynccontextmanager
async def standin_router(
    model_dir: Path,
    worker: StandInDecodeWorker,
    others: Sequence[StandInDecodeWorker] = (),
    **flags: Any,
) -> AsyncIterator[RunningRouter]:
    """A router (gRPC and HTTP on free ports, ``flags`` as its config's fields) whose decode
    worker of its model, colocated, is ``worker``, and ``others`` more decode workers (of the
    models they report); all stopped on exit."""
    worker.model = flags.get("served_model_name") or str(model_dir)
    worker.model_path = str(model_dir)
    servers: list[grpc.aio.Server] = []
    addresses = []
    for servicer in (worker, *others):
        server = grpc.aio.server()
        servers.append(server)
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        await server.start()
    try:
        config = RouterConfig(
            model=str(model_dir),
            port=0,
            http_port=0,
            decode_workers=",".join(addresses),
            mode="colocated",
            **flags,
        )
        router = await start_router(config)
        try:
            yield router
        finally:
            await router.stop(0)
    finally:
        await asyncio.gather(*(server.stop(0) for server in servers))


async def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    """Poll ``predicate`` on the loop (so the router keeps running) until it is true."""
    loop = asyncio.get_running_loop()
    deadline_s = loop.time() + timeout_s
    while not predicate():
        if loop.time() >= deadline_s:
            raise AssertionError(f"{what} not within {timeout_s:g} s")
        await asyncio.sleep(0.02)


def freed(router: RunningRouter, worker: StandInDecodeWorker) -> bool:
    """No request in flight on the router, none counted on its worker, none running there."""
    (handle,) = router.servicer.decode_pool.workers
    return (
        router.servicer._num_inflight == 0 and handle.num_inflight == 0 and not (worker.num_running)
    )
