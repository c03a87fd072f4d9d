"""The chart's security: what its defaults turn on, and where the API keys and the TLS Secrets
of ``security.*`` reach (rendered as in ``test_chart``)."""

from __future__ import annotations

import helm_python
import pytest

from services.cli import build_parser
from services.up import configs_from_args
from tests.deploy.test_chart import VALUE_SETS, head_argv, objects, ray_pods


def test_defaults_are_hardened():
    """Without any security value: NetworkPolicies, Ray token auth, the dashboard on localhost
    only, non-root pods with a read-only root filesystem and no privilege escalation."""
    rendered = objects({})
    policies = {o["metadata"]["name"] for o in rendered if o["kind"] == "NetworkPolicy"}
    assert policies == {
        "prod-splitserve-internal", "prod-splitserve-router", "prod-splitserve-metrics"
    }  # fmt: skip
    secret = next(o for o in rendered if o["metadata"]["name"] == "prod-splitserve-ray-auth")
    assert len(secret["data"]["auth_token"]) >= 48
    cluster = next(o for o in rendered if o["kind"] == "RayCluster")
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "--dashboard-host=127.0.0.1" in head["args"][0]
    assert all(p["name"] != "dashboard" for p in head["ports"])
    for group, pod in ray_pods({}).items():
        assert pod["securityContext"]["runAsNonRoot"] is True, group
        container = pod["containers"][0]
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True, group
        assert context["allowPrivilegeEscalation"] is False, group
        assert context["capabilities"] == {"drop": ["ALL"]}, group
        assert {"name": "RAY_AUTH_MODE", "value": "token"} in container["env"], group
    argv = head_argv({})
    assert not any(a.startswith(("--tls-dir", "--api-key-file")) for a in argv)


def test_metrics_stay_scrapable_from_the_peers_allowed():
    policies = {
        o["metadata"]["name"]: o["spec"]
        for o in objects(VALUE_SETS["secured"])
        if o["kind"] == "NetworkPolicy"
    }
    metrics = policies["prod-splitserve-metrics"]
    assert metrics["ingress"] == [
        {
            "ports": [{"port": "metrics", "protocol": "TCP"}],
            "from": [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}}}
            ],
        }
    ]
    roles = metrics["podSelector"]["matchExpressions"][1]
    assert roles == {
        "key": "splitserve.io/role",
        "operator": "In",
        "values": ["head", "prefill", "decode"],
    }


def test_api_keys_and_tls_secrets_reach_the_flags_and_the_pods_that_need_them():
    values = VALUE_SETS["secured"]
    argv = head_argv(values)
    assert "--tls-dir=/etc/splitserve/tls" in argv
    assert "--api-key-file=/etc/splitserve/api-keys/api-keys" in argv
    cluster, _, router, _ = configs_from_args(build_parser().parse_args(argv))
    assert cluster.identity_tls_dir("controller") == "/etc/splitserve/tls/controller"
    assert router.tls_dir == "/etc/splitserve/tls/router"
    assert router.api_key_file == "/etc/splitserve/api-keys/api-keys"
    expected_secrets = {
        "head": {"tls-router": "router-cert", "tls-controller": "prod-splitserve-tls-controller",
                 "api-keys": "splitserve-api-keys"},
        "prefill": {"tls-prefill": "prod-splitserve-tls-prefill"},
        "decode": {"tls-decode": "prod-splitserve-tls-decode"},
    }  # fmt: skip
    for group, pod in ray_pods(values).items():
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        assert secrets == expected_secrets[group], group
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        for name in secrets:
            identity = name.removeprefix("tls-")
            want = (
                "/etc/splitserve/api-keys"
                if name == "api-keys"
                else f"/etc/splitserve/tls/{identity}"
            )
            assert mounts[name] == want, (group, name)
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "ray-token"
    assert not any(o["metadata"]["name"] == "prod-splitserve-ray-auth" for o in objects(values))


def test_cert_manager_certificates_write_the_secrets_the_pods_mount():
    values = VALUE_SETS["cert-manager"]
    certificates = {
        o["spec"]["commonName"]: o["spec"] for o in objects(values) if o["kind"] == "Certificate"
    }
    assert set(certificates) == {"router", "controller", "prefill", "decode"}
    mounted = {
        volume["secret"]["secretName"]
        for pod in ray_pods(values).values()
        for volume in pod["volumes"]
        if volume["name"].startswith("tls-")
    }
    assert {spec["secretName"] for spec in certificates.values()} == mounted
    for identity, spec in certificates.items():
        assert spec["issuerRef"] == {
            "name": "splitserve-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"
        }  # fmt: skip
        assert {"server auth", "client auth"} <= set(spec["usages"])
        assert spec["dnsNames"][0] == f"{identity}.splitserve.internal"
    assert certificates["router"]["dnsNames"][1:] == [
        "prod-splitserve",
        "prod-splitserve.serving.svc",
        "prod-splitserve.serving.svc.cluster.local",
        "llm.example.com",
    ]
    # Off unless asked for (cert-manager may not be installed), and never without an issuer.
    assert not any(o["kind"] == "Certificate" for o in objects(VALUE_SETS["secured"]))
    no_issuer = {"security": {"tls": {"enabled": True, "certManager": {"enabled": True}}}}
    with pytest.raises(helm_python.HelmRenderError, match=r"issuerRef\.name is required"):
        objects(no_issuer)


def test_an_external_redis_tls_secret_is_mounted_everywhere_and_names_the_ca_file():
    values = VALUE_SETS["cert-manager"]
    for group, pod in ray_pods(values).items():
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["redis-tls"]["secret"]["secretName"] == "rca", group
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert mounts["redis-tls"] == "/etc/splitserve/redis-tls", group
    _, worker, router, _ = configs_from_args(build_parser().parse_args(head_argv(values)))
    assert worker.redis.redis_tls_ca_file == "/etc/splitserve/redis-tls/ca.crt"
    assert router.redis.redis_url == "rediss://r:6380/0"
    # An explicit CA file wins over the Secret's.
    own = {**values, "redisOptions": {"redisTlsCaFile": "/etc/own/ca.pem"}}
    argv = head_argv(own)
    assert "--redis-tls-ca-file=/etc/own/ca.pem" in argv
    assert "--redis-tls-ca-file=/etc/splitserve/redis-tls/ca.crt" not in argv
