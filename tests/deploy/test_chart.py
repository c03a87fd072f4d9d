"""The Helm chart, rendered by Helm's own template engine (helm-python-sdk), validated against
the Kubernetes schemas (kubernetes-validate) and the CRDs' (``crd_schemas``), and its values
traced through ``splitserve up``'s real flag parser."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shlex
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

from engine.config import EngineKind
from services.cli import build_parser
from services.common.roles import Role
from services.up import configs_from_args
from tests.deploy.crd_schemas import SCHEMAS

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "splitserve"
KUBE_VERSION = "1.31.0"


def load_chart_script(name: str) -> Any:
    """``deploy/helm/<name>.py`` as a module (deploy/ is no package)."""
    spec = importlib.util.spec_from_file_location(f"chart_{name}", CHART.parent / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATE = load_chart_script("generate")

VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "gpu-pools": {
        "engine": {"device": "cuda", "dtype": "bfloat16"},
        "prefill": {
            "replicas": 2,
            "numGpus": 1,
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            ],
            "resources": {"requests": {"cpu": "8", "memory": "32Gi"}, "limits": {"memory": "64Gi"}},
        },
        "decode": {
            "replicas": 3,
            "numGpus": 1,
            "affinity": {
                "podAntiAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 100,
                            "podAffinityTerm": {
                                "topologyKey": "kubernetes.io/hostname",
                                "labelSelector": {"matchLabels": {"splitserve.io/role": "decode"}},
                            },
                        }
                    ]
                }
            },
        },
    },
    "external-redis": {
        "redis": {
            "enabled": False,
            "external": {"url": "rediss://redis.example.internal:6380/0", "existingSecret": "ext"},
        },
        "redisOptions": {"redisTlsCaFile": "/etc/redis-ca/ca.crt"},
    },
    "autoscaler": {
        "planner": {"autoscale": True, "targetTtftMs": 800, "targetItlMs": 60},
        "prefill": {"minReplicas": 1, "maxReplicas": 6},
    },
    "everything-on": {
        "service": {"type": "LoadBalancer"},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
        "podDisruptionBudget": {"enabled": True},
        "networkPolicy": {
            "enabled": True,
            "routerFrom": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}],
        },
        "redis": {"persistence": {"enabled": True, "size": "2Gi"}},
        "imagePullSecrets": [{"name": "registry"}],
    },
    "model-volume": {
        "engine": {"model": "Qwen/Qwen2.5-0.5B-Instruct", "revision": "v2"},
        "modelVolume": {"claimName": "models"},
        "huggingface": {"home": "/models/huggingface", "tokenSecret": {"name": "hf-token"}},
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
        "envFrom": [{"configMapRef": {"name": "tuning"}}],
        "head": {"envFrom": [{"secretRef": {"name": "router-secrets"}}]},
        "decode": {"env": [{"name": "OMP_NUM_THREADS", "value": "8"}]},
        "extraArgs": ["--served-model-name=Qwen's 0.5B", "--max-num-seqs=7"],
    },
    "secured": {
        "security": {
            "apiKeysSecret": "splitserve-api-keys",
            "tls": {"enabled": True, "secrets": {"router": "router-cert"}},
            "rayAuth": {"existingSecret": "ray-token"},
        },
        "networkPolicy": {
            "metricsFrom": [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}}}
            ]
        },
    },
    "cert-manager": {
        "security": {
            "tls": {
                "enabled": True,
                "certManager": {
                    "enabled": True,
                    "issuerRef": {"name": "splitserve-ca", "kind": "ClusterIssuer"},
                    "routerDnsNames": ["llm.example.com"],
                },
            }
        },
        "redis": {"enabled": False, "external": {"url": "rediss://r:6380/0", "tlsSecret": "rca"}},
    },
    "no-http": {"router": {"http": False}},
    "host-path-model": {
        "engine": {"model": "/weights/Llama-3.2-1B-Instruct"},
        "modelVolume": {"hostPath": "/srv/models", "mountPath": "/weights", "readOnly": False},
    },
}


# What every splitserve container gets by default: Ray's token, caches on the writable /tmp,
# and the log level and format (the processes `up` starts read them too).
CHART_ENV = [
    {"name": "RAY_AUTH_MODE", "value": "token"},
    {
        "name": "RAY_AUTH_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "prod-splitserve-ray-auth", "key": "auth_token"}},
    },
    {"name": "XDG_CACHE_HOME", "value": "/tmp/cache"},
    {"name": "SPLITSERVE_LOG_LEVEL", "value": "INFO"},
    {"name": "SPLITSERVE_LOG_FORMAT", "value": "text"},
]
TMP_VOLUME = {"name": "tmp", "emptyDir": {}}
TMP_MOUNT = {"name": "tmp", "mountPath": "/tmp"}


def render(values: dict[str, Any], release: str = "prod") -> dict[str, list[dict[str, Any]]]:
    """{template: its manifests}; NOTES.txt under its path as {"text": ...}."""
    chart = helm_python.Chart.load(CHART)
    out = chart.render(values, name=release, namespace="serving", is_install=True)
    manifests = {}
    for path, text in out.items():
        if path.endswith("NOTES.txt"):
            manifests[path] = [{"text": text}]
        else:
            manifests[path] = [d for d in yaml.safe_load_all(text) if d]
    return manifests


def objects(values: dict[str, Any], release: str = "prod") -> list[dict[str, Any]]:
    return [
        m for path, ms in render(values, release).items() if not path.endswith(".txt") for m in ms
    ]


def pod_templates(node: Any) -> Iterator[dict[str, Any]]:
    """Every pod template (or pod) anywhere in ``node``: a mapping whose spec has containers."""
    if isinstance(node, dict):
        if isinstance(node.get("spec"), dict) and "containers" in node["spec"]:
            yield node
        for child in node.values():
            yield from pod_templates(child)
    elif isinstance(node, list):
        for child in node:
            yield from pod_templates(child)


def ray_pods(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{head, prefill, decode: the group's pod spec}."""
    cluster = next(o for o in objects(values) if o["kind"] == "RayCluster")["spec"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    groups["head"] = cluster["headGroupSpec"]
    return {name: group["template"]["spec"] for name, group in groups.items()}


def head_argv(values: dict[str, Any]) -> list[str]:
    """The head container's `splitserve up ...` argv, as the shell would split it."""
    cluster = next(o for o in objects(values) if o["kind"] == "RayCluster")
    container = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    script = container["args"][0]
    ray_start, up = script.split(" && exec ")
    assert ray_start.startswith("ray start --head")
    argv = shlex.split(up)
    assert argv[:2] == ["splitserve", "up"]
    return argv[1:]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_renders_and_validates_against_kubernetes_and_crd_schemas(name):
    rendered = objects(VALUE_SETS[name])
    kinds = sorted(o["kind"] for o in rendered)
    assert "RayCluster" in kinds and "Service" in kinds
    for obj in rendered:
        if obj["kind"] in SCHEMAS:
            jsonschema.validate(obj, SCHEMAS[obj["kind"]])
        else:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        if obj["kind"] == "RayCluster":
            spec = obj["spec"]
            head_service = {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "t"},
                **spec["headGroupSpec"]["headService"],
            }
            kubernetes_validate.validate(head_service, KUBE_VERSION, strict=True)
            groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
            for group in groups:
                pod_template = {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": "t"},
                    "template": group["template"],
                }
                kubernetes_validate.validate(pod_template, KUBE_VERSION, strict=True)


def test_lint_is_clean():
    result = helm_python.lint(CHART, strict=True)
    assert result["errors"] == []
    assert all(m["severity"] <= 1 for m in result["messages"]), result["messages"]


def _distinct_value(field: dataclasses.Field[Any], kind: type) -> Any:
    """A valid value for the flag that differs from its default."""
    default = field.default
    choices = field.metadata["choices"]
    if choices:
        return next(c for c in choices if c != default)
    if kind is bool:
        return not default
    if kind is int:
        # max_logprobs' default is its largest valid value (the engine's).
        return (default or 0) + 3 if field.name != "max_logprobs" else default - 3
    if kind is float:
        return round((default or 0.0) + 0.25, 2) if field.name != "scale_down_ratio" else 0.3
    if field.name == "cpu_cores":
        return "0-1"
    return f"/etc/splitserve/{field.name}"


def test_every_flag_value_reaches_its_flag():
    """Each flag section key set to a non-default value arrives, parsed by `splitserve up`'s
    own parser, in the config the services start from; the chart's own values too."""
    values: dict[str, Any] = {}
    expected: dict[tuple[str, str], Any] = {}
    for section, (cls, _) in GENERATE.FLAG_SECTIONS.items():
        hints = typing.get_type_hints(cls)
        values[section] = {}
        for field in GENERATE.flag_fields(section):
            kinds = [k for k in typing.get_args(hints[field.name]) if k is not type(None)]
            kind = kinds[0] if kinds else hints[field.name]
            value = _distinct_value(field, kind)
            if field.name in ("model",):
                value = "smollm2-135m"
            if field.name == "kv_transfer":
                value = "tcp"
            if field.name == "otlp_traces_sample_ratio":  # a share
                value = 0.25
            if field.name == "engine":  # vllm has no second KV tier (--kv-offload-gib)
                value = "mock"
            if field.name == "mode":  # colocated has no prefill pool to size
                value = "disaggregated"
            if field.name == "tenant_limits":
                value = "acme:max_tokens_per_s=100"
            if field.name == "lora_modules":
                value = "support=/etc/splitserve/adapters/support"
            values[section][GENERATE.camel(field.name)] = value
            expected[(section, field.name)] = value
    values["planner"].update(minPrefillWorkers=1, maxPrefillWorkers=7)
    values["planner"].update(minDecodeWorkers=2, maxDecodeWorkers=9)
    for key in ("minPrefillWorkers", "maxPrefillWorkers", "minDecodeWorkers", "maxDecodeWorkers"):
        expected[("planner", GENERATE.FLAG_NAMES[key])] = values["planner"][key]
    values.update(
        prefill={"replicas": 2, "numGpus": 1, "minReplicas": 0, "maxReplicas": 4},
        decode={"replicas": 3, "numGpus": 0.5, "minReplicas": 1, "maxReplicas": 4},
        service={"port": 6000},
        metrics={"port": 9400},
        redis={"enabled": False, "external": {"url": "rediss://r:1/0", "existingSecret": ""}},
    )
    args = build_parser().parse_args(head_argv(values))
    cluster, worker, router, planner = configs_from_args(args)
    configs = {
        "engine": worker.engine,
        "worker": worker,
        "router": router,
        "cluster": cluster,
        "planner": planner,
        "redisOptions": worker.redis,
        "tracing": worker.tracing,
    }
    for (section, name), value in expected.items():
        if (section, name) == ("engine", "num_threads"):
            continue  # `up` splits the cores unless given: checked below
        got = getattr(configs[section], name)
        assert got == value, f"{section}.{name}: values {value!r}, config {got!r}"
    assert worker.engine.num_threads == values["engine"]["numThreads"]
    assert router.model == worker.engine.model == "smollm2-135m"
    assert (cluster.num_prefill_workers, cluster.num_decode_workers) == (2, 3)
    assert (cluster.prefill_num_gpus, cluster.decode_num_gpus) == (1.0, 0.5)
    assert (cluster.port, router.port, cluster.host, worker.kv_host) == (
        6000,
        6000,
        "0.0.0.0",
        "/etc/splitserve/kv_host",
    )
    assert (cluster.router_metrics_port, cluster.worker_metrics_port) == (9400, 9400)
    assert (cluster.kuberay_cluster, cluster.kuberay_namespace) == ("prod-splitserve", "serving")
    assert cluster.ray and cluster.ray_address == "auto"
    assert worker.redis.redis_url == router.redis.redis_url == "rediss://r:1/0"
    assert worker.tracing == router.tracing
    # One value for the flags routers share with workers (services.up.SHARED_WITH_WORKERS).
    assert router.stream_idle_timeout_s == worker.stream_idle_timeout_s == 60.25


def test_values_yaml_lists_every_flag_with_its_default_and_the_schema_is_fresh():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for section in GENERATE.FLAG_SECTIONS:
        fields = {GENERATE.camel(f.name): f for f in GENERATE.flag_fields(section)}
        assert set(values[section]) == set(fields), section
        for key, field in fields.items():
            if (section, key) in {("engine", "model"), ("worker", "kvHost")}:
                continue  # the chart's defaults: the embedded model, listening on the pod IP
            default = None if field.default is dataclasses.MISSING else field.default
            assert values[section][key] == default, f"{section}.{key}"
    assert json.loads((CHART / "values.schema.json").read_text()) == GENERATE.schema(), (
        "values.schema.json is stale: run python deploy/helm/generate.py"
    )


def test_schema_rejects_unknown_keys_and_wrong_types():
    chart = helm_python.Chart.load(CHART)
    for bad, message in [
        ({"engine": {"maxNumSeq": 3}}, "maxNumSeq"),
        ({"router": {"prefillPolicy": "fastest"}}, "prefillPolicy"),
        ({"prefill": {"replicas": -1}}, "replicas"),
        ({"planner": {"autoscale": "yes"}}, "autoscale"),
        ({"extraArgs": [7]}, "extraArgs"),
        ({"env": [{"value": "1"}]}, "name"),
        ({"modelVolume": {"mountPath": "models"}}, "mountPath"),
    ]:
        with pytest.raises(helm_python.HelmValuesError, match=message):
            chart.render(bad, name="prod", namespace="serving", is_install=True)


def test_gpu_pools_request_gpus_and_advertise_them_to_ray():
    cluster = next(o for o in objects(VALUE_SETS["gpu-pools"]) if o["kind"] == "RayCluster")
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    for role, replicas in (("prefill", 2), ("decode", 3)):
        group = groups[role]
        assert group["replicas"] == replicas
        assert group["rayStartParams"] == {
            "resources": json.dumps({role: 1}),
            "num-cpus": "0",
            "num-gpus": "1",
        }
        container = group["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    prefill_pod = groups["prefill"]["template"]["spec"]
    assert prefill_pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert prefill_pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert "podAntiAffinity" in groups["decode"]["template"]["spec"]["affinity"]
    argv = head_argv(VALUE_SETS["gpu-pools"])
    assert "--prefill-num-gpus=1" in argv and "--decode-num-gpus=1" in argv
    assert "--device=cuda" in argv


def test_in_chart_redis_has_auth_and_external_redis_replaces_it():
    inside = objects({})
    kinds = {(o["kind"], o["metadata"]["name"]) for o in inside}
    assert {("StatefulSet", "prod-splitserve-redis"), ("Secret", "prod-splitserve-redis")} <= kinds
    redis = next(o for o in inside if o["kind"] == "StatefulSet")
    container = redis["spec"]["template"]["spec"]["containers"][0]
    assert "--requirepass" in container["command"][-1]
    assert "$REDIS_PASSWORD" in container["command"][-1]  # not the password itself
    assert "--redis-url=redis://prod-splitserve-redis:6379/0" in head_argv({})

    outside = objects(VALUE_SETS["external-redis"])
    assert not any(o["kind"] == "StatefulSet" for o in outside)
    assert [o["metadata"]["name"] for o in outside if o["kind"] == "Secret"] == [
        "prod-splitserve-ray-auth"
    ]
    argv = head_argv(VALUE_SETS["external-redis"])
    assert "--redis-url=rediss://redis.example.internal:6380/0" in argv
    assert "--redis-tls-ca-file=/etc/redis-ca/ca.crt" in argv
    head = next(o for o in outside if o["kind"] == "RayCluster")["spec"]["headGroupSpec"]
    env = head["template"]["spec"]["containers"][0]["env"]
    assert env[0] == {
        "name": "SPLITSERVE_REDIS_PASSWORD",
        "valueFrom": {"secretKeyRef": {"name": "ext", "key": "password"}},
    }
    with pytest.raises(helm_python.HelmRenderError, match=r"redis.external.url is required"):
        render({"redis": {"enabled": False}})


def test_autoscaler_values_turn_the_planner_on():
    argv = head_argv(VALUE_SETS["autoscaler"])
    assert "--autoscale" in argv and "--no-autoscale" in head_argv({})
    assert "--target-ttft-ms=800" in argv and "--target-itl-ms=60" in argv
    notes = render(VALUE_SETS["autoscaler"])["splitserve/templates/NOTES.txt"][0]["text"]
    assert "planner is on" in notes


def test_only_the_router_is_reachable_from_outside_and_redis_only_from_the_release():
    rendered = objects(VALUE_SETS["everything-on"])
    policies = {o["metadata"]["name"]: o["spec"] for o in rendered if o["kind"] == "NetworkPolicy"}
    internal = policies["prod-splitserve-internal"]
    release = {"app.kubernetes.io/name": "splitserve", "app.kubernetes.io/instance": "prod"}
    # Every pod of the release, Redis included, takes traffic only from the release's pods...
    assert internal["podSelector"]["matchLabels"] == release
    assert internal["ingress"] == [{"from": [{"podSelector": {"matchLabels": release}}]}]
    # ...except the head pod's gRPC and HTTP ports, from the configured peers.
    router = policies["prod-splitserve-router"]
    assert router["podSelector"]["matchLabels"] == {**release, "splitserve.io/role": "head"}
    assert router["ingress"] == [
        {
            "ports": [{"port": "grpc", "protocol": "TCP"}, {"port": "http", "protocol": "TCP"}],
            "from": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}],
        }
    ]
    service = next(
        o for o in rendered if o["kind"] == "Service" and o["metadata"]["name"] == "prod-splitserve"
    )
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["selector"]["splitserve.io/role"] == "head"
    pdbs = [o for o in rendered if o["kind"] == "PodDisruptionBudget"]
    assert sorted(p["spec"]["selector"]["matchLabels"]["splitserve.io/role"] for p in pdbs) == [
        "decode",
        "prefill",
    ]


def test_controller_may_patch_only_its_own_raycluster():
    role = next(o for o in objects({}) if o["kind"] == "Role")
    assert role["rules"] == [
        {
            "apiGroups": ["ray.io"],
            "resources": ["rayclusters"],
            "resourceNames": ["prod-splitserve"],
            "verbs": ["get", "patch"],
        }
    ]


def test_notes_tell_how_to_call_the_service():
    notes = render({})["splitserve/templates/NOTES.txt"][0]["text"]
    assert "port-forward svc/prod-splitserve 50051:50051" in notes
    assert "splitserve client --target 127.0.0.1:50051" in notes


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_no_pod_gets_service_links(name):
    """Released as `splitserve`, the client Service is `splitserve`: with service links on,
    every pod of the namespace would get SPLITSERVE_PORT=tcp://... and the like, which
    splitserve's flags read as their env vars."""
    rendered = objects(VALUE_SETS[name], release="splitserve")
    services = {o["metadata"]["name"] for o in rendered if o["kind"] == "Service"}
    assert "splitserve" in services
    templates = list(pod_templates(rendered))
    roles = sorted(t["metadata"]["labels"]["splitserve.io/role"] for t in templates)
    in_chart_redis = VALUE_SETS[name].get("redis", {}).get("enabled", True)
    assert roles == sorted(["head", "prefill", "decode", *(["redis"] if in_chart_redis else [])])
    for template in templates:
        assert template["spec"].get("enableServiceLinks") is False, template["metadata"]["labels"]


def test_model_volume_env_and_env_from_reach_every_splitserve_container():
    pods = ray_pods(VALUE_SETS["model-volume"])
    redis_password = {
        "name": "SPLITSERVE_REDIS_PASSWORD",
        "valueFrom": {"secretKeyRef": {"name": "prod-splitserve-redis", "key": "password"}},
    }
    release_env = [
        *CHART_ENV,
        {"name": "HF_HOME", "value": "/models/huggingface"},
        {
            "name": "HF_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}},
        },
        {"name": "HF_HUB_OFFLINE", "value": "1"},
    ]
    tuning = {"configMapRef": {"name": "tuning"}}
    router_secrets = {"secretRef": {"name": "router-secrets"}}
    expected = {
        "head": ([redis_password, *release_env], [tuning, router_secrets]),
        "prefill": (release_env, [tuning]),
        "decode": ([*release_env, {"name": "OMP_NUM_THREADS", "value": "8"}], [tuning]),
    }
    for group, (env, env_from) in expected.items():
        pod = pods[group]
        assert pod["volumes"] == [
            {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
            TMP_VOLUME,
        ], group
        container = pod["containers"][0]
        assert container["volumeMounts"] == [
            {"name": "model", "mountPath": "/models", "readOnly": True},
            TMP_MOUNT,
        ], group
        assert container["env"] == env, group
        assert container["envFrom"] == env_from, group


def test_model_on_a_host_path_and_nothing_extra_by_default():
    for pod in ray_pods(VALUE_SETS["host-path-model"]).values():
        assert pod["volumes"] == [
            {"name": "model", "hostPath": {"path": "/srv/models", "type": "Directory"}},
            TMP_VOLUME,
        ]
        mounts = pod["containers"][0]["volumeMounts"]
        assert mounts == [{"name": "model", "mountPath": "/weights", "readOnly": False}, TMP_MOUNT]
    assert "--model=/weights/Llama-3.2-1B-Instruct" in head_argv(VALUE_SETS["host-path-model"])
    for group, pod in ray_pods({}).items():
        assert pod["volumes"] == [TMP_VOLUME]
        container = pod["containers"][0]
        assert container["volumeMounts"] == [TMP_MOUNT] and "envFrom" not in container
        assert (
            container["env"]
            == (
                [
                    {
                        "name": "SPLITSERVE_REDIS_PASSWORD",
                        "valueFrom": {
                            "secretKeyRef": {"name": "prod-splitserve-redis", "key": "password"}
                        },
                    }
                ]
                if group == "head"
                else []
            )
            + CHART_ENV
        )
    with pytest.raises(helm_python.HelmRenderError, match="claimName or hostPath, not both"):
        render({"modelVolume": {"claimName": "models", "hostPath": "/srv/models"}})


def test_the_kv_tier_on_the_nodes_disk_is_mounted_in_the_worker_pods_only():
    values = {
        "engine": {"kvOffloadGib": 50, "kvOffloadDir": "/var/lib/splitserve/kv"},
        "kvOffloadVolume": {"hostPath": "/mnt/nvme/splitserve-kv"},
    }
    for group, pod in ray_pods(values).items():
        tier_volume = {
            "name": "kv-offload",
            "hostPath": {"path": "/mnt/nvme/splitserve-kv", "type": "DirectoryOrCreate"},
        }
        tier_mount = {"name": "kv-offload", "mountPath": "/var/lib/splitserve/kv"}
        worker = group != "head"
        assert (tier_volume in pod["volumes"]) is worker, group
        assert (tier_mount in pod["containers"][0]["volumeMounts"]) is worker, group
    assert "--kv-offload-dir=/var/lib/splitserve/kv" in head_argv(values)
    with pytest.raises(helm_python.HelmRenderError, match=r"set engine\.kvOffloadDir"):
        render({"kvOffloadVolume": {"hostPath": "/mnt/nvme/splitserve-kv"}})


def test_extra_args_follow_the_values_flags_and_win():
    """extraArgs, shell-quoted, reach `splitserve up`'s parser after the values' flags."""
    argv = head_argv(VALUE_SETS["model-volume"])
    assert argv[-2:] == ["--served-model-name=Qwen's 0.5B", "--max-num-seqs=7"]
    assert "--max-num-seqs=128" in argv  # the values' own, overridden
    _, worker, router, _ = configs_from_args(build_parser().parse_args(argv))
    engine = worker.engine
    assert (engine.model, engine.revision) == ("Qwen/Qwen2.5-0.5B-Instruct", "v2")
    assert (engine.served_model_name, engine.max_num_seqs) == ("Qwen's 0.5B", 7)
    assert router.model == "Qwen/Qwen2.5-0.5B-Instruct"


def test_a_pools_worker_args_reach_only_that_pool():
    """prefill.workerArgs / decode.workerArgs become --prefill-worker-args /
    --decode-worker-args, shell-quoted; each pool's workers start from the shared flags with
    its own set over them (a vLLM prefill pool beside a native decode pool)."""
    values = {
        "engine": {"maxNumSeqs": 64},
        "prefill": {"workerArgs": "--engine vllm --vllm-args '--block-size 32 --enforce-eager'"},
        "decode": {"workerArgs": "--max-num-seqs 256 --lease-ttl-s 9"},
    }
    cluster, worker, _, _ = configs_from_args(build_parser().parse_args(head_argv(values)))
    prefill = cluster.pool_worker_config(Role.PREFILL, worker)
    decode = cluster.pool_worker_config(Role.DECODE, worker)
    assert (prefill.engine.engine, prefill.engine.vllm_args) == (
        EngineKind.VLLM,
        "--block-size 32 --enforce-eager",
    )
    assert prefill.engine.max_num_seqs == 64 and prefill.lease_ttl_s == worker.lease_ttl_s
    assert decode.engine.engine is EngineKind.NATIVE
    assert (decode.engine.max_num_seqs, decode.lease_ttl_s) == (256, 9.0)
    assert not any(a.startswith("--prefill-worker-args") for a in head_argv({}))
