"""``--served-model-name`` and ``--revision`` from ``splitserve up`` to every worker and router:
the name given is what ``splitserve status`` (Router.Status) and each worker's WorkerInfo show,
while WorkerInfo.model keeps the ``--model`` the workers loaded."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.cpu_isa import host_isa
from services.cli import build_parser
from services.up import configs_from_args
from tests.services.conftest import up_no_ray

SERVED_NAME = "tiny-chat"


def test_up_gives_workers_and_routers_the_same_revision_and_served_name() -> None:
    args = build_parser().parse_args(
        ["up", "--model", "org/name", "--revision", "v2", "--served-model-name", SERVED_NAME]
    )
    _, worker, router, _ = configs_from_args(args)
    assert (worker.engine.model, worker.engine.revision) == ("org/name", "v2")
    assert worker.engine.served_model_name == SERVED_NAME
    assert (router.model, router.revision, router.served_name) == ("org/name", "v2", SERVED_NAME)

    _, _, default, _ = configs_from_args(build_parser().parse_args(["up", "--model", "org/name"]))
    assert (default.revision, default.served_name) == (None, "org/name")


@pytest.fixture(scope="module")
def served_cluster(tiny_llama_dir: Path) -> Iterator[str]:
    """``splitserve up --no-ray`` (colocated: one worker and the router) with a served name."""
    with up_no_ray(
        "--model", str(tiny_llama_dir), "--served-model-name", SERVED_NAME,
        "--mode", "colocated", "--num-prefill-workers", "0", "--dtype", "float32",
        "--num-kv-blocks", "64",
    ) as target:  # fmt: skip
        yield target


def test_status_shows_the_served_name(served_cluster: str, tiny_llama_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "status", "--target", served_cluster, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    status = json.loads(proc.stdout)
    assert status["model"] == SERVED_NAME
    workers = status["workers"]
    assert [w["info"]["served_model_name"] for w in workers] == [SERVED_NAME]
    assert [w["info"]["model"] for w in workers] == [str(tiny_llama_dir)]


def test_status_shows_each_workers_cpu_level_dtype_and_kernels(served_cluster: str) -> None:
    """What the engine chose for this host reaches ``splitserve status`` (table and JSON)."""
    status = json.loads(
        subprocess.run(
            [sys.executable, "-m", "services.cli", "status", "--target", served_cluster, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    )
    (info,) = [w["info"] for w in status["workers"]]
    assert info["dtype"] == "float32"
    assert info["cpu_isa"] == host_isa().value
    assert info["kernels"].startswith("linear=")
    table = subprocess.run(
        [sys.executable, "-m", "services.cli", "status", "--target", served_cluster],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert f"float32  {host_isa().value}" in table
    assert f"kernels: {info['kernels']}" in table
