"""The router's OpenAI-compatible HTTP API in the chart (``router.http``, ``router.httpPort``):
the client Service's `http` port, the head's probes on /health and /version, the
NetworkPolicy, NOTES.txt, and the values reaching ``--http`` / ``--http-port`` (rendered as in
``test_chart``)."""

from __future__ import annotations

import re
from typing import Any

import helm_python
import pytest

from services.cli import build_parser
from services.up import configs_from_args
from tests.deploy.test_chart import CHART, VALUE_SETS, head_argv, objects, ray_pods, render

NOTES = "splitserve/templates/NOTES.txt"
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


def client_service(values: dict[str, Any]) -> dict[str, Any]:
    return next(
        o
        for o in objects(values)
        if o["kind"] == "Service" and o["metadata"]["name"] == "prod-splitserve"
    )


def head_container(values: dict[str, Any]) -> dict[str, Any]:
    return ray_pods(values)["head"]["containers"][0]


def router_policy_ports(values: dict[str, Any]) -> list[dict[str, Any]]:
    policy = next(
        o
        for o in objects(values)
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "prod-splitserve-router"
    )
    [rule] = policy["spec"]["ingress"]
    return rule["ports"]


def test_the_client_service_exposes_the_http_port_beside_grpc():
    service = client_service({})
    assert service["spec"]["ports"] == [
        {"name": "grpc", "port": 50051, "targetPort": "grpc", "protocol": "TCP",
         "appProtocol": "grpc"},
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP",
         "appProtocol": "http"},
    ]  # fmt: skip
    ports = {p["name"]: p for p in head_container({})["ports"]}
    assert ports["http"] == {"name": "http", "containerPort": 8000, "protocol": "TCP"}
    assert ports["grpc"]["containerPort"] == 50051

    moved = {"router": {"httpPort": 8443}}
    [grpc, http] = client_service(moved)["spec"]["ports"]
    assert (grpc["port"], http["port"], http["targetPort"]) == (50051, 8443, "http")
    ports = {p["name"]: p["containerPort"] for p in head_container(moved)["ports"]}
    assert ports["http"] == 8443


def test_readiness_is_health_and_liveness_is_version_on_the_http_port():
    container = head_container({})
    assert container["readinessProbe"] == {
        "httpGet": {"path": "/health", "port": "http", "scheme": "HTTP"},
        "periodSeconds": 5,
        "timeoutSeconds": 3,
        "failureThreshold": 2,
    }
    # /health is 503 while no decode worker serves: liveness must not restart the head for it.
    assert container["livenessProbe"] == {
        "httpGet": {"path": "/version", "port": "http", "scheme": "HTTP"},
        "periodSeconds": 10,
        "timeoutSeconds": 5,
        "failureThreshold": 6,
    }
    startup = container["startupProbe"]
    assert startup["httpGet"] == {"path": "/version", "port": "http", "scheme": "HTTP"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    # The probes' named port is the router's HTTP port, and only the head is probed by the chart
    # (the worker pods keep KubeRay's own Ray health probes).
    assert "http" in {p["name"] for p in container["ports"]}
    for group in ("prefill", "decode"):
        worker = ray_pods({})[group]["containers"][0]
        assert not set(PROBES) & set(worker), group


@pytest.mark.parametrize("name", ["default", "no-http"])
def test_workers_reach_the_gcs_of_a_head_not_ready_yet(name):
    """The head turns ready once a decode worker serves, and a worker pod dials Ray's GCS
    through KubeRay's head Service first: that Service lists the head pod while not ready."""
    cluster = next(o for o in objects(VALUE_SETS[name]) if o["kind"] == "RayCluster")
    assert cluster["spec"]["headGroupSpec"]["headService"] == {
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True}
    }


@pytest.mark.parametrize("name", ["secured", "cert-manager"])
def test_with_tls_the_probes_and_the_service_speak_https(name):
    values = VALUE_SETS[name]
    assert "--tls-dir=/etc/splitserve/tls" in head_argv(values)
    container = head_container(values)
    for probe in PROBES:
        assert container[probe]["httpGet"]["scheme"] == "HTTPS", probe
    http = next(p for p in client_service(values)["spec"]["ports"] if p["name"] == "http")
    assert http["appProtocol"] == "https"


def test_http_off_renders_no_port_no_probes_and_passes_no_http():
    values = VALUE_SETS["no-http"]
    assert [p["name"] for p in client_service(values)["spec"]["ports"]] == ["grpc"]
    container = head_container(values)
    assert "http" not in {p["name"] for p in container["ports"]}
    assert not set(PROBES) & set(container)
    assert router_policy_ports(values) == [{"port": "grpc", "protocol": "TCP"}]
    assert "OpenAI" not in render(values)[NOTES][0]["text"]
    argv = head_argv(values)
    assert "--no-http" in argv and "--http" not in argv
    _, _, router, _ = configs_from_args(build_parser().parse_args(argv))
    assert router.http is False


def test_http_values_reach_the_router_flags():
    argv = head_argv({"router": {"httpPort": 8080}})
    assert "--http" in argv and "--http-port=8080" in argv
    _, _, router, _ = configs_from_args(build_parser().parse_args(argv))
    assert (router.http, router.http_port) == (True, 8080)
    _, _, router, _ = configs_from_args(build_parser().parse_args(head_argv({})))
    assert (router.http, router.http_port) == (True, 8000)


def test_the_network_policy_lets_the_router_peers_reach_the_http_port():
    values = VALUE_SETS["everything-on"]
    assert router_policy_ports(values) == [
        {"port": "grpc", "protocol": "TCP"},
        {"port": "http", "protocol": "TCP"},
    ]


@pytest.mark.parametrize("port", [0, 65536, -1, "8000", 80.5])
def test_schema_rejects_a_bad_http_port(port):
    chart = helm_python.Chart.load(CHART)
    with pytest.raises(helm_python.HelmValuesError, match="httpPort"):
        chart.render(
            {"router": {"httpPort": port}}, name="prod", namespace="serving", is_install=True
        )
    with pytest.raises(helm_python.HelmValuesError, match="http"):
        chart.render({"router": {"http": "no"}}, name="prod", namespace="serving", is_install=True)


def test_null_http_values_are_refused():
    """Helm drops a null key before the schema sees it; for other flags null leaves the flag
    out, but the Service needs these two."""
    with pytest.raises(helm_python.HelmRenderError, match=r"router\.httpPort must be a port"):
        render({"router": {"httpPort": None}})
    with pytest.raises(helm_python.HelmRenderError, match=r"router\.http must be true or false"):
        render({"router": {"http": None}})
    render({"router": {"http": False, "httpPort": None}})


def test_the_http_ports_of_the_routers_may_not_overlap_grpc_or_metrics():
    # One port per router from each base: 3 routers take 50051-50053 (gRPC), 8000-8002, ...
    three = {"cluster": {"numRouters": 3}}
    for router, clash in [
        ({"httpPort": 50051}, "router.httpPort"),
        ({"httpPort": 50053}, "router.httpPort"),
        ({"httpPort": 9088}, "metrics.port"),
    ]:
        with pytest.raises(helm_python.HelmRenderError, match=rf"{re.escape(clash)} .*overlap"):
            render({**three, "router": router})
    render({**three, "router": {"httpPort": 50054}})
    render({**three, "router": {"httpPort": 9087}})
    # With the HTTP API off its port takes nothing.
    render({**three, "router": {"http": False, "httpPort": 50051}})


def test_notes_tell_how_to_call_the_openai_api():
    notes = render({})[NOTES][0]["text"]
    assert "port-forward svc/prod-splitserve 8000:8000" in notes
    assert "curl http://127.0.0.1:8000/v1/models" in notes
    assert 'base_url="http://127.0.0.1:8000/v1"' in notes
    secured = render(VALUE_SETS["secured"])[NOTES][0]["text"]
    assert (
        "curl --cacert ca.crt --resolve router.splitserve.internal:8000:127.0.0.1 "
        '-H "Authorization: Bearer $SPLITSERVE_API_KEY" '
        "https://router.splitserve.internal:8000/v1/models"
    ) in secured
