"""JSON schemas of the custom resources the chart renders, written for these tests from the
KubeRay (``ray.io/v1`` RayCluster), prometheus-operator (``monitoring.coreos.com/v1``
ServiceMonitor) and cert-manager (``cert-manager.io/v1`` Certificate) API references, for the
fields the chart uses; unknown fields are errors.
Pod templates inside a RayCluster are checked against Kubernetes' own schema separately."""

from __future__ import annotations

from typing import Any

_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_INT32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}


def _obj(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
        "required": list(required),
    }


_METADATA = _obj(
    {
        "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "namespace": {"type": "string"},
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
    },
    ("name",),
)

RAY_CLUSTER = _obj(
    {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayCluster"},
        "metadata": _METADATA,
        "spec": _obj(
            {
                "rayVersion": {"type": "string"},
                "enableInTreeAutoscaling": {"type": "boolean"},
                "suspend": {"type": "boolean"},
                "headGroupSpec": _obj(
                    {
                        "serviceType": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                        "enableIngress": {"type": "boolean"},
                        # map[string]string: every value must be a string.
                        "rayStartParams": _STRING_MAP,
                        "template": {"type": "object"},
                        # A core/v1 Service (checked against Kubernetes' schema separately).
                        "headService": _obj(
                            {"metadata": {"type": "object"}, "spec": {"type": "object"}}
                        ),
                    },
                    ("rayStartParams", "template"),
                ),
                "workerGroupSpecs": {
                    "type": "array",
                    "items": _obj(
                        {
                            "groupName": {"type": "string", "minLength": 1},
                            "replicas": _INT32,
                            "minReplicas": _INT32,
                            "maxReplicas": _INT32,
                            "numOfHosts": _INT32,
                            "idleTimeoutSeconds": _INT32,
                            "suspend": {"type": "boolean"},
                            "rayStartParams": _STRING_MAP,
                            "template": {"type": "object"},
                            "scaleStrategy": _obj(
                                {"workersToDelete": {"type": "array", "items": {"type": "string"}}}
                            ),
                        },
                        ("groupName", "rayStartParams", "template"),
                    ),
                },
            },
            ("headGroupSpec",),
        ),
    },
    ("apiVersion", "kind", "metadata", "spec"),
)

SERVICE_MONITOR = _obj(
    {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": _METADATA,
        "spec": _obj(
            {
                "selector": _obj({"matchLabels": _STRING_MAP}),
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": _obj(
                        {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                        },
                        ("port",),
                    ),
                },
            },
            ("selector", "endpoints"),
        ),
    },
    ("apiVersion", "kind", "metadata", "spec"),
)

_DURATION = {"type": "string", "pattern": "^([0-9]+(\\.[0-9]+)?(h|m|s|ms))+$"}
_KEY_USAGES = [
    "signing", "digital signature", "content commitment", "key encipherment", "key agreement",
    "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any",
    "server auth", "client auth", "code signing", "email protection", "s/mime",
    "ipsec end system", "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing",
    "microsoft sgc", "netscape sgc",
]  # fmt: skip

CERTIFICATE = _obj(
    {
        "apiVersion": {"const": "cert-manager.io/v1"},
        "kind": {"const": "Certificate"},
        "metadata": _METADATA,
        "spec": _obj(
            {
                "secretName": {"type": "string", "minLength": 1},
                "commonName": {"type": "string", "maxLength": 64},
                "dnsNames": {"type": "array", "items": {"type": "string"}},
                "duration": _DURATION,
                "renewBefore": _DURATION,
                "privateKey": _obj(
                    {
                        "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                        "size": {"type": "integer"},
                        "encoding": {"enum": ["PKCS1", "PKCS8"]},
                        "rotationPolicy": {"enum": ["Never", "Always"]},
                    }
                ),
                "usages": {"type": "array", "items": {"enum": _KEY_USAGES}},
                "issuerRef": _obj(
                    {
                        "name": {"type": "string", "minLength": 1},
                        "kind": {"type": "string"},
                        "group": {"type": "string"},
                    },
                    ("name",),
                ),
            },
            ("secretName", "issuerRef"),
        ),
    },
    ("apiVersion", "kind", "metadata", "spec"),
)

SCHEMAS = {"RayCluster": RAY_CLUSTER, "ServiceMonitor": SERVICE_MONITOR, "Certificate": CERTIFICATE}
