"""The models a router serves, each with its tokenizer and its limits; a request's ``model``
picks one of them, or a LoRA adapter of one.

The router's ``--model`` is served from the start. Every other model is learnt from the
workers: one whose ``GetInfo`` names a served model the router does not know
(``WorkerInfo.served_model_name``) has the router load that model's tokenizer
(``WorkerInfo.model`` at ``WorkerInfo.revision``, off the event loop); from then on the model
is served, on the workers that report it only. So a router serves every model of the pools it
is given, an orchestrator adds a model by adding its workers, and no choice ever mixes two
models' workers: the choosers, the prefix index's candidates and the limits all see one
model's workers (``ServedTarget``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from engine.tokenizer import Tokenizer
from services.common.serving_metrics import ServingMetrics
from services.router.latency import LatencySamples, LatencyWindow
from services.router.lora_adapters import LoraAdapters
from services.router.request_prep import ModelLimits
from services.router.routed_request import Routing
from services.router.tool_calls.parsers import ToolCallFormat
from services.router.worker_pool import WorkerHandle, WorkerPool

logger = logging.getLogger(__name__)

# The most of an unknown model name an error repeats back.
_MAX_SHOWN_CHARS = 128


class ModelNotFoundError(LookupError):
    """A request's model is neither a served model nor a served adapter."""


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model the router serves: the name clients use, what its workers loaded
    (``--model``), and what its requests are prepared, routed and measured with (``latency``:
    the samples its pools' autoscaling judges)."""

    name: str
    model: str
    tokenizer: Tokenizer
    tool_call_format: ToolCallFormat
    routing: Routing
    serving_metrics: ServingMetrics
    latency: LatencyWindow


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """What a request's ``model`` names: a served model, and maybe one of its LoRA adapters
    with the key the workers hash the adapter's blocks with."""

    served: ServedModel
    lora_name: str = ""
    lora_block_key: str = ""


# Builds a served model from (served name, model, revision); blocking (loads a tokenizer).
ModelFactory = Callable[[str, str, str | None], ServedModel]


class ServedModels:
    """The served models by name (the router's ``--model`` first) and the adapters beside
    them (see the module). ``decode_pool`` reports each model's limits."""

    def __init__(
        self,
        primary: ServedModel,
        pools: Sequence[WorkerPool],
        decode_pool: WorkerPool,
        adapters: LoraAdapters,
        factory: ModelFactory,
    ) -> None:
        self._models = {primary.name: primary}
        self._pools = tuple(pools)
        self._decode_pool = decode_pool
        self.adapters = adapters
        self._factory = factory
        # Names being loaded, and those whose tokenizer failed to load (not retried: the
        # workers' model does not change while they run; a log line says why).
        self._loading: set[str] = set()
        self._failed: set[str] = set()
        # The last limits each model's decode workers reported: a model's do not change when
        # its pool briefly has no worker that answered (a scale-down's survivor not yet polled).
        self._limits_seen: dict[str, ModelLimits] = {}

    @property
    def primary(self) -> ServedModel:
        """The router's own ``--model``: what a request without a model gets."""
        return next(iter(self._models.values()))

    def names(self) -> list[str]:
        """Every served model's name, the router's ``--model`` first."""
        return list(self._models)

    def get(self, name: str) -> ServedModel | None:
        return self._models.get(name)

    def resolve(self, model: str) -> ResolvedModel:
        """What a request's ``model`` names (empty: the router's ``--model``);
        ``ModelNotFoundError`` naming the models and adapters served otherwise."""
        if not model:
            return ResolvedModel(self.primary)
        served = self._models.get(model)
        if served is not None:
            return ResolvedModel(served)
        adapters = self.adapters.served()
        adapter = adapters.get(model)
        if adapter is not None and adapter.base_model in self._models:
            return ResolvedModel(self._models[adapter.base_model], model, adapter.block_key)
        served_names = _listed([*self._models, *adapters])
        raise ModelNotFoundError(
            f"The model `{_shown(model)}` does not exist (served: {served_names})."
        )

    def take_latency_samples(self) -> dict[str, LatencySamples]:
        """Each model's TTFT and ITL samples since the last call (``LatencyWindow.take``)."""
        return {name: served.latency.take() for name, served in self._models.items()}

    async def load_adapter(self, name: str, path: str, base_model: str = "") -> None:
        """Serve LoRA adapter ``name`` from ``path`` on the workers of ``base_model`` (empty:
        the router's ``--model``), as ``LoraAdapters.load`` (its errors); ``ValueError`` for
        a base model not served."""
        base = base_model or self.primary.name
        if base not in self._models:
            raise ValueError(
                f"base_model_name: `{_shown(base)}` is not served (served: {_listed(self._models)})"
            )
        await self.adapters.load(name, path, base, self.names())

    def limits(self, name: str) -> ModelLimits | None:
        """Model ``name``'s limits as its decode workers report them: the tightest over those
        that answered, else the last seen (None until one has ever answered)."""
        infos = [w.info for w in self._decode_pool.model_workers(name) if w.info is not None]
        if infos:
            self._limits_seen[name] = ModelLimits(
                vocab_size=min(i.vocab_size for i in infos),
                max_model_len=min(i.max_model_len for i in infos),
            )
        return self._limits_seen.get(name)

    async def discover(self) -> None:
        """Serve every model a worker reports that the router does not serve yet (its
        tokenizer loaded in a thread). Never raises: a model whose tokenizer does not load is
        logged and left unserved."""
        found: dict[str, WorkerHandle] = {}
        for worker in (w for pool in self._pools for w in pool.workers):
            name = worker.info.served_model_name if worker.info is not None else ""
            if name and name not in self._models and name not in self._loading | self._failed:
                found.setdefault(name, worker)
        for name, worker in found.items():
            assert worker.info is not None
            model, revision = worker.info.model, worker.info.revision or None
            self._loading.add(name)
            try:
                served = await asyncio.to_thread(self._factory, name, model, revision)
            except Exception as exc:
                self._failed.add(name)
                logger.error(
                    "model %s (%s, reported by %s worker %s) is not served: its tokenizer does "
                    "not load on this router: %r",
                    name,
                    model,
                    worker.role,
                    worker.address,
                    exc,
                )
                continue
            finally:
                self._loading.discard(name)
            self._models[name] = served
            logger.info("serving model %s (%s), as its workers report", name, model)


def _shown(name: str) -> str:
    """A client's name as an error repeats it: at most ``_MAX_SHOWN_CHARS`` of it."""
    return name if len(name) <= _MAX_SHOWN_CHARS else f"{name[:_MAX_SHOWN_CHARS]}..."


def _listed(names: Iterable[str]) -> str:
    return ", ".join(f"`{name}`" for name in names)
