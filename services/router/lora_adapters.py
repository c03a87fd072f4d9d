"""The LoRA adapters a router serves: which model names it answers, and loading at run time.

A worker reports the adapters it serves in every load report (``WorkerLoad.lora_adapters``,
each with the key its blocks are hashed with). The router serves an adapter while a routable
worker does, routes its requests only to such workers, and hashes their prompts with the
adapter's key so that the prefix index finds the workers caching the adapter's prefixes.

Adapters loaded through the router (``load``, when ``--allow-runtime-lora-updating``) go to
every worker at once, all or nothing, and to each worker that joins later (``reconcile``,
after every health poll).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc

from engine.lora.names import check_adapter_name
from services.router.worker_pool import WorkerHandle, WorkerPool
from splitserve.v1 import worker_pb2

logger = logging.getLogger(__name__)

_LOAD_TIMEOUT_S = 60.0
# The most of an unknown model name an error repeats back.
_MAX_SHOWN_CHARS = 128


class ModelNotFoundError(LookupError):
    """A request's model is neither the served model nor a served adapter."""


class RuntimeUpdatesDisabledError(RuntimeError):
    """Loading or unloading adapters through the router was not allowed at start."""


class LoraAdapters:
    """The served model's name and the adapters served beside it (see the module)."""

    def __init__(
        self, served_name: str, pools: Sequence[WorkerPool], allow_runtime_updates: bool
    ) -> None:
        self._served_name = served_name
        self._pools = tuple(pools)
        self._allow_runtime_updates = allow_runtime_updates
        # Loaded through this router: name -> path, pushed to workers that join later.
        self._runtime: dict[str, str] = {}

    def served(self) -> dict[str, str]:
        """Adapters some routable worker serves: name -> block key, in first-seen order."""
        served: dict[str, str] = {}
        for worker in self._workers(routable=True):
            for adapter in worker.load.lora_adapters:
                served.setdefault(adapter.name, adapter.block_key)
        return served

    def resolve(self, model: str) -> tuple[str, str]:
        """``(lora_name, block key)`` of a request's ``model`` (``("", "")``: the served model
        itself, also when empty); ``ModelNotFoundError`` naming the models served otherwise."""
        if not model or model == self._served_name:
            return "", ""
        served = self.served()
        if model not in served:
            names = ", ".join(f"`{name}`" for name in (self._served_name, *served))
            shown = model if len(model) <= _MAX_SHOWN_CHARS else f"{model[:_MAX_SHOWN_CHARS]}..."
            raise ModelNotFoundError(f"The model `{shown}` does not exist (served: {names}).")
        return model, served[model]

    async def load(self, name: str, path: str) -> None:
        """Load adapter ``name`` from ``path`` on every worker that has answered; if any refuses,
        unload it from the others and raise ``ValueError`` with that worker's reason.
        ``RuntimeUpdatesDisabledError`` without ``--allow-runtime-lora-updating``."""
        self._check_allowed()
        check_adapter_name(name)
        if not path:
            raise ValueError("lora_path: required")
        if name == self._served_name or name in self.served():
            raise ValueError(f"lora_name: `{name}` is already served")
        workers = list(self._workers(routable=False))
        if not workers:
            raise ValueError("no worker has answered yet: nothing to load the adapter on")
        request = worker_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        refusals = await self._call_all(workers, "LoadLoraAdapter", request)
        if refusals:
            loaded = [w for w in workers if w.address not in refusals]
            unload = worker_pb2.UnloadLoraAdapterRequest(lora_name=name)
            await self._call_all(loaded, "UnloadLoraAdapter", unload)
            raise ValueError(f"LoRA adapter `{name}` was not loaded: {_listed(refusals)}")
        self._runtime[name] = path
        logger.info("LoRA adapter %s loaded from %s on %d workers", name, path, len(workers))

    async def unload(self, name: str) -> None:
        """Unload adapter ``name`` from every worker serving it; ``ValueError`` when none does
        or a worker refuses (a request in flight uses it: try again once it ended).
        ``RuntimeUpdatesDisabledError`` without ``--allow-runtime-lora-updating``."""
        self._check_allowed()
        if not name:
            raise ValueError("lora_name: required")
        workers = [w for w in self._workers(routable=False) if w.serves(name)]
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
        for name, path in list(self._runtime.items()):
            lacking = [w for w in self._workers(routable=False) if not w.serves(name)]
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
