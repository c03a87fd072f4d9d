"""``splitserve client`` against a cluster that is still starting, as README's quick start runs
it: right after ``splitserve up &``, before the workers are healthy."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from engine import LLM, SamplingParams
from services.service_process import PortReservation, ServiceProcess, wait_healthy
from tests.waiting import wait_until


def test_client_waits_for_workers_that_are_still_starting(tiny_llama_dir, tmp_path):
    host = "127.0.0.1"
    # Each held until its service is gone: the router dials addresses not served yet.
    ports = {role: PortReservation(host) for role in ("prefill", "decode", "router")}
    prefill, decode, router = (f"{host}:{ports[role].port}" for role in ports)
    common = ["--host", host, "--metrics-port", "0"]
    worker_flags = ["--model", str(tiny_llama_dir), "--dtype", "float32", "--num-kv-blocks", "64"]

    def service(role: str, address: str, *flags: str) -> ServiceProcess:
        port = address.rsplit(":", 1)[1]
        argv = [sys.executable, "-m", f"services.{role}", *common, "--port", port, *flags]
        return ServiceProcess(role, address, 0, argv, reservations=[ports[role]])

    processes = [
        service(
            "router", router, "--model", str(tiny_llama_dir),
            "--prefill-workers", prefill, "--decode-workers", decode,
        ),
        service("prefill", prefill, *worker_flags),
        service("decode", decode, *worker_flags),
    ]  # fmt: skip
    env = dict(os.environ)
    stderr_path = tmp_path / "client.stderr"
    waiting = "waiting for the cluster: no decode worker is ready yet; "
    try:
        processes[0].start(env)
        wait_healthy(processes[0], time.monotonic() + 120)
        with stderr_path.open("w") as stderr_file:
            client = subprocess.Popen(
                [
                    sys.executable, "-m", "services.cli", "client", "--target", router,
                    "--max-tokens", "8", "--json", "--timeout-s", "120", "hello world",
                ],
                stdout=subprocess.PIPE, stderr=stderr_file, text=True,
            )  # fmt: skip

        def says_it_waits() -> bool:  # (or exited: the assertion below shows why)
            return waiting in stderr_path.read_text() or client.poll() is not None

        # The router answers, but no worker does yet: the client says it waits, and waits on.
        wait_until(says_it_waits, 60, f"the client's {waiting!r} line")
        assert client.poll() is None, (client.communicate(), stderr_path.read_text())
        for process in processes[1:]:
            process.start(env)
        stdout, _ = client.communicate(timeout=180)
        stderr = stderr_path.read_text()
    finally:
        for process in processes:
            if process.popen is not None:
                process.signal(signal.SIGKILL)
                process.popen.wait()
            process.release_ports()
    assert client.returncode == 0, stderr
    assert waiting in stderr
    assert f"decode worker {decode}: " in stderr  # which one, and why (not listening yet)
    got = json.loads(stdout)
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    want = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert got["token_ids"] == want.token_ids and got["text"] == want.text
