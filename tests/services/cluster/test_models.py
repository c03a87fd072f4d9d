"""``--extra-models``: its JSON entries, each refused with a line naming the problem, and the
config each model's workers start from."""

from __future__ import annotations

import json

import pytest

from engine.config import EngineConfig
from services.cluster.config import ClusterConfig
from services.cluster.models import ModelSpec, parse_extra_models
from services.common.roles import Role
from services.worker.config import WorkerConfig


def test_entries_with_defaults_and_sizes():
    text = json.dumps(
        [
            {"name": "b", "model": "org/b"},
            {"name": "c", "model": "/m/c", "revision": "v2", "num_prefill_workers": 0,
             "num_decode_workers": 3, "worker_args": "--max-num-seqs 8"},
        ]
    )  # fmt: skip
    specs = parse_extra_models(text, "a")
    assert specs == (
        ModelSpec("b", "org/b"),
        ModelSpec("c", "/m/c", "v2", 0, 3, "--max-num-seqs 8"),
    )
    cluster = ClusterConfig(num_prefill_workers=2, num_decode_workers=1, extra_models=text)
    sizes = [
        (cluster.num_workers(s, Role.PREFILL), cluster.num_workers(s, Role.DECODE)) for s in specs
    ]
    assert sizes == [(2, 1), (0, 3)]
    assert parse_extra_models("  ") == ()


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("{", "extra_models: not JSON"),
        ('{"name": "b"}', "must be a JSON list of objects"),
        ('["b"]', "extra_models[0]: must be an object"),
        ('[{"name": "b"}]', "extra_models[0].model: required"),
        ('[{"name": "b", "model": "m", "gpus": 1}]', "unknown fields ['gpus']"),
        ('[{"name": "b c", "model": "m"}]', "no spaces or commas"),
        ('[{"name": "b", "model": "m", "num_decode_workers": "2"}]', "must be an integer"),
        ('[{"name": "a", "model": "m"}]', "the name `a` is served twice"),
        ('[{"name": "b", "model": "m"}, {"name": "b", "model": "n"}]', "`b` is served twice"),
    ],
)
def test_a_bad_entry_is_refused_naming_the_problem(text, problem):
    with pytest.raises(ValueError, match="extra_models") as info:
        parse_extra_models(text, "a")
    assert problem in str(info.value)


def test_sizes_are_checked_as_the_clusters():
    with pytest.raises(ValueError, match="decode pool needs at least 1 worker"):
        ClusterConfig(extra_models='[{"name": "b", "model": "m", "num_decode_workers": 0}]')


def test_a_models_workers_load_it_under_its_name_with_its_flags():
    shared = WorkerConfig(engine=EngineConfig(model="org/a", max_num_seqs=64))
    spec = ModelSpec("b", "org/b", "v1", worker_args="--max-num-seqs 8 --lease-ttl-s 9")
    config = spec.worker_config(shared)
    engine = config.engine
    assert (engine.model, engine.revision, engine.served_model_name) == ("org/b", "v1", "b")
    assert (engine.max_num_seqs, config.lease_ttl_s) == (8, 9.0)
    with pytest.raises(ValueError, match="extra_models: `b`: worker_args: "):
        ModelSpec("b", "org/b", worker_args="--worker-id x").worker_config(shared)
