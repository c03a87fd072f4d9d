"""Pulling KV from a peer into this engine without stalling its running batch.

A decode worker pulls the prompt a prefill worker computed; a prefill worker pulls the prefix a
peer pinned for it (``PinPrefix``). A request that arrives with a ``KVRef`` is added with
``num_external_tokens`` = the tokens the reference covers (a decode worker's whole prompt, a
prefill worker's prefix). When the scheduler admits it, it allocates the request's blocks
(reusing this worker's own prefix-cache hits) and announces a ``KVLoad``; only the blocks after
the local hits are read from the source. Reads run on the backend's threads while the engine
keeps stepping; each finished read is reported to the scheduler (a failed one means those tokens
are computed here) and released at the source so its lease ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from engine.backend import EngineBackend
from engine.kv_cache_manager import cdiv
from engine.outputs import RequestOutput
from engine.scheduler import DuplicateRequestError
from engine.scheduler_output import KVLoad
from kvtransfer.base import KVRef, KVTransferBackend, KVTransferError, PeerInfo, TransferState
from services.worker.kv_metrics import KV_PULL_SECONDS, KV_PULLED_BLOCKS, KV_PULLED_BYTES

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PullResult:
    """How a request's KV arrived: blocks read from the source, or failed (recomputed).
    ``start_s`` / ``end_s`` (``time.perf_counter()``) bound the read; None when none started."""

    num_transferred_blocks: int
    failed: bool
    backend: str = ""
    num_bytes: int = 0
    start_s: float | None = None
    end_s: float | None = None


class KVPullHooks:
    """The reader half of a worker's ``KVHooks``. Methods run on the engine thread except
    ``take_result``, called by the gRPC handler after the request's final output."""

    def __init__(self, backend: KVTransferBackend) -> None:
        self.backend = backend
        self._sources: dict[str, KVRef] = {}
        self._in_flight: dict[str, tuple[int, float]] = {}  # req_id -> (blocks, start time)
        self._abort_when_done: set[str] = set()
        self._results: dict[str, PullResult] = {}
        self.num_transfers_failed = 0

    def expect(self, req_id: str, src: KVRef, peer: PeerInfo) -> bool:
        """Register the source of ``req_id``'s external KV before the request is added.

        False (and the failure is recorded) when the peer cannot be paired with: the caller
        then prefills the prompt locally.
        """
        try:
            self.backend.add_peer(peer)
        except KVTransferError as exc:
            logger.warning("req_id=%s cannot pair with KV peer (%s); prefilling here", req_id, exc)
            self.num_transfers_failed += 1
            self._results[req_id] = PullResult(0, failed=True)
            return False
        self._sources[req_id] = src
        return True

    def add_request(
        self,
        engine: EngineBackend,
        req_id: str,
        src: KVRef | None,
        peer: PeerInfo,
        add: Callable[[int], None],
    ) -> None:
        """Add ``req_id`` with ``add(num_external_tokens)``: the tokens ``src`` covers when it
        is given and its peer pairs (they are pulled once the scheduler admits the request),
        else 0 (computed here). An add the engine refuses forgets the pull and re-raises."""
        pulls = src is not None and self.expect(req_id, src, peer)
        try:
            add(src.num_tokens if src is not None and pulls else 0)
        except DuplicateRequestError:
            raise  # the id's pull, if any, is another request's
        except ValueError:
            if pulls:
                self.abort(engine, req_id)
            raise

    def take_result(self, req_id: str) -> PullResult | None:
        """How ``req_id``'s KV arrived (None if it pulled none); forgotten once taken. The
        handler takes it when the request ends, however it ends, so that none is kept."""
        return self._results.pop(req_id, None)

    @property
    def busy(self) -> bool:
        return bool(self._in_flight)

    def before_step(self, engine: EngineBackend) -> None:
        self._start_loads(engine)
        if not self._in_flight:
            return
        for req_id, state in self.backend.poll().items():
            if state == TransferState.PENDING:
                continue
            num_blocks, start_s = self._in_flight.pop(req_id)
            ok = state == TransferState.DONE
            end_s = time.perf_counter()
            elapsed_s = end_s - start_s
            backend = self.backend.name
            labels = (engine.info.served_model_name, backend)
            spec = engine.kv_cache_spec
            # A transfer finished, so this engine's cache is registered: it has a spec.
            assert spec is not None
            num_bytes = num_blocks * spec.block_bytes if ok else 0
            KV_PULL_SECONDS.labels(*labels, "done" if ok else "failed").observe(elapsed_s)
            if ok:
                KV_PULLED_BLOCKS.labels(*labels).inc(num_blocks)
                KV_PULLED_BYTES.labels(*labels).inc(num_bytes)
                logger.debug(
                    "req_id=%s pulled %d blocks in %.2f ms", req_id, num_blocks, elapsed_s * 1e3
                )
            else:
                self.num_transfers_failed += 1
                logger.warning("req_id=%s KV pull failed; recomputing the prompt", req_id)
            self.backend.release(req_id)
            if req_id in self._abort_when_done:  # no one will take its result
                self._abort_when_done.discard(req_id)
                engine.abort_requests([req_id])
                continue
            self._results[req_id] = PullResult(
                num_blocks if ok else 0, not ok, backend, num_bytes, start_s, end_s
            )
            engine.finish_kv_load(req_id, ok)

    def after_step(self, engine: EngineBackend, outputs: list[RequestOutput]) -> None:
        # Reads start right after the step that admitted their requests, not a step later.
        self._start_loads(engine)
        for output in outputs:
            if output.finished:
                self._sources.pop(output.req_id, None)

    def abort(self, engine: EngineBackend, req_id: str) -> list[RequestOutput]:
        if req_id in self._in_flight:
            # The read still writes into the request's blocks: free them only once it ends.
            self._abort_when_done.add(req_id)
            return []
        self._sources.pop(req_id, None)
        self._results.pop(req_id, None)
        return engine.abort_requests([req_id])

    def _start_loads(self, engine: EngineBackend) -> None:
        for load in engine.take_kv_loads():
            self._start(engine, load)

    def _start(self, engine: EngineBackend, load: KVLoad) -> None:
        src = self._sources.pop(load.req_id, None)
        if src is None:  # aborted between the step that admitted it and now
            return
        block_size = engine.info.block_size  # the engine's own (vLLM's --block-size)
        first = load.num_local_hit_tokens // block_size
        last = cdiv(load.num_external_tokens, block_size)
        dst_block_ids = load.block_ids[first:last]
        src_ref = replace(src, block_ids=src.block_ids[first:last])
        try:
            self.backend.start_read(load.req_id, src_ref, dst_block_ids)
        except KVTransferError as exc:
            logger.warning("req_id=%s cannot start KV pull (%s); recomputing", load.req_id, exc)
            self.num_transfers_failed += 1
            self._results[load.req_id] = PullResult(0, failed=True)
            engine.finish_kv_load(load.req_id, False)
            return
        self._in_flight[load.req_id] = (len(dst_block_ids), time.perf_counter())
        logger.debug(
            "req_id=%s pulling %d blocks (%d local hits)", load.req_id, len(dst_block_ids), first
        )
