"""``splitserve up`` and ``splitserve client`` as a newcomer runs them, in subprocesses."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.flags import add_flags, from_args, to_argv
from services.certs import write_cluster_certs
from services.common.router_channel import API_KEY_ENV
from services.launcher import LocalCluster
from services.service_process import PortReservation, wait_healthy
from tests.services.conftest import scrape, stop_like_ctrl_c, tiny_engine_config
from tests.waiting import wait_until


def test_engine_flags_round_trip():
    config = EngineConfig(
        model="m", dtype="float32", max_num_seqs=7, enable_prefix_caching=False, num_threads=1
    )
    parser = argparse.ArgumentParser()
    add_flags(parser, EngineConfig)
    assert from_args(EngineConfig, parser.parse_args(to_argv(config))) == config


def test_every_port_the_launcher_picks_is_held_until_its_service_serves_on_it(tiny_llama_dir):
    """From the moment the launcher spawns its services, no other process can bind their
    ports (nor be handed one by the kernel); each service then serves on its own."""
    cluster = LocalCluster(engine=tiny_engine_config(tiny_llama_dir))
    try:
        cluster.launch()
        for process in cluster.processes:
            host = process.address.rsplit(":", 1)[0]
            ports = [int(process.address.rsplit(":", 1)[1]), process.metrics_port]
            for port in [*ports, *([process.http_port] if process.http_port else [])]:
                with socket.socket() as stranger, pytest.raises(OSError, match="in use"):
                    stranger.bind((host, port))
        deadline_s = time.monotonic() + 300
        for process in cluster.processes:
            wait_healthy(process, deadline_s)  # its gRPC port
            assert scrape(process.metrics_port)  # its /metrics
        with urllib.request.urlopen(f"{cluster.http_url}/v1/models", timeout=60) as reply:
            assert json.loads(reply.read())["data"]
    finally:
        cluster.stop()


def test_up_refuses_several_routers_without_redis(tiny_llama_dir):
    argv = [
        sys.executable, "-m", "services.cli", "up", "--model", str(tiny_llama_dir),
        "--num-routers", "2",
    ]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--redis-url" in result.stderr


@pytest.fixture(params=["ray", "no-ray"])
def up_process(request, tiny_llama_dir):
    # Held until the test ends: `up` binds them meanwhile (see PortReservation).
    port_reservation, http_reservation = PortReservation(), PortReservation()
    port, http_port = port_reservation.port, http_reservation.port
    argv = [
        sys.executable, "-m", "services.cli", "up", "--model", str(tiny_llama_dir),
        "--dtype", "float32", "--num-kv-blocks", "64", "--port", str(port), f"--{request.param}",
        "--http-port", str(http_port),
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    yield proc, port, http_port
    stop_like_ctrl_c(proc)
    port_reservation.close()
    http_reservation.close()


def test_up_serves_the_client_and_shuts_down_on_ctrl_c(up_process, tiny_llama_dir):
    proc, port, http_port = up_process
    assert proc.stdout is not None
    banner = proc.stdout.readline()
    assert f"listening on 127.0.0.1:{port}" in banner, banner
    proc.stdout.readline()  # try: splitserve client ...
    openai_url = f"http://127.0.0.1:{http_port}/v1"
    assert proc.stdout.readline().startswith(f"OpenAI API: {openai_url} ")
    children = psutil.Process(proc.pid).children(recursive=True)
    if "Ray actors" in banner:  # Ray's own processes, and one actor per service
        actors = {c.name() for c in children if c.name().startswith("ray::")}
        assert {"ray::PrefillActor", "ray::DecodeActor", "ray::RouterActor"} <= actors, actors
    else:
        assert len(children) == 3  # prefill, decode, router

    client = subprocess.run(
        [
            sys.executable, "-m", "services.cli", "client", "--target", f"127.0.0.1:{port}",
            "--max-tokens", "8", "--json", "hello world",
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert client.returncode == 0, client.stderr
    got = json.loads(client.stdout)
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    want = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert got["token_ids"] == want.token_ids and got["text"] == want.text
    assert got["finish_reason"] == want.finish_reason
    assert got["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    body = json.dumps({"prompt": "hello world", "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"{openai_url}/completions", body, {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert json.loads(reply.read())["choices"][0]["text"] == want.text

    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    wait_until(
        lambda: not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children),
        30,
        "the exit of every service process of `splitserve up`",
        0.1,
    )


def test_client_reports_bad_input_clearly(up_process):
    proc, port, _ = up_process
    assert proc.stdout is not None and "listening" in proc.stdout.readline()
    client = subprocess.run(
        [
            sys.executable, "-m", "services.cli", "client", "--target", f"127.0.0.1:{port}",
            "--max-tokens", "0", "hello",
        ],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert client.returncode == 2
    assert "INVALID_ARGUMENT" in client.stderr and "max_tokens" in client.stderr


DATA_KEY = "launcher-test-data-key-0123456789"


@pytest.fixture
def secure_up(tiny_llama_dir, tmp_path):
    """``splitserve up`` (on Ray) with every hop on TLS and a data API key."""
    certs = tmp_path / "certs"
    write_cluster_certs(certs, ["localhost", "127.0.0.1"])
    key_file = tmp_path / "api-keys"
    key_file.write_text(f"{DATA_KEY} data\n")
    reservation = PortReservation()
    port = reservation.port
    argv = [
        sys.executable, "-m", "services.cli", "up", "--model", str(tiny_llama_dir),
        "--dtype", "float32", "--num-kv-blocks", "64", "--port", str(port),
        "--tls-dir", str(certs), "--api-key-file", str(key_file),
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    yield proc, port, certs
    stop_like_ctrl_c(proc)
    reservation.close()


def test_up_with_tls_and_api_keys_serves_the_plaintext_clusters_tokens(secure_up, tiny_llama_dir):
    proc, port, certs = secure_up
    assert proc.stdout is not None and "listening" in proc.stdout.readline()

    def client(
        *flags: str, key: str = DATA_KEY, timeout_s: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable, "-m", "services.cli", "client", "--target", f"127.0.0.1:{port}",
                "--max-tokens", "8", "--json", "--timeout-s", str(timeout_s), *flags,
                "hello world",
            ],
            env={**os.environ, API_KEY_ENV: key}, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    served = client("--tls-ca-file", str(certs / "ca.crt"))
    assert served.returncode == 0, served.stderr
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    want = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert json.loads(served.stdout)["token_ids"] == want.token_ids
    no_key = client("--tls-ca-file", str(certs / "ca.crt"), key="")
    assert no_key.returncode == 2 and "UNAUTHENTICATED" in no_key.stderr
    # Without the CA the client cannot complete the handshake: it never gets an answer.
    plaintext = client(timeout_s=3)
    assert plaintext.returncode == 2, plaintext.stderr
    assert "no router answers" in plaintext.stderr, plaintext.stderr
