"""The LoRA adapters a router serves beside its models, and loading them at run time.

A worker reports the adapters it serves in every load report (``WorkerLoad.lora_adapters``,
each with the key its blocks are hashed with). The router serves an adapter while a routable
worker does, routes its requests only to such workers, and hashes their prompts with the
adapter's key so that the prefix index finds the workers caching the adapter's prefixes.

Adapters loaded through the router (``load``, when ``--allow-runtime-lora-updating``) go to
every worker of their base model at once, all or nothing, and to each such worker that joins
later (``reconcile``, after every health poll).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import grpc

from engine.lora.names import check_adapter_name
from services.router.worker_pool import WorkerHandle, WorkerPool
from splitserve.v1 import worker_pb2

logger = logging.getLogger(__name__)

_LOAD_TIMEOUT_S = 60.0


class RuntimeUpdatesDisabledError(RuntimeError):
    """Loading or unloading adapters through the router was not allowed at start."""


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    """An adapter some routable worker serves: the key its blocks are hashed with, and the
    served model it adapts (the model of the first worker seen serving it)."""

    block_key: str
    base_model: str


class LoraAdapters:
    """The adapters served beside the router's models (see the module)."""

    def __init__(self, pools: Sequence[WorkerPool], allow_runtime_updates: bool) -> None:
        self._pools = tuple(pools)
        self._allow_runtime_updates = allow_runtime_updates
        # Loaded through this router: name -> (path, base model), pushed to workers that join
        # later.
        self._runtime: dict[str, tuple[str, str]] = {}

    def served(self) -> dict[str, ServedAdapter]:
        """Adapters some routable worker serves, by name, in first-seen order."""
        served: dict[str, ServedAdapter] = {}
        for worker in self._workers(routable=True):
            assert worker.info is not None  # healthy: it has answered
            for adapter in worker.load.lora_adapters:
                if adapter.name not in served:
                    base = worker.info.served_model_name
                    served[adapter.name] = ServedAdapter(adapter.block_key, base)
        return served

    async def load(self, name: str, path: str, base_model: str, taken: Collection[str]) -> None:
        """Load adapter ``name`` from ``path`` on every worker of ``base_model`` that has
        answered; if any refuses, unload it from the others and raise ``ValueError`` with that
        worker's reason (also for a ``name`` in ``taken``, the served models' names).
        ``RuntimeUpdatesDisabledError`` without ``--allow-runtime-lora-updating``."""
        self._check_allowed()
        check_adapter_name(name)
        if not path:
            raise ValueError("lora_path: required")
        if name in taken or name in self.served():
            raise ValueError(f"lora_name: `{name}` is already served")
        workers = [w for w in self._workers(routable=False) if w.serves_model(base_model)]
        if not workers:
            raise ValueError(
                f"no worker of model `{base_model}` has answered yet: nothing to load the "
                "adapter on"
            )
        request = worker_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        refusals = await self._call_all(workers, "LoadLoraAdapter", request)
        if refusals:
            loaded = [w for w in workers if w.address not in refusals]
            unload = worker_pb2.UnloadLoraAdapterRequest(lora_name=name)
            await self._call_all(loaded, "UnloadLoraAdapter", unload)
            raise ValueError(f"LoRA adapter `{name}` was not loaded: {_listed(refusals)}")
        self._runtime[name] = (path, base_model)
        logger.info(
            "LoRA adapter %s of %s loaded from %s on %d workers",
            name,
            base_model,
            path,
            len(workers),
        )

    async def unload(self, name: str) -> None:
        """Unload adapter ``name`` from every worker serving it; ``ValueError`` when none does
        or a worker refuses (a request in flight uses it: try again once it ended).
        ``RuntimeUpdatesDisabledError`` without ``--allow-runtime-lora-updating``."""
        self._check_allowed()
        if not name:
            raise ValueError("lora_name: required")
        workers = [w for w in self._workers(routable=False) if w.serves_adapter(name)]
        if not workers:
            raise ValueError(f"lora_name: no worker serves a LoRA adapter `{name}`")
        self._runtime.pop(name, None)
        request = worker_pb2.UnloadLoraAdapterRequest(lora_name=name)
        refusals = await self._call_all(workers, "UnloadLoraAdapter", request)
        if refusals:
            raise ValueError(f"LoRA adapter `{name}` is still served: {_listed(refusals)}")
        logger.info("LoRA adapter %s unloaded from %d workers", name, len(workers))

    async def reconcile(self) -> None:
        """Load the adapters loaded through this router on the workers that lack them (they
        joined since, or restarted). Never raises: a refusal is logged, the next poll retries."""
        if not self._runtime:
            return
        for name, (path, base_model) in list(self._runtime.items()):
            lacking = [
                w
                for w in self._workers(routable=False)
                if w.serves_model(base_model) and not w.serves_adapter(name)
            ]
            request = worker_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
            refusals = await self._call_all(lacking, "LoadLoraAdapter", request)
            if refusals:
                logger.warning("LoRA adapter %s not loaded on: %s", name, _listed(refusals))

    def _check_allowed(self) -> None:
        if not self._allow_runtime_updates:
            raise RuntimeUpdatesDisabledError(
                "loading LoRA adapters at run time is off: start the router with "
                "--allow-runtime-lora-updating"
            )

    def _workers(self, *, routable: bool) -> list[WorkerHandle]:
        """Every worker of every pool that has answered (and is routable, if asked)."""
        return [
            w
            for pool in self._pools
            for w in pool.workers
            if w.healthy and (w.routable or not routable)
        ]

    @staticmethod
    async def _call_all(
        workers: Sequence[WorkerHandle], method: str, request: object
    ) -> dict[str, str]:
        """Call adapter ``method`` on every worker at once; the errors by address (a worker
        that succeeded has its load report updated to what it serves now)."""

        async def call(worker: WorkerHandle) -> str:
            try:
                response = await getattr(worker.stub, method)(request, timeout=_LOAD_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                return f"{exc.code().name}: {exc.details()}"
            del worker.load.lora_adapters[:]
            worker.load.lora_adapters.extend(response.lora_adapters)
            return ""

        errors = await asyncio.gather(*(call(w) for w in workers))
        return {w.address: e for w, e in zip(workers, errors, strict=True) if e}


def _listed(errors: dict[str, str]) -> str:
    return "; ".join(f"{address}: {error}" for address, error in errors.items())
