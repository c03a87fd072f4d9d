"""Every worker's KV hooks: it serves its blocks to peers and pulls blocks from them.

A worker is a KV source (``LeaseHooks``: a prefill's finished prompt for its decode worker, a
cached prefix pinned for a peer) and a KV reader (``KVPullHooks``: a decode worker pulls the
prompt a prefill worker computed; a prefill worker pulls the prefix a peer holds instead of
recomputing it). One backend serves both directions.
"""

from __future__ import annotations

from engine.backend import EngineBackend
from engine.outputs import RequestOutput
from kvtransfer.base import KVTransferBackend
from services.worker.kv_leases import LeaseHooks
from services.worker.kv_puller import KVPullHooks


class KVHooks:
    """``EngineHooks`` of a worker: its ``leases`` (blocks peers read here) and its
    ``puller`` (blocks it reads from peers). Runs on the engine thread, as both do."""

    def __init__(self, backend: KVTransferBackend, lease_ttl_s: float) -> None:
        self.leases = LeaseHooks(backend, lease_ttl_s)
        self.puller = KVPullHooks(backend)

    @property
    def busy(self) -> bool:
        return self.leases.busy or self.puller.busy

    def before_step(self, engine: EngineBackend) -> None:
        self.leases.before_step(engine)
        self.puller.before_step(engine)

    def after_step(self, engine: EngineBackend, outputs: list[RequestOutput]) -> None:
        self.leases.after_step(engine, outputs)
        self.puller.after_step(engine, outputs)

    def abort(self, engine: EngineBackend, req_id: str) -> list[RequestOutput]:
        """Abort ``req_id`` (once its pull ends, when one is in flight) and end its lease, if
        it finished and holds one."""
        outputs = self.puller.abort(engine, req_id)
        self.leases.release(engine, req_id)
        return outputs
