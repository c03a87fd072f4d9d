"""The engine's thread: ``EngineThread`` runs every call on one OS thread in order, and a
worker builds its engine on the thread that then steps it (two OpenMP pools throttle each
other; see ``services.worker.engine_thread``)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from services.decode.server import start_decode_worker
from services.worker.config import WorkerConfig
from services.worker.engine_thread import EngineThread
from tests.services.conftest import tiny_engine_config


def test_calls_run_on_one_thread_in_order_and_errors_reach_the_caller():
    async def main() -> tuple[list[int], set[int]]:
        thread = EngineThread("test-engine")
        order: list[int] = []

        def call(i: int) -> int:
            order.append(i)
            return threading.get_ident()

        idents = await asyncio.gather(*(thread.run(call, i) for i in range(8)))
        with pytest.raises(ZeroDivisionError):
            await thread.run(lambda: 1 / 0)
        idents.append(await thread.run(threading.get_ident))
        thread.shutdown()
        return order, set(idents)

    order, idents = asyncio.run(main())
    assert order == list(range(8))
    assert len(idents) == 1 and threading.get_ident() not in idents


def test_a_worker_steps_its_engine_on_the_thread_that_built_it(tiny_llama_dir):
    engine = dataclasses.replace(tiny_engine_config(tiny_llama_dir), num_threads=2)

    async def main() -> tuple[int, int]:
        worker = await start_decode_worker(WorkerConfig(engine=engine, port=0, kv_transfer="tcp"))
        try:
            runtime = worker.runtime
            assert runtime.engine.build_thread is not None
            stepping = await runtime.loop.call(lambda _: threading.get_ident())
            return runtime.engine.build_thread.ident, stepping
        finally:
            await worker.stop(grace_s=0.0)

    built, stepping = asyncio.run(main())
    assert built == stepping != threading.get_ident()
