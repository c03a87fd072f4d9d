"""One loadtest: the same seeded workload (or dataset) at each offered rate (or one closed-loop
run) against a router, summarized per run. ``splitserve loadtest`` and
``loadtest.comparisons.experiments`` both run it."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.loader.models import resolve_model
from engine.tokenizer import Tokenizer
from loadtest.generator.backends import Backend, LoadClient
from loadtest.generator.datasets import Dataset
from loadtest.generator.metrics import DEFAULT_SLO_ITL_PERCENTILE, RequestRecord, summarize
from loadtest.generator.report import RunResult
from loadtest.generator.runner import RunPlan, run
from loadtest.generator.synthetic import (
    LoadRequest,
    WorkloadGenerator,
    arrival_times_s,
    as_text,
    chat_template_tokens,
    regular_token_ids,
)
from services.common.router_channel import open_router_channel
from splitserve.v1 import router_pb2, router_pb2_grpc

logger = logging.getLogger(__name__)

_WARMUP_REQUESTS = 4
_WARMUP_SEED_OFFSET = 10_000  # far from the measured runs' seeds (seed + run index)


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """What to send: a workload at each of ``rates`` (open loop, requests/s), or with
    ``concurrency`` requests in flight when ``rates`` is empty; bounded per run by
    ``num_requests`` and ``duration_s``. Run i's prompts (or its shuffle of a dataset) and send
    times come from seed ``seed + i``, so that two clusters given the same spec see the same
    requests."""

    workload: str
    rates: tuple[float, ...] = ()
    concurrency: int | None = None
    num_requests: int = 1000
    duration_s: float = 60.0
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    slo_itl_percentile: float = DEFAULT_SLO_ITL_PERCENTILE
    burstiness: float = 1.0
    seed: int = 0
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if bool(self.rates) == (self.concurrency is not None):
            raise ValueError("give either rates or a concurrency")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if not 0 < self.slo_itl_percentile <= 100:
            raise ValueError(
                f"slo_itl_percentile must be in (0, 100], got {self.slo_itl_percentile}"
            )
        if any(r <= 0 for r in self.rates):
            raise ValueError(f"rates must be > 0, got {self.rates}")


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What prompts for a router may hold: its model's name, the regular token ids every
    worker accepts, the smallest max_model_len of its workers, and the tokenizer prompts are
    made and counted with."""

    name: str
    vocab: tuple[int, ...]
    max_model_len: int
    tokenizer: Tokenizer


def load_served_model(
    name: str, tokenizer_model: str, max_model_len: int, vocab_size: int | None = None
) -> ServedModel:
    """``name``, served with ``tokenizer_model``'s tokenizer (a path, alias or repo id; a repo
    is fetched, tokenizer only) and a model of ``vocab_size`` (default: the tokenizer's)."""
    tokenizer = Tokenizer(resolve_model(tokenizer_model, tokenizer_only=True))
    regular = regular_token_ids(tokenizer.backend)
    return ServedModel(
        name=name,
        vocab=tuple(i for i in regular if vocab_size is None or i < vocab_size),
        max_model_len=max_model_len,
        tokenizer=tokenizer,
    )


def served_model(
    target: str, tokenizer_model: str | None = None, api_key: str = "", ca_file: str = ""
) -> ServedModel:
    """Ask the router at ``target`` (once; ``Status`` needs an admin key when keys are on, and
    ``ca_file`` when it serves TLS) what it serves; prompts are built from ``tokenizer_model``'s
    tokenizer (default: the model its workers loaded)."""
    with open_router_channel(target, api_key, ca_file) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        status = stub.Status(router_pb2.StatusRequest(), timeout=30, wait_for_ready=True)
    return served_model_of(status, tokenizer_model)


def served_model_of(
    status: router_pb2.StatusResponse, tokenizer_model: str | None = None
) -> ServedModel:
    """What a router serves, from its ``Status`` (``ValueError`` if no worker has answered)."""
    infos = [w.info for w in status.workers if w.info.max_model_len]
    if not infos:
        raise ValueError("no worker behind the router has answered yet")
    # status.model is the served name (--served-model-name); the workers say what they loaded.
    return load_served_model(
        status.model,
        tokenizer_model or infos[0].model,
        min(i.max_model_len for i in infos),
        min(i.vocab_size for i in infos),
    )


def run_requests(
    spec: LoadSpec,
    served: ServedModel,
    backend: Backend,
    dataset: Dataset | None = None,
    run_index: int = 0,
) -> list[LoadRequest]:
    """Run ``run_index``'s requests of ``spec``'s workload (or of ``dataset``), as ``backend``
    takes them: for a chat API, text that leaves room for the chat template."""
    seed = spec.seed + run_index
    chat = backend is Backend.OPENAI_CHAT
    max_model_len = served.max_model_len - (chat_template_tokens(served.tokenizer) if chat else 0)
    if dataset is not None:
        return dataset.sample(spec.num_requests, seed, served.tokenizer, max_model_len)
    generator = WorkloadGenerator(spec.workload, list(served.vocab), max_model_len, seed=seed)
    requests = [generator.next() for _ in range(spec.num_requests)]
    return [as_text(r, served.tokenizer) for r in requests] if chat else requests


def run_sweep(
    client: LoadClient,
    spec: LoadSpec,
    served: ServedModel,
    dataset: Dataset | None = None,
    show_progress: bool = True,
) -> list[RunResult]:
    """Run ``spec`` (its workload, or ``dataset``'s requests) through ``client``, to a router
    that serves ``served``."""
    results = []
    for i, rate in enumerate(spec.rates or (None,)):
        # Fresh prompts per run (another shuffle of a dataset): a run replaying the last one's
        # would hit its prefix cache.
        requests = run_requests(spec, served, client.backend, dataset, i)
        arrivals_s = (
            tuple(arrival_times_s(len(requests), rate, spec.burstiness, spec.seed + i))
            if rate is not None
            else None
        )
        plan = RunPlan(
            duration_s=spec.duration_s,
            arrivals_s=arrivals_s,
            concurrency=spec.concurrency,
            timeout_s=spec.timeout_s,
        )
        label = f"rate {rate:g}/s" if rate is not None else f"concurrency {spec.concurrency}"
        records = asyncio.run(run(client, plan, requests, show_progress, label))
        summary = summarize(records, spec.slo_ttft_ms, spec.slo_itl_ms, spec.slo_itl_percentile)
        results.append(RunResult(label, rate, spec.concurrency, summary, records))
        logger.info(
            "%s: %d/%d done, %.2f req/s, goodput %.2f req/s, TTFT p50 %.0f ms, ITL p99 %.0f ms",
            label,
            summary.num_completed,
            summary.num_sent,
            summary.requests_per_s,
            summary.goodput_requests_per_s,
            summary.ttft_ms["p50"],
            summary.itl_ms["p99"],
        )
    return results


def warm_up(client: LoadClient, served: ServedModel, workload: str, seed: int) -> None:
    """A few requests of another seed through ``client``, so that no arm pays first-call costs
    (the compiled kernel's load, allocator growth) inside the measured runs."""
    spec = LoadSpec(
        workload,
        concurrency=2,
        num_requests=_WARMUP_REQUESTS,
        duration_s=600.0,
        seed=seed + _WARMUP_SEED_OFFSET,
    )
    (result,) = run_sweep(client, spec, served, show_progress=False)
    if result.summary.errors:
        raise RuntimeError(f"warm-up requests failed: {result.summary.errors}")


def load_runs(path: Path, spec: LoadSpec) -> tuple[dict[str, Any], list[RunResult]]:
    """An arm's config and runs as ``results.json`` recorded them, summarized under ``spec``'s
    SLOs."""
    results = json.loads(path.read_text())
    runs = []
    for recorded in results["runs"]:
        records = [RequestRecord(**request) for request in recorded["requests"]]
        summary = summarize(records, spec.slo_ttft_ms, spec.slo_itl_ms, spec.slo_itl_percentile)
        runs.append(
            RunResult(
                recorded["label"],
                recorded["offered_rate_per_s"],
                recorded["concurrency"],
                summary,
                records,
            )
        )
    return results["config"], runs
