"""A Ray cluster across test hosts: ``ray start --head`` on one host, ``ray start --address``
on others with the ``prefill`` / ``decode`` resources, token authentication as the chart runs
it, and ``splitserve up --ray-address`` on the head host, as README's multi-machine recipe
says. Processes are ended by removing the hosts (never ``ray stop``: it would end every Ray on
this machine, the test session's own included)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc

from loadtest.fixtures.netns_hosts import UCX_ACROSS_HOSTS, HostNetwork
from splitserve.v1 import router_pb2, router_pb2_grpc

RAY_PORT = 6379
# Ray's command next to this interpreter: found without the venv's bin/ on PATH.
RAY = str(Path(sys.executable).parent / "ray")
ROUTER_PORT = 50051
_OBJECT_STORE_BYTES = 100 * 2**20


class RayHosts:
    """The Ray nodes of ``network``'s hosts and the ``splitserve up`` driving them."""

    def __init__(self, network: HostNetwork, head: str, work_dir: Path) -> None:
        self.network = network
        self.head = head
        self.head_address = f"{network[head].address}:{RAY_PORT}"
        self.router_address = f"{network[head].address}:{ROUTER_PORT}"
        self._work_dir = work_dir
        self.env = dict(
            os.environ,
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN=secrets.token_hex(16),
            RAY_USAGE_STATS_ENABLED="0",
            # Detect a lost node in seconds, not the default half minute.
            RAY_health_check_period_ms="1000",
            RAY_health_check_failure_threshold="3",
            RAY_health_check_timeout_ms="1000",
            **UCX_ACROSS_HOSTS,
        )
        self.up: subprocess.Popen[bytes] | None = None

    def start_head(self) -> None:
        self._ray_start(
            self.head,
            "--head", f"--port={RAY_PORT}", "--include-dashboard=false",
            f"--temp-dir={self._work_dir / 'ray'}",
            "--num-cpus=1",
        )  # fmt: skip

    def start_node(self, host: str, resources: Mapping[str, float]) -> None:
        resources_json = "{" + ",".join(f'"{k}": {v}' for k, v in resources.items()) + "}"
        self._ray_start(
            host, f"--address={self.head_address}", "--num-cpus=1", f"--resources={resources_json}"
        )

    def _ray_start(self, host: str, *flags: str) -> None:
        address = self.network[host].address
        argv = [
            RAY, "start", f"--node-ip-address={address}",
            f"--object-store-memory={_OBJECT_STORE_BYTES}", "--disable-usage-stats", *flags,
        ]  # fmt: skip
        run = self.network.run(
            host, argv, env=self.env, capture_output=True, text=True, timeout=120, check=False
        )
        if run.returncode:
            raise RuntimeError(
                f"{' '.join(argv)} on {host}: {run.stdout[-1500:]}{run.stderr[-1500:]}"
            )

    def splitserve_up(self, model: str, flags: Sequence[str]) -> None:
        """Start ``splitserve up`` on the head host; return once its router answers."""
        argv = [
            sys.executable, "-m", "services.cli", "up", "--model", model,
            "--ray-address", self.head_address, "--host", "0.0.0.0",
            "--port", str(ROUTER_PORT), *flags,
        ]  # fmt: skip
        self.up = self.network.popen(self.head, argv, env=self.env, start_new_session=True)
        channel = grpc.insecure_channel(self.router_address)
        stub = router_pb2_grpc.RouterStub(channel)
        deadline_s = time.monotonic() + 240
        try:
            while True:
                if self.up.poll() is not None:
                    raise RuntimeError(f"splitserve up exited with {self.up.returncode}")
                try:
                    status = stub.Status(router_pb2.StatusRequest(), timeout=5)
                    pools = {p.role: p for p in status.pools}
                    if pools and all(p.num_ready >= p.desired_workers for p in pools.values()):
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline_s:
                    raise TimeoutError("the multi-host cluster did not serve in time")
                time.sleep(1)
        finally:
            channel.close()

    def stop_up(self) -> None:
        """Ctrl-C ``splitserve up`` (it stops every actor) and wait for it."""
        if self.up is None or self.up.poll() is not None:
            return
        self.up.send_signal(signal.SIGINT)
        try:
            self.up.wait(60)
        except subprocess.TimeoutExpired:
            self.up.kill()
            self.up.wait()
