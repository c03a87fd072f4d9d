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
from services.launcher import ServiceProcess, free_port, wait_healthy


def test_client_waits_for_workers_that_are_still_starting(tiny_llama_dir):
    host = "127.0.0.1"
    prefill, decode, router = (f"{host}:{free_port()}" for _ in range(3))
    common = ["--host", host, "--metrics-port", "0"]
    worker_flags = ["--model", str(tiny_llama_dir), "--dtype", "float32", "--num-kv-blocks", "64"]

    def service(role: str, address: str, *flags: str) -> ServiceProcess:
        port = address.rsplit(":", 1)[1]
        argv = [sys.executable, "-m", f"services.{role}", *common, "--port", port, *flags]
        return ServiceProcess(role, address, 0, argv)

    processes = [
        service(
            "router", router, "--model", str(tiny_llama_dir),
            "--prefill-workers", prefill, "--decode-workers", decode,
        ),
        service("prefill", prefill, *worker_flags),
        service("decode", decode, *worker_flags),
    ]  # fmt: skip
    env = dict(os.environ)
    try:
        processes[0].start(env)
        wait_healthy(processes[0], time.monotonic() + 120)
        client = subprocess.Popen(
            [
                sys.executable, "-m", "services.cli", "client", "--target", router,
                "--max-tokens", "8", "--json", "--timeout-s", "120", "hello world",
            ],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        time.sleep(2.0)  # the router answers, but no worker does yet
        assert client.poll() is None, client.communicate()
        for process in processes[1:]:
            process.start(env)
        stdout, stderr = client.communicate(timeout=180)
    finally:
        for process in processes:
            if process.popen is not None:
                process.signal(signal.SIGKILL)
                process.popen.wait()
    assert client.returncode == 0, stderr
    assert "waiting for the cluster: no decode worker is ready yet; " in stderr
    assert f"decode worker {decode}: " in stderr  # which one, and why (not listening yet)
    got = json.loads(stdout)
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    want = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert got["token_ids"] == want.token_ids and got["text"] == want.text
