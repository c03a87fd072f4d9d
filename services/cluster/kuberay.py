"""Sizing the pools' Kubernetes nodes: the KubeRay ``RayCluster`` worker groups.

On Kubernetes each prefill or decode worker actor has a pod of its own (a worker group's pods
offer one unit of the ``prefill`` / ``decode`` Ray resource). Growing a pool therefore also
raises its group's ``replicas`` so that KubeRay creates the pods the new actors wait for;
shrinking lowers it once a worker is drained and names that worker's pod in
``scaleStrategy.workersToDelete``, so that KubeRay deletes the emptied pod and not a busy one.
Worker groups are named after the pools (``prefill``, ``decode``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast

from kubernetes import client, config

logger = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "ray.io", "v1", "rayclusters"
_JSON_PATCH = "application/json-patch+json"


class KubeRayGroups:
    """The worker groups of one ``RayCluster``, through the Kubernetes API.

    ``api_client`` defaults to the pod's in-cluster service account (the chart's Role allows
    ``get`` and ``patch`` on its own RayCluster), else to ``$KUBECONFIG`` / ``~/.kube/config``.
    Calls block: run them off the event loop.
    """

    def __init__(
        self, cluster_name: str, namespace: str, api_client: client.ApiClient | None = None
    ) -> None:
        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        self.cluster_name = cluster_name
        self.namespace = namespace
        self._api = client.CustomObjectsApi(api_client)

    def _get(self) -> dict[str, Any]:
        return cast(
            dict[str, Any],
            self._api.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, self.cluster_name
            ),
        )

    def _group(self, group: str) -> tuple[int, dict[str, Any]]:
        groups = self._get()["spec"].get("workerGroupSpecs", [])
        for index, spec in enumerate(groups):
            if spec.get("groupName") == group:
                return index, spec
        raise ValueError(f"RayCluster {self.cluster_name} has no worker group {group!r}")

    def check_replicas(self, group: str, replicas: int) -> None:
        """Raise ``ValueError`` unless ``group`` exists and allows ``replicas`` (its
        ``minReplicas``..``maxReplicas``)."""
        self._check(group, self._group(group)[1], replicas)

    def _check(self, group: str, spec: dict[str, Any], replicas: int) -> None:
        low, high = spec.get("minReplicas", 0), spec.get("maxReplicas", 2**31 - 1)
        if not low <= replicas <= high:
            raise ValueError(
                f"num_workers: the {group} worker group of RayCluster {self.cluster_name} "
                f"allows {low} to {high} replicas, got {replicas}"
            )

    def set_replicas(self, group: str, replicas: int, pods_to_delete: Sequence[str] = ()) -> None:
        """Set ``group``'s replicas, deleting ``pods_to_delete`` first when it shrinks.

        Raises ``ValueError`` like ``check_replicas``. The patch tests the group's name at its
        index, so a concurrent reordering of the groups fails the patch instead of resizing
        another group.
        """
        index, spec = self._group(group)
        self._check(group, spec, replicas)
        path = f"/spec/workerGroupSpecs/{index}"
        patch: list[dict[str, Any]] = [
            {"op": "test", "path": f"{path}/groupName", "value": group},
            {"op": "replace", "path": f"{path}/replicas", "value": replicas},
        ]
        if pods_to_delete:
            patch.append(
                {
                    "op": "add",
                    "path": f"{path}/scaleStrategy",
                    "value": {"workersToDelete": list(pods_to_delete)},
                }
            )
        self._api.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            self.namespace,
            PLURAL,
            self.cluster_name,
            patch,
            _content_type=_JSON_PATCH,
        )
        logger.info(
            "RayCluster %s/%s: %s group to %d replicas%s",
            self.namespace,
            self.cluster_name,
            group,
            replicas,
            f", deleting {', '.join(pods_to_delete)}" if pods_to_delete else "",
        )
