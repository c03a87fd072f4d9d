"""The controller's Kubernetes path through the real ``kubernetes`` client, against a local
endpoint that checks each call (no Kubernetes cluster exists on these machines)."""

from __future__ import annotations

import grpc
import pytest
from kubernetes import client

from services.cluster.kuberay import KubeRayGroups
from tests.services.cluster.conftest import ROLES, router_client, scale, wait_for_pools
from tests.services.cluster.kube_api import JSON_PATCH, KubeAPI, ray_cluster
from tests.waiting import wait_until

PATH = "/apis/ray.io/v1/namespaces/serving/rayclusters/splitserve"


def groups_client(api: KubeAPI) -> KubeRayGroups:
    configuration = client.Configuration(host=api.url)
    return KubeRayGroups("splitserve", "serving", client.ApiClient(configuration))


def replicas(api: KubeAPI) -> dict[str, int]:
    return {g["groupName"]: g["replicas"] for g in api.obj["spec"]["workerGroupSpecs"]}


def test_grow_patches_the_named_group_by_index_with_a_json_patch():
    obj = ray_cluster("splitserve", "serving", {"decode": (1, 1, 4), "prefill": (1, 0, 8)})
    with KubeAPI(obj) as api:
        groups_client(api).set_replicas("prefill", 3)
        assert [(r.method, r.path) for r in api.requests] == [("GET", PATH), ("PATCH", PATH)]
        patch = api.patches()[0]
        assert patch.content_type == JSON_PATCH
        assert patch.body == [
            {"op": "test", "path": "/spec/workerGroupSpecs/1/groupName", "value": "prefill"},
            {"op": "replace", "path": "/spec/workerGroupSpecs/1/replicas", "value": 3},
        ]
        assert replicas(api) == {"decode": 1, "prefill": 3}


def test_shrink_names_the_drained_pod():
    obj = ray_cluster("splitserve", "serving", {"prefill": (2, 0, 8), "decode": (3, 1, 4)})
    with KubeAPI(obj) as api:
        groups_client(api).set_replicas("decode", 2, ["splitserve-decode-worker-x7k2p"])
        assert api.patches()[0].body[-1] == {
            "op": "add",
            "path": "/spec/workerGroupSpecs/1/scaleStrategy",
            "value": {"workersToDelete": ["splitserve-decode-worker-x7k2p"]},
        }
        decode = api.obj["spec"]["workerGroupSpecs"][1]
        assert decode["replicas"] == 2
        assert decode["scaleStrategy"] == {"workersToDelete": ["splitserve-decode-worker-x7k2p"]}


def test_sizes_outside_the_group_bounds_and_unknown_groups_send_no_patch():
    obj = ray_cluster("splitserve", "serving", {"prefill": (1, 0, 2), "decode": (1, 1, 4)})
    with KubeAPI(obj) as api:
        groups = groups_client(api)
        with pytest.raises(ValueError, match="allows 0 to 2 replicas, got 3"):
            groups.set_replicas("prefill", 3)
        with pytest.raises(ValueError, match="allows 1 to 4 replicas, got 0"):
            groups.check_replicas("decode", 0)
        with pytest.raises(ValueError, match="no worker group 'router'"):
            groups.set_replicas("router", 1)
        assert api.patches() == []


def test_splitserve_scale_patches_the_worker_group_end_to_end(start_ray_cluster, tmp_path):
    """Router.Scale -> controller -> kubernetes client -> the endpoint: grow, then shrink once
    the worker is drained, naming its pod."""
    obj = ray_cluster("splitserve", "serving", {"prefill": (1, 0, 4), "decode": (1, 1, 4)})
    with KubeAPI(obj) as api:
        kubeconfig = api.kubeconfig(str(tmp_path / "kubeconfig"))
        cluster = start_ray_cluster(
            num_prefill_workers=1,
            num_decode_workers=1,
            kuberay_cluster="splitserve",
            kuberay_namespace="serving",
            controller_env={"KUBECONFIG": kubeconfig},
        )
        client_ = router_client(cluster)
        with pytest.raises(grpc.RpcError) as info:
            scale(client_, "prefill", 5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "allows 0 to 4 replicas, got 5" in info.value.details()
        assert api.patches() == []
        scale(client_, "prefill", 2)
        assert replicas(api) == {"prefill": 2, "decode": 1}
        wait_for_pools(client_, prefill=2, decode=1)
        scale(client_, "prefill", 1)
        wait_for_pools(client_, prefill=1, decode=1)
        wait_until(
            lambda: len(api.patches()) >= 2,
            30,
            lambda: f"the shrink's patch (requests: {api.requests})",
            0.1,
        )
        shrink = api.patches()[1]
        assert shrink.body[1] == {
            "op": "replace",
            "path": "/spec/workerGroupSpecs/0/replicas",
            "value": 1,
        }
        # Locally every "pod" is this machine; on Kubernetes it is the drained worker's pod.
        assert shrink.body[2]["value"]["workersToDelete"] == [
            next(m for m in cluster.members() if m.role == "router").hostname
        ]
        assert {p.role: p.desired_workers for p in client_.status().pools} == {
            ROLES["prefill"]: 1,
            ROLES["decode"]: 1,
        }
        client_.close()
