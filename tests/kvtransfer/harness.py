"""Two-process harness for KV transfer backends: a spawned source process serving random caches,
and a destination backend in the test process."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch

from engine.kv_cache_spec import KVCacheSpec, KVLayout
from engine.model.kv_quant import KVQuant, quantize_rows
from kvtransfer.base import KVRef, KVTransferBackend, PeerInfo, TransferState
from kvtransfer.registry import make_backend
from kvtransfer.tls import KVTransferTls
from tests.waiting import wait_until

SMALL_SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=32, block_size=8, dtype="bfloat16")
BIG_SPEC = KVCacheSpec(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16")
# SMALL_SPEC's shape with 8-bit rows (codes and a scale): what --kv-cache-dtype int8 registers.
INT8_SPEC = dataclasses.replace(SMALL_SPEC, dtype="int8")
# SMALL_SPEC laid out layer-major, as vLLM's CPU cache is: each block is one segment per layer.
LAYER_MAJOR_SPEC = dataclasses.replace(SMALL_SPEC, layout=KVLayout.VLLM_CPU)
NUM_BLOCKS = 64  # small: 64 x 4 KiB; big: 64 x 64 KiB = 4 MiB
DONE, FAILED, PENDING = TransferState.DONE, TransferState.FAILED, TransferState.PENDING


def make_cache(spec: KVCacheSpec, seed: int) -> torch.Tensor:
    """The random cache a source process fills (bf16, or quantized rows for an 8-bit spec),
    in the spec's memory order; the same seed gives the same bytes."""
    generator = torch.Generator().manual_seed(seed)
    if spec.quantized:
        values = torch.randn(
            (NUM_BLOCKS, *spec.block_shape[:-1], spec.head_dim), generator=generator
        )
        return in_memory_order(quantize_rows(values, KVQuant(spec.dtype)), spec)
    values = torch.randn((NUM_BLOCKS, *spec.block_shape), generator=generator)
    return in_memory_order(values.to(torch.bfloat16), spec)


def in_memory_order(kv_cache: torch.Tensor, spec: KVCacheSpec) -> torch.Tensor:
    """``kv_cache``'s values, laid out block-major or (``spec.layer_major``) layer-major."""
    if spec.layer_major:
        return kv_cache.transpose(0, 1).contiguous().transpose(0, 1)
    return kv_cache.contiguous()


def rows(kv_cache: torch.Tensor) -> torch.Tensor:
    return kv_cache.view(torch.uint8).view(kv_cache.shape[0], -1)


class WarningLog(logging.Handler):
    """The messages of the warnings a logger of the source process logged, until taken.
    Thread-safe."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self._messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self._messages.append(record.getMessage())  # under the handler's lock (``handle``)

    def take(self) -> list[str]:
        """The messages logged since the last call, in order."""
        self.acquire()
        try:
            messages, self._messages = self._messages, []
        finally:
            self.release()
        return messages


def source_main(
    conn: Connection,
    backend_name: str,
    engines: list[tuple[str, KVCacheSpec, int]],
    device: str = "cpu",
    tls: KVTransferTls | None = None,
) -> None:
    """Child process: one backend per ``(engine_id, spec, seed)``, driven through ``conn``."""
    warnings = WarningLog()
    # A refused release changes nothing: its warning is the only sign that it arrived.
    logging.getLogger("kvtransfer._common").addHandler(warnings)
    backends = {
        engine_id: make_backend(backend_name, engine_id, tls=tls) for engine_id, _, _ in engines
    }
    caches = [make_cache(spec, seed).to(device) for _, spec, seed in engines]
    conn.send(
        [
            backends[engine_id].register_kv_cache(cache, spec)
            for (engine_id, spec, _), cache in zip(engines, caches, strict=True)
        ]
    )
    while True:
        command, *args = conn.recv()
        if command == "publish":
            engine_id, req_id, block_ids = args
            conn.send(backends[engine_id].publish(req_id, block_ids))
        elif command == "unpublish":
            engine_id, req_id = args
            backends[engine_id].unpublish(req_id)
            conn.send(None)
        elif command == "take_released":
            conn.send(backends[args[0]].take_released())
        elif command == "take_warnings":
            conn.send(warnings.take())
        else:
            break
    for backend in backends.values():
        backend.close()


class SourceProcess:
    """A spawned source process and the pipe that drives it."""

    def __init__(
        self,
        backend_name: str,
        engines: list[tuple[str, KVCacheSpec, int]],
        device: str = "cpu",
        tls: KVTransferTls | None = None,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.process: BaseProcess = ctx.Process(
            target=source_main, args=(child_conn, backend_name, engines, device, tls), daemon=True
        )
        self.process.start()
        self._infos: dict[str, PeerInfo] | None = None

    def info(self, engine_id: str) -> PeerInfo:
        return self._received_infos()[engine_id]

    def _received_infos(self) -> dict[str, PeerInfo]:
        """The infos the process sends first, once it serves (received on the first call)."""
        if self._infos is None:
            assert self.conn.poll(60), "source process did not start"
            self._infos = {info.engine_id: info for info in self.conn.recv()}
        return self._infos

    def _send(self, *command: object) -> None:
        """Send a command, after the infos, so that its answer is the next thing received."""
        self._received_infos()
        self.conn.send(command)

    def publish(self, engine_id: str, req_id: str, block_ids: Sequence[int]) -> bytes:
        """Publish in the source process; return the grant that reads and releases present."""
        self._send("publish", engine_id, req_id, list(block_ids))
        return self.conn.recv()

    def unpublish(self, engine_id: str, req_id: str) -> None:
        self._send("unpublish", engine_id, req_id)
        self.conn.recv()

    def take_released(self, engine_id: str) -> list[str]:
        self._send("take_released", engine_id)
        return self.conn.recv()

    def take_warnings(self) -> list[str]:
        """The warnings of the source's published-blocks tables (``kvtransfer._common``, all
        engines) since the last call."""
        self._send("take_warnings")
        return self.conn.recv()

    def wait_warnings(self, text: str, count: int, timeout_s: float = 5.0) -> list[str]:
        """Poll ``take_warnings`` until ``count`` of them contain ``text``; return those
        (warnings without ``text`` are dropped)."""
        seen: list[str] = []

        def enough() -> bool:
            seen.extend(message for message in self.take_warnings() if text in message)
            return len(seen) >= count

        wait_until(enough, timeout_s, lambda: f"{count} warnings with {text!r}, got {seen}", 0.01)
        return seen

    def wait_released(self, engine_id: str, timeout_s: float = 5.0) -> list[str]:
        """Poll ``take_released`` until something was released; return that."""
        return wait_until(
            lambda: self.take_released(engine_id), timeout_s, f"a release on {engine_id}", 0.01
        )

    def signal(self, signum: int) -> None:
        """Send ``signum``; for SIGSTOP, return only once every thread of the source is stopped
        (``kill`` returns before a busy process has actually stopped)."""
        pid = self.process.pid
        assert pid is not None
        os.kill(pid, signum)
        if signum == signal.SIGSTOP:
            wait_until(lambda: _all_threads_stopped(pid), 10.0, f"source {pid} stopped")

    def stop(self) -> None:
        if self.process.is_alive():
            self.signal(signal.SIGKILL)
        self.process.join(timeout=10)


def make_dst(
    backend_name: str,
    spec: KVCacheSpec,
    engine_id: str = "dst",
    io_timeout_s: float = 5.0,
    device: str = "cpu",
    tls: KVTransferTls | None = None,
    num_blocks: int = NUM_BLOCKS,
) -> tuple[KVTransferBackend, torch.Tensor]:
    """A registered destination backend over a zeroed cache of ``num_blocks`` blocks, in the
    spec's memory order."""
    backend = make_backend(backend_name, engine_id, io_timeout_s=io_timeout_s, tls=tls)
    shape = (num_blocks, *spec.block_shape)
    dtype = torch.uint8 if spec.quantized else torch.bfloat16
    kv_cache = in_memory_order(torch.zeros(shape, dtype=dtype, device=device), spec)
    backend.register_kv_cache(kv_cache, spec)
    return backend, kv_cache


def wait_terminal(
    backend: KVTransferBackend, req_ids: Sequence[str], timeout_s: float = 10.0
) -> dict[str, TransferState]:
    """Poll until every read in ``req_ids`` is terminal, checking each is reported once."""
    terminal: dict[str, TransferState] = {}

    def all_terminal() -> bool:
        for req_id, state in backend.poll().items():
            if state is not PENDING:
                assert req_id not in terminal, f"{req_id} reported terminal twice"
                terminal[req_id] = state
        return len(terminal) == len(req_ids)

    wait_until(
        all_terminal,
        timeout_s,
        lambda: (
            f"the end of the reads {sorted(set(req_ids) - terminal.keys())}"
            f" (the I/O threads were at: {_io_thread_stacks()})"
        ),
        0.002,
    )
    return terminal


def _io_thread_stacks() -> str:
    """Where each backend I/O thread (named ``kv-*``) of this process is now: a read that
    outlives its I/O timeout means one of them is stuck, and the stack says in which call."""
    frames = sys._current_frames()
    stacks = [
        f"{thread.name}:\n{''.join(traceback.format_stack(frames[thread.ident]))}"
        for thread in threading.enumerate()
        if thread.name.startswith("kv-") and thread.ident in frames
    ]
    return "\n".join(stacks) or "no kv-* thread"


def read(
    backend: KVTransferBackend, req_id: str, src: KVRef, dst_block_ids: Sequence[int]
) -> TransferState:
    backend.start_read(req_id, src, dst_block_ids)
    return wait_terminal(backend, [req_id])[req_id]


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in the stopped state ("T" in /proc/<pid>/task/*/stat)."""
    task_dir = f"/proc/{pid}/task"
    for tid in os.listdir(task_dir):
        with open(f"{task_dir}/{tid}/stat") as stat:
            # The state follows the parenthesised command name, which may itself hold spaces.
            state = stat.read().rsplit(")", 1)[1].split()[0]
        if state not in ("T", "t"):
            return False
    return True
