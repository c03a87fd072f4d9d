"""``splitserve up`` when every worker fails to load its model, as a user meets it: ``up`` says
why on its console (once per error, while the controller retries), ``client``, ``status`` and
``loadtest`` say why they wait and give up at their timeout without a traceback, and Ctrl-C
stops ``up`` promptly, leaving no process behind. Real processes throughout."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from services.service_process import PortReservation
from splitserve.v1 import router_pb2, router_pb2_grpc, worker_pb2
from tests.waiting import wait_until

# What every worker raises on the corrupt weights (its last line).
ERROR = "SafetensorError: Error while deserializing header"
# Ctrl-C to exit: the routers' graceful stop and Ray's shutdown (see services/cluster/driver.py),
# measured at 2-4 s on a 2-core machine.
STOP_BOUND_S = 10.0


@pytest.fixture(scope="module")
def broken_model_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with corrupt weights: a router (it reads only the tokenizer) starts, every
    worker fails to load."""
    path = tmp_path_factory.mktemp("broken") / "model"
    shutil.copytree(tiny_llama_dir, path)
    for weights in path.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    return path


class Up:
    """``splitserve up`` in a subprocess, its stderr collected line by line as it comes."""

    def __init__(self, model_dir: Path, *flags: str) -> None:
        # Held for as long as this object lives: `up` binds it meanwhile.
        self._reservation = PortReservation()
        port = self._reservation.port
        self.target = f"127.0.0.1:{port}"
        argv = [
            sys.executable, "-m", "services.cli", "up", "--model", str(model_dir),
            "--dtype", "float32", "--num-kv-blocks", "64", "--port", str(port), *flags,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()

    def wait_for_line(self, predicate: Callable[[str], bool], timeout_s: float) -> str:
        deadline_s = time.monotonic() + timeout_s
        with self._changed:
            while True:
                found = next((line for line in self.lines if predicate(line)), None)
                if found is not None:
                    return found
                remaining_s = deadline_s - time.monotonic()
                assert remaining_s > 0, f"not on up's stderr in time: {self.lines[-20:]}"
                assert self.proc.poll() is None, f"up exited: {self.lines[-20:]}"
                self._changed.wait(min(remaining_s, 1.0))

    def ctrl_c(self) -> float:
        """Send SIGINT; return how long ``up`` took to exit (0 expected), once every process it
        started has gone too."""
        services = psutil.Process(self.proc.pid).children(recursive=True)
        assert services
        start_s = time.monotonic()
        self.proc.send_signal(signal.SIGINT)
        assert self.proc.wait(timeout=60) == 0
        took_s = time.monotonic() - start_s
        _, alive = psutil.wait_procs(services, timeout=10)
        assert not alive, f"outlived `splitserve up`: {[p.info for p in alive]}"
        return took_s

    def kill(self) -> None:
        """Whatever a failed test left running: ``up`` and everything under it; then its port
        is let go."""
        if self.proc.poll() is None:
            services = psutil.Process(self.proc.pid).children(recursive=True)
            self.proc.kill()
            self.proc.wait()
            for service in services:
                service.kill()
        self._reservation.close()


@pytest.fixture
def start_up(broken_model_dir: Path) -> Iterator[Callable[..., Up]]:
    started: list[Up] = []

    def start(*flags: str) -> Up:
        started.append(Up(broken_model_dir, *flags))
        return started[-1]

    yield start
    for up in started:
        up.kill()


def splitserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, timeout=120
    )


def wait_for_status(
    target: str, done: Callable[[router_pb2.StatusResponse], bool], timeout_s: float = 120
) -> router_pb2.StatusResponse:
    """Poll the router's Status until ``done`` accepts it."""
    seen: list[router_pb2.StatusResponse | None] = [None]  # the last answer, if any

    with grpc.insecure_channel(target) as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        def accepted() -> router_pb2.StatusResponse | None:
            try:
                seen[0] = stub.Status(router_pb2.StatusRequest(), timeout=10)
            except grpc.RpcError:
                seen[0] = None
            return seen[0] if seen[0] is not None and done(seen[0]) else None

        return wait_until(accepted, timeout_s, lambda: f"an accepted status (last: {seen[0]})", 0.2)


def waiting_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("waiting for the cluster: ")]


def test_no_ray_worker_exits_at_load_everyone_says_why(start_up, tmp_path):
    up = start_up("--no-ray")
    for role in ("prefill", "decode"):
        line = up.wait_for_line(
            lambda line, role=role: line.startswith(f"splitserve up: {role} worker 127.0.0.1:"), 120
        )
        assert "exited (exit code 1: " in line and ERROR in line, line
    # Once the router has seen why (its channels retry a refused connection within 2 s), the
    # situation stays as it is.
    wait_for_status(
        up.target,
        lambda status: (
            len(status.workers) == 2
            and all("exited during startup" in w.last_error for w in status.workers)
        ),
    )

    client = splitserve("client", "--target", up.target, "--timeout-s", "3", "hello")
    assert client.returncode == 2
    # One message: the situation does not change while it waits.
    (waiting,) = waiting_lines(client.stderr)
    assert waiting.startswith("waiting for the cluster: no decode worker is ready yet; ")
    assert "decode worker 127.0.0.1:" in waiting and "exited during startup" in waiting
    assert ERROR in waiting
    last = client.stderr.splitlines()[-1]
    assert last.startswith("error: not serving after 3 s: no decode worker is ready yet")
    assert ERROR in last

    status = splitserve("status", "--target", up.target)
    assert status.returncode == 0, status.stderr
    assert "not serving: no decode worker is ready yet" in status.stdout
    assert ERROR in status.stdout

    out = tmp_path / "load"
    loadtest = splitserve(
        "loadtest", "--target", up.target, "--rate", "1", "--timeout-s", "3", "--out", str(out)
    )
    assert loadtest.returncode == 2
    assert "Traceback" not in loadtest.stderr
    assert "splitserve loadtest: not serving after 3 s: no decode worker" in loadtest.stderr
    assert ERROR in loadtest.stderr

    assert up.ctrl_c() < STOP_BOUND_S


def test_on_ray_failing_starts_are_reported_once_and_ctrl_c_stops_promptly(start_up):
    up = start_up("--ray")
    for role in ("prefill", "decode"):
        line = up.wait_for_line(
            lambda line, role=role: line.startswith(f"splitserve up: {role} worker {role}-"), 180
        )
        assert "failed to start: " in line and ERROR in line and "(attempt 1," in line, line
    wait_for_status(up.target, lambda status: all(ERROR in p.last_error for p in status.pools))

    client = splitserve("client", "--target", up.target, "--timeout-s", "3", "hello")
    assert client.returncode == 2
    (waiting,) = waiting_lines(client.stderr)
    assert "decode pool: 0/1 ready, failing to start (retrying): " in waiting
    assert ERROR in waiting and ERROR in client.stderr.splitlines()[-1]

    # The controller retries (with backoff); up does not print the same error again.
    wait_for_status(
        up.target,
        lambda status: any(
            p.role == worker_pb2.WORKER_ROLE_DECODE and p.num_failed_starts >= 2
            for p in status.pools
        ),
    )
    assert sum(line.startswith("splitserve up: decode worker") for line in up.lines) == 1

    status = splitserve("status", "--target", up.target)
    assert status.returncode == 0, status.stderr
    assert "not serving: no decode worker is ready yet; decode pool: 0/1 ready" in status.stdout
    assert "FAILED_STARTS" in status.stdout

    assert up.ctrl_c() < STOP_BOUND_S
