"""A local HTTP endpoint that speaks the few Kubernetes API calls the controller makes.

It serves one ``RayCluster`` object: ``GET`` returns it, a JSON-patch ``PATCH`` is checked
(method, path, content type, body) and applied to it, and every request is recorded.
Anything else is answered 404 and recorded too, so that a test sees unexpected calls.
"""

from __future__ import annotations

import copy
import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

JSON_PATCH = "application/json-patch+json"


@dataclass(frozen=True, slots=True)
class Recorded:
    method: str
    path: str
    content_type: str
    body: Any


def ray_cluster(name: str, namespace: str, groups: dict[str, tuple[int, int, int]]) -> dict:
    """A RayCluster with worker groups ``{name: (replicas, minReplicas, maxReplicas)}``."""
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "headGroupSpec": {"rayStartParams": {}, "template": {}},
            "workerGroupSpecs": [
                {
                    "groupName": group,
                    "replicas": replicas,
                    "minReplicas": low,
                    "maxReplicas": high,
                    "rayStartParams": {},
                    "template": {},
                }
                for group, (replicas, low, high) in groups.items()
            ],
        },
    }


def _pointer(path: str) -> list[str | int]:
    return [int(p) if p.isdigit() else p for p in path.strip("/").split("/")]


def apply_json_patch(obj: dict, patch: list[dict]) -> dict:
    """RFC 6902 ``test`` / ``replace`` / ``add`` on object members and list indexes."""
    out = copy.deepcopy(obj)
    for op in patch:
        *parents, last = _pointer(op["path"])
        node: Any = out
        for key in parents:
            node = node[key]
        if op["op"] == "test":
            if node[last] != op["value"]:
                raise ValueError(f"test failed at {op['path']}")
        elif op["op"] in ("replace", "add"):
            if op["op"] == "replace" and last not in node:
                raise ValueError(f"nothing to replace at {op['path']}")
            node[last] = op["value"]
        else:
            raise ValueError(f"unsupported op {op['op']}")
    return out


class KubeAPI:
    """``with KubeAPI(obj) as api:`` serves on ``api.url`` until the block ends."""

    def __init__(self, obj: dict) -> None:
        self.obj = obj
        self.requests: list[Recorded] = []
        meta = obj["metadata"]
        self.path = f"/apis/ray.io/v1/namespaces/{meta['namespace']}/rayclusters/{meta['name']}"
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_port}"

    def patches(self) -> list[Recorded]:
        with self._lock:
            return [r for r in self.requests if r.method == "PATCH"]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _reply(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _record(self) -> Recorded:
                length = int(self.headers.get("Content-Length", 0))
                raw = self.rfile.read(length) if length else b""
                recorded = Recorded(
                    self.command,
                    self.path,
                    self.headers.get("Content-Type", ""),
                    json.loads(raw) if raw else None,
                )
                with api._lock:
                    api.requests.append(recorded)
                return recorded

            def do_GET(self) -> None:
                self._record()
                if self.path != api.path:
                    self._reply(404, {"kind": "Status", "code": 404})
                    return
                with api._lock:
                    self._reply(200, api.obj)

            def do_PATCH(self) -> None:
                recorded = self._record()
                if self.path != api.path or recorded.content_type != JSON_PATCH:
                    self._reply(415 if self.path == api.path else 404, {"kind": "Status"})
                    return
                try:
                    with api._lock:
                        api.obj = apply_json_patch(api.obj, recorded.body)
                        obj = api.obj
                except (ValueError, KeyError, IndexError) as exc:
                    self._reply(422, {"kind": "Status", "message": str(exc)})
                    return
                self._reply(200, obj)

        return Handler

    def __enter__(self) -> KubeAPI:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def kubeconfig(self, path: str) -> str:
        """Write a kubeconfig pointing at this endpoint; return its path."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "local", "cluster": {"server": self.url}}],
            "users": [{"name": "local", "user": {"token": "test"}}],
            "contexts": [{"name": "local", "context": {"cluster": "local", "user": "local"}}],
            "current-context": "local",
        }
        with open(path, "w") as f:
            json.dump(config, f)
        return path
