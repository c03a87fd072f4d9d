"""A worker compiles a request's constraint off its engine thread, within the budget: its other
requests stream on while the compile runs, and a constraint over the budget (size or time) or
past llguidance's limits is INVALID_ARGUMENT with a sentence naming the field and the limit.
A request added to the engine loop before its grammar compiled waits in the engine, is aborted
there or admitted once the compile is done. Real decode workers started in this process,
called over gRPC or through their engine loop."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from engine import LLMEngine, SamplingParams
from engine.constraint import MAX_GRAMMAR_SYMBOLS, Constraint, ConstraintKind, ConstraintLimits
from services.common.convert import sampling_params_to_worker
from services.decode.server import start_decode_worker
from services.worker.config import WorkerConfig
from splitserve.v1 import worker_pb2, worker_pb2_grpc
from tests.engine.test_constrained_generation import CHOICES, gated_grammars
from tests.services.conftest import tiny_engine_config
from tests.waiting import wait_until

PROMPT = [5, 6, 7, 8, 9]


def decode_request(request_id: str, params: SamplingParams) -> worker_pb2.DecodeRequest:
    return worker_pb2.DecodeRequest(
        request_id=request_id, prompt_token_ids=PROMPT, sampling=sampling_params_to_worker(params)
    )


def worker_config(model_dir: Path, limits: ConstraintLimits) -> WorkerConfig:
    engine = dataclasses.replace(tiny_engine_config(model_dir), constraint_limits=limits)
    return WorkerConfig(engine=engine, port=0, kv_transfer="tcp")


def test_a_worker_streams_its_other_requests_while_a_constraint_compiles(tiny_llama_dir):
    choice = Constraint(ConstraintKind.CHOICE, choices=CHOICES)
    guided = decode_request("guided", SamplingParams(temperature=0.0, constraint=choice))
    plain = decode_request("plain", SamplingParams(max_tokens=30, ignore_eos=True))
    gate = threading.Event()

    async def main() -> None:
        worker = await start_decode_worker(worker_config(tiny_llama_dir, ConstraintLimits()))
        engine = worker.runtime.engine
        engine.grammars = gated_grammars(engine, gate)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
                stub = worker_pb2_grpc.DecodeWorkerStub(channel)
                guided_call = stub.Decode(guided, timeout=60)
                first_guided = asyncio.ensure_future(guided_call.read())
                await asyncio.to_thread(
                    wait_until, lambda: engine.grammars.num_misses, 30, "the guided compile"
                )
                plain_tokens = [
                    t async for m in stub.Decode(plain, timeout=60) for t in m.token_ids
                ]
                assert len(plain_tokens) == 30
                assert not first_guided.done()  # still compiling
                gate.set()
                messages = [await first_guided]
                while (message := await guided_call.read()) != grpc.aio.EOF:
                    messages.append(message)
                text = engine.tokenizer.decode([t for m in messages for t in m.token_ids])
                assert messages[-1].finish_reason == "stop" and text in CHOICES
        finally:
            gate.set()
            await worker.stop(grace_s=0.0)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("constraint", "details"),
    [
        (
            Constraint(ConstraintKind.CHOICE, choices=tuple(f"c{i}" for i in range(100_000))),
            "sampling.constraint.choice: 100000 choices, more than 10000",
        ),
        (
            Constraint(ConstraintKind.GRAMMAR, "start: " + '("a") ' * 66_000),
            f"sampling.constraint.grammar: the grammar has more than {MAX_GRAMMAR_SYMBOLS} "
            "symbols (literals and rules), llguidance's limit",
        ),
    ],
    ids=["too_many_choices", "too_many_symbols"],
)
def test_a_constraint_that_cannot_compile_is_invalid_argument_in_a_sentence(
    tiny_llama_dir, constraint, details
):
    # Sizes above the router's, so that llguidance's own limit is what the worker meets.
    limits = ConstraintLimits(max_bytes=2**20)

    async def main() -> None:
        worker = await start_decode_worker(worker_config(tiny_llama_dir, limits))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
                stub = worker_pb2_grpc.DecodeWorkerStub(channel)
                request = decode_request("bad", SamplingParams(constraint=constraint))
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Decode(request, timeout=60).read()
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert refused.value.details() == details
        finally:
            await worker.stop(grace_s=0.0)

    asyncio.run(main())


def test_a_constraint_that_outlasts_its_budget_is_invalid_argument(tiny_llama_dir):
    regex = Constraint(ConstraintKind.REGEX, "[a-z]{4}")
    gate = threading.Event()

    async def main() -> None:
        limits = ConstraintLimits(compile_timeout_s=0.1)
        worker = await start_decode_worker(worker_config(tiny_llama_dir, limits))
        engine = worker.runtime.engine
        engine.grammars = gated_grammars(engine, gate)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
                stub = worker_pb2_grpc.DecodeWorkerStub(channel)
                request = decode_request("slow", SamplingParams(constraint=regex))
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Decode(request, timeout=60).read()
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert refused.value.details().startswith(
                    "sampling.constraint.regex: not compiled within 0.1 s"
                )
                assert not engine.has_unfinished_requests()  # never reached the engine
        finally:
            gate.set()
            await worker.stop(grace_s=0.0)

    asyncio.run(main())


def test_a_request_held_for_its_grammar_in_the_engine_loop_is_aborted_or_admitted(
    tiny_llama_dir,
):
    gate = threading.Event()

    def add(req_id: str, constraint: Constraint) -> Callable[[LLMEngine], None]:
        params = SamplingParams(temperature=0.0, constraint=constraint)
        return lambda engine: engine.add_request(req_id, PROMPT, params)

    async def main() -> None:
        worker = await start_decode_worker(worker_config(tiny_llama_dir, ConstraintLimits()))
        loop, engine = worker.runtime.loop, worker.runtime.engine
        engine.grammars = gated_grammars(engine, gate)

        async def compiles_started(count: int) -> None:
            await asyncio.to_thread(
                wait_until, lambda: engine.grammars.num_misses == count, 30, "the compile"
            )

        try:
            choice = Constraint(ConstraintKind.CHOICE, choices=CHOICES)
            held = loop.generate("aborted", add("aborted", choice))
            first = asyncio.ensure_future(anext(held))
            await compiles_started(1)
            assert await loop.abort_and_wait("aborted")
            assert (await first).finish_reason == "abort"
            regex = Constraint(ConstraintKind.REGEX, "[a-z]{2,6}")
            admitted = loop.generate("admitted", add("admitted", regex))
            first = asyncio.ensure_future(anext(admitted))
            await compiles_started(2)
            gate.set()
            outputs = [await first] + [output async for output in admitted]
            assert outputs[-1].finished and outputs[-1].finish_reason == "stop"
        finally:
            gate.set()
            await worker.stop(grace_s=0.0)

    asyncio.run(main())
