"""The models a cluster serves behind its routers: ``--model`` and each ``--extra-models``
entry, each with its own prefill and decode pools.

``--extra-models`` is a JSON list (the Helm chart's ``extraModels`` value, as JSON), one object
per model: ``name`` (its served name: what a request's ``model`` says), ``model`` (what its
workers load, as ``--model``), and optionally ``revision``, ``num_prefill_workers`` and
``num_decode_workers`` (default: the cluster's ``--num-prefill-workers`` /
``--num-decode-workers``) and ``worker_args`` (engine and worker flags of its workers, set over
the shared ones, e.g. ``"--max-model-len 512"``). The routers need nothing more: they learn each
model from its workers (``services.router.served_models``).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from dataclasses import dataclass
from typing import Any

from services.worker.config import WorkerConfig

_MAX_NAME_CHARS = 128


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One ``--extra-models`` entry (see the module); a size of None is the cluster's."""

    name: str
    model: str
    revision: str | None = None
    num_prefill_workers: int | None = None
    num_decode_workers: int | None = None
    worker_args: str = ""

    def worker_config(self, shared: WorkerConfig) -> WorkerConfig:
        """The config this model's workers start from: ``shared`` loading this model under
        this name, with ``worker_args`` set over it (``ValueError`` naming the entry)."""
        engine = dataclasses.replace(
            shared.engine, model=self.model, revision=self.revision, served_model_name=self.name
        )
        try:
            return dataclasses.replace(shared, engine=engine).with_pool_flags(
                shlex.split(self.worker_args)
            )
        except ValueError as exc:
            raise ValueError(f"extra_models: `{self.name}`: worker_args: {exc}") from None


def parse_extra_models(text: str, primary_name: str = "") -> tuple[ModelSpec, ...]:
    """The entries of ``--extra-models`` (empty text: none); ``ValueError`` naming the flag and
    the problem: not a JSON list of objects, an unknown or missing field, a bad value, or a
    name given twice (``primary_name``, the ``--model``'s served name, counts as given)."""
    if not text.strip():
        return ()
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"extra_models: not JSON: {exc}") from None
    if not isinstance(entries, list):
        raise ValueError("extra_models: must be a JSON list of objects")
    specs = tuple(_spec(i, entry) for i, entry in enumerate(entries))
    seen = {primary_name} if primary_name else set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"extra_models: the name `{spec.name}` is served twice")
        seen.add(spec.name)
    return specs


def _spec(index: int, entry: Any) -> ModelSpec:
    where = f"extra_models[{index}]"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: must be an object")
    known = {f.name for f in dataclasses.fields(ModelSpec)}
    unknown = sorted(set(entry) - known)
    if unknown:
        raise ValueError(f"{where}: unknown fields {unknown} (known: {sorted(known)})")
    for required in ("name", "model"):
        value = entry.get(required)
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{where}.{required}: required, a non-empty string")
    name = entry["name"]
    if len(name) > _MAX_NAME_CHARS or any(c.isspace() or c == "," for c in name):
        raise ValueError(f"{where}.name: at most {_MAX_NAME_CHARS} characters, no spaces or commas")
    for size in ("num_prefill_workers", "num_decode_workers"):
        value = entry.get(size)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"{where}.{size}: must be an integer")
    for text in ("revision", "worker_args"):
        value = entry.get(text)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{where}.{text}: must be a string")
    return ModelSpec(**{**entry, "worker_args": entry.get("worker_args") or ""})
