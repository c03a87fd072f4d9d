"""Write ``splitserve/values.schema.json`` from the flags' config dataclasses.

Run ``python deploy/helm/generate.py`` after adding or changing a flag; ``tests/deploy`` fails
while the committed schema differs from what this produces, or while ``values.yaml`` misses a
flag. Each flag section of the values (engine, worker, router, cluster, planner, redisOptions,
tracing) accepts exactly the flags of its dataclass, typed, as camelCase keys.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import typing
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from services.cluster.config import ClusterConfig
from services.cluster.planner import PlannerConfig
from services.common.logs import LogFormat
from services.common.redis_config import RedisConfig
from services.common.tracing import TracingConfig
from services.router.config import RouterConfig
from services.up import _PER_ROUTER, _PER_WORKER, SHARED_WITH_WORKERS
from services.worker.config import WorkerConfig

CHART_DIR = Path(__file__).resolve().parent / "splitserve"
# Flags the chart sets itself from other values (service.port, prefill.replicas, ...).
CHART_OWNED = {
    "cluster": (
        "num_prefill_workers", "num_decode_workers", "host", "port", "ray", "ray_address",
        "prefill_num_gpus", "decode_num_gpus", "prefill_worker_args", "decode_worker_args",
        "kuberay_cluster", "kuberay_namespace",
        "router_metrics_port", "worker_metrics_port", "tls_dir", "extra_models",
    ),
    "router": ("api_key_file", "admin_api_key"),
    "redisOptions": ("redis_url", "redis_password"),
}  # fmt: skip
FLAG_SECTIONS: dict[str, tuple[type, tuple[str, ...]]] = {
    "engine": (EngineConfig, ()),
    "worker": (WorkerConfig, _PER_WORKER),
    "router": (RouterConfig, (*_PER_ROUTER, *SHARED_WITH_WORKERS, *CHART_OWNED["router"])),
    "cluster": (ClusterConfig, CHART_OWNED["cluster"]),
    "planner": (PlannerConfig, ()),
    "redisOptions": (RedisConfig, CHART_OWNED["redisOptions"]),
    "tracing": (TracingConfig, ()),
}
# Flags a Service, a containerPort and the probes point at: a real port, not any integer.
CHART_PORTS = {"router": ("http_port",)}
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}
# The identities whose TLS Secrets the pods mount (services/common/tls.py; no client one).
_TLS_IDENTITIES = ("router", "controller", "prefill", "decode")


def camel(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(part.capitalize() for part in rest)


def _flag_names() -> dict[str, str]:
    return {
        camel(f.name): f.name
        for cls, skip in FLAG_SECTIONS.values()
        for f in dataclasses.fields(cls)
        if "help" in f.metadata and f.name not in skip
    }


def flag_fields(section: str) -> list[dataclasses.Field[Any]]:
    """The flags a values section maps to, in declaration order."""
    cls, skip = FLAG_SECTIONS[section]
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata and f.name not in skip]


def _json_type(kind: type) -> str:
    """A flag type's JSON type: a ``StrEnum``'s is its values' (strings)."""
    return _JSON_TYPES[str if issubclass(kind, enum.StrEnum) else kind]


def _flag_schema(section: str) -> dict[str, Any]:
    cls, _ = FLAG_SECTIONS[section]
    hints = typing.get_type_hints(cls)
    properties = {}
    for f in flag_fields(section):
        kinds = [k for k in typing.get_args(hints[f.name]) if k is not type(None)]
        optional = bool(kinds)
        kind = kinds[0] if kinds else hints[f.name]
        prop: dict[str, Any] = {
            "description": f.metadata["help"].replace("%%", "%"),
            "type": [_json_type(kind), "null"] if optional else _json_type(kind),
        }
        if f.metadata["choices"]:
            prop["enum"] = [*f.metadata["choices"], *([None] if optional else [])]
        if f.name in CHART_PORTS.get(section, ()):
            prop.update(minimum=_PORT["minimum"], maximum=_PORT["maximum"])
        properties[camel(f.name)] = prop
    return {"type": "object", "additionalProperties": False, "properties": properties}


def _obj(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
    }
    if required:
        schema["required"] = list(required)
    return schema


_ANY_OBJECT = {"type": "object"}
_STRING = {"type": "string"}
_ABSOLUTE_PATH = {"type": "string", "pattern": "^/"}
_ABSOLUTE_PATH_OR_EMPTY = {"type": "string", "pattern": "^(/.*)?$"}
_COUNT = {"type": "integer", "minimum": 0}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_DURATION = {"type": "string", "pattern": "^([0-9]+(\\.[0-9]+)?(h|m|s|ms))+$"}
_PLACEMENT = {
    "resources": _ANY_OBJECT,
    "nodeSelector": {"type": "object", "additionalProperties": _STRING},
    "tolerations": {"type": "array", "items": _ANY_OBJECT},
    "affinity": _ANY_OBJECT,
    "annotations": {"type": "object", "additionalProperties": _STRING},
}
_ENV = {
    "env": {"type": "array", "items": {"type": "object", "required": ["name"]}},
    "envFrom": {"type": "array", "items": _ANY_OBJECT},
}


def _pool() -> dict[str, Any]:
    return _obj(
        {
            "replicas": _COUNT,
            "minReplicas": _COUNT,
            "maxReplicas": _COUNT,
            "numGpus": {"type": "number", "minimum": 0},
            "workerArgs": _STRING,
            **_PLACEMENT,
            **_ENV,
        },
        ("replicas", "minReplicas", "maxReplicas"),
    )


def _extra_model() -> dict[str, Any]:
    """One ``extraModels`` entry: ``--extra-models``' fields (``services.cluster.models``)."""
    size = {"type": ["integer", "null"], "minimum": 0}
    return _obj(
        {
            "name": {"type": "string", "minLength": 1},
            "model": {"type": "string", "minLength": 1},
            "revision": {"type": ["string", "null"]},
            "num_prefill_workers": size,
            "num_decode_workers": size,
            "worker_args": _STRING,
        },
        ("name", "model"),
    )


def schema() -> dict[str, Any]:
    image = {
        "repository": _STRING,
        "tag": _STRING,
        "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
    }
    properties: dict[str, Any] = {
        "image": _obj(image, ("repository",)),
        "imagePullSecrets": {"type": "array", "items": _ANY_OBJECT},
        "rayVersion": _STRING,
        "service": _obj(
            {
                "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                "port": _PORT,
                "annotations": {"type": "object", "additionalProperties": _STRING},
            }
        ),
        "metrics": _obj(
            {
                "port": _PORT,
                "serviceMonitor": _obj(
                    {
                        "enabled": {"type": "boolean"},
                        "interval": _STRING,
                        "labels": {"type": "object", "additionalProperties": _STRING},
                    }
                ),
                "grafanaDashboard": _obj(
                    {
                        "enabled": {"type": "boolean"},
                        "labels": {"type": "object", "additionalProperties": _STRING},
                        "annotations": {"type": "object", "additionalProperties": _STRING},
                    }
                ),
            }
        ),
        "head": _obj({**_PLACEMENT, **_ENV}),
        "prefill": _pool(),
        "decode": _pool(),
        "extraModels": {"type": "array", "items": _extra_model()},
        "redis": _obj(
            {
                "enabled": {"type": "boolean"},
                "image": _obj(image),
                "password": _STRING,
                "existingSecret": _STRING,
                "resources": _ANY_OBJECT,
                "persistence": _obj({"enabled": {"type": "boolean"}, "size": _STRING}),
                "external": _obj({"url": _STRING, "existingSecret": _STRING, "tlsSecret": _STRING}),
            }
        ),
        "podDisruptionBudget": _obj(
            {"enabled": {"type": "boolean"}, "maxUnavailable": {"type": ["integer", "string"]}}
        ),
        "networkPolicy": _obj(
            {
                "enabled": {"type": "boolean"},
                "routerFrom": {"type": "array", "items": _ANY_OBJECT},
                "metricsFrom": {"type": "array", "items": _ANY_OBJECT},
            }
        ),
        "security": _obj(
            {
                "apiKeysSecret": _STRING,
                "tls": _obj(
                    {
                        "enabled": {"type": "boolean"},
                        "secrets": _obj({identity: _STRING for identity in _TLS_IDENTITIES}),
                        "certManager": _obj(
                            {
                                "enabled": {"type": "boolean"},
                                "issuerRef": _obj(
                                    {"name": _STRING, "kind": _STRING, "group": _STRING}
                                ),
                                "duration": _DURATION,
                                "renewBefore": _DURATION,
                                "routerDnsNames": {"type": "array", "items": _STRING},
                            }
                        ),
                    }
                ),
                "rayAuth": _obj({"enabled": {"type": "boolean"}, "existingSecret": _STRING}),
                "podSecurityContext": _ANY_OBJECT,
                "containerSecurityContext": _ANY_OBJECT,
            }
        ),
        "serviceAccount": _obj(
            {
                "create": {"type": "boolean"},
                "name": _STRING,
                "annotations": {"type": "object", "additionalProperties": _STRING},
            }
        ),
        "modelVolume": _obj(
            {
                "claimName": _STRING,
                "hostPath": _ABSOLUTE_PATH_OR_EMPTY,
                "mountPath": _ABSOLUTE_PATH,
                "readOnly": {"type": "boolean"},
            }
        ),
        "kvOffloadVolume": _obj({"hostPath": _ABSOLUTE_PATH_OR_EMPTY}),
        "huggingface": _obj(
            {
                "home": _ABSOLUTE_PATH_OR_EMPTY,
                "tokenSecret": _obj({"name": _STRING, "key": {"type": "string", "minLength": 1}}),
            }
        ),
        **_ENV,
        "extraArgs": {"type": "array", "items": _STRING},
        "logging": _obj(
            {
                "level": {"enum": ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]},
                "format": {"enum": [f.value for f in LogFormat]},
            }
        ),
    }
    for section in FLAG_SECTIONS:
        properties[section] = _flag_schema(section)
    return {
        "$schema": "https://json-schema.org/draft-07/schema#",
        "title": "splitserve Helm values",
        **_obj(properties),
    }


FLAG_NAMES = _flag_names()  # camelCase values key -> config field name


def render() -> str:
    return json.dumps(schema(), indent=2) + "\n"


if __name__ == "__main__":
    (CHART_DIR / "values.schema.json").write_text(render())
