"""The chart's ``extraModels``: more models behind the same routers, traced through
``splitserve up``'s parser and into the worker groups' sizes."""

from __future__ import annotations

import jsonschema
import pytest

from services.cli import build_parser
from services.up import configs_from_args
from tests.deploy.test_chart import GENERATE, head_argv, objects


def test_extra_models_reach_up_and_size_the_worker_groups():
    """extraModels becomes --extra-models (JSON, shell-quoted); each worker group hosts its
    role's pool of every model, so its replicas are their sum."""
    extra = [
        {"name": "qwen's-0.5b", "model": "Qwen/Qwen2.5-0.5B-Instruct", "num_decode_workers": 2},
        {"name": "b", "model": "org/b", "revision": "v1", "worker_args": "--max-model-len 512"},
    ]
    values = {"extraModels": extra, "prefill": {"replicas": 1}, "decode": {"replicas": 3}}
    cluster, worker, _, _ = configs_from_args(build_parser().parse_args(head_argv(values)))
    specs = cluster.extra_model_specs()
    assert [(s.name, s.model, s.num_decode_workers) for s in specs] == [
        ("qwen's-0.5b", "Qwen/Qwen2.5-0.5B-Instruct", 2),
        ("b", "org/b", None),
    ]
    config = specs[1].worker_config(worker)
    assert (config.engine.revision, config.engine.max_model_len) == ("v1", 512)
    assert config.engine.served_model_name == "b"
    cluster_spec = next(o for o in objects(values) if o["kind"] == "RayCluster")["spec"]
    replicas = {g["groupName"]: g["replicas"] for g in cluster_spec["workerGroupSpecs"]}
    assert replicas == {"prefill": 3, "decode": 3 + 2 + 3}
    assert not any(a.startswith("--extra-models") for a in head_argv({}))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"extraModels": [{"name": "b"}]}, GENERATE.schema())
