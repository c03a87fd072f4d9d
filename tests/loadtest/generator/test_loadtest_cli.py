"""``splitserve loadtest`` against a real local cluster: every request accounted for, all three
kinds of report written, numbers that make sense."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from engine.tokenizer import Tokenizer
from loadtest.generator.datasets import DatasetKind, load_dataset, write_sharegpt_file
from services.launcher import LocalCluster
from services.service_process import PortReservation, ServiceProcess, wait_healthy
from tests.services.conftest import Client, tiny_engine_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    """1 prefill + 1 decode worker, each pinned to its own core as the experiments run them."""
    cores = sorted(os.sched_getaffinity(0))
    cluster = LocalCluster(
        engine=tiny_engine_config(tiny_llama_dir),
        worker_cpu_cores=(str(cores[0]), str(cores[-1])),
    )
    try:
        cluster.start(timeout_s=180)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def router_address(cluster):
    return cluster.router_address


def test_each_worker_thread_runs_on_its_own_core(cluster):
    cores = sorted(os.sched_getaffinity(0))
    workers = [*cluster.workers("prefill"), *cluster.workers("decode")]
    for worker, core in zip(workers, (cores[0], cores[-1]), strict=True):
        assert worker.popen is not None
        tids = [int(t) for t in os.listdir(f"/proc/{worker.popen.pid}/task")]
        assert len(tids) > 2  # gRPC, asyncio and torch threads, not just the main one
        assert all(os.sched_getaffinity(tid) == {core} for tid in tids), worker.role


@pytest.mark.parametrize(
    ("workload", "load"),
    [("shared-prefix", ["--rate", "3,6"]), ("long-mixed", ["--concurrency", "3"])],
)
def test_short_loadtest_writes_plausible_reports(router_address, tmp_path, workload, load):
    out = tmp_path / "report"
    argv = [
        sys.executable, "-m", "services.cli", "loadtest", "--target", router_address,
        "--workload", workload, *load, "--duration", "3", "--num-requests", "10",
        "--slo-ttft-ms", "5000", "--slo-itl-ms", "1000", "--seed", "1", "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["workload"] == workload
    assert len(results["runs"]) == (2 if "--rate" in load else 1)
    for run in results["runs"]:
        summary = run["summary"]
        assert 1 <= summary["num_sent"] <= 10
        assert summary["num_completed"] + sum(summary["errors"].values()) == summary["num_sent"]
        assert len(run["requests"]) == summary["num_sent"]
        assert summary["errors"] == {}
        assert summary["requests_per_s"] > 0 and summary["output_tokens_per_s"] > 0
        assert 0 <= summary["goodput_requests_per_s"] <= summary["requests_per_s"]
        assert 0 <= summary["prefix_hit_rate"] < 1
        ttft, e2e = summary["ttft_ms"], summary["e2e_ms"]
        assert 0 < ttft["p50"] <= ttft["p90"] <= ttft["p99"] <= e2e["p99"]
        assert 0 < summary["itl_ms"]["p50"] <= summary["itl_ms"]["p99"]
        for request in run["requests"]:
            assert sum(request["token_counts"]) >= 1
    report = (out / "report.md").read_text()
    assert report.count("| rate ") + report.count("| concurrency ") == len(results["runs"])
    for png in ("latency_cdf.png", "rate_sweep.png"):
        data = (out / png).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_loadtest_waits_for_workers_that_are_still_starting(tiny_llama_dir, tmp_path):
    """Right after ``splitserve up &``: the router answers, its workers do not yet."""
    host = "127.0.0.1"
    # Each held until its service is gone: the router dials addresses not served yet.
    ports = {role: PortReservation(host) for role in ("prefill", "decode", "router")}
    prefill, decode, router = (f"{host}:{ports[role].port}" for role in ports)
    model = ["--model", str(tiny_llama_dir)]
    worker_flags = [*model, "--dtype", "float32", "--num-kv-blocks", "64", "--num-threads", "1"]

    def service(role: str, address: str, *flags: str) -> ServiceProcess:
        port = address.rsplit(":", 1)[1]
        argv = [sys.executable, "-m", f"services.{role}", "--host", host, "--port", port, *flags]
        argv += ["--metrics-port", "0"]
        return ServiceProcess(role, address, 0, argv, reservations=[ports[role]])

    processes = [
        service("router", router, *model, "--prefill-workers", prefill, "--decode-workers", decode),
        service("prefill", prefill, *worker_flags),
        service("decode", decode, *worker_flags),
    ]
    env = dict(os.environ)
    out = tmp_path / "report"
    try:
        processes[0].start(env)
        wait_healthy(processes[0], time.monotonic() + 120)
        loadtest = subprocess.Popen(
            [
                sys.executable, "-m", "services.cli", "loadtest", "--target", router,
                "--concurrency", "1", "--num-requests", "2", "--duration", "5",
                "--no-progress", "--timeout-s", "120", "--out", str(out),
            ],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert loadtest.stderr is not None
        waiting = loadtest.stderr.readline()  # its first word: why it waits
        for process in processes[1:]:
            process.start(env)
        _, stderr = loadtest.communicate(timeout=300)
    finally:
        for process in processes:
            if process.popen is not None:
                process.signal(signal.SIGKILL)
                process.popen.wait()
            process.release_ports()
    assert loadtest.returncode == 0, waiting + stderr
    assert waiting.startswith("waiting for the cluster: no decode worker is ready yet; "), waiting
    assert json.loads((out / "results.json").read_text())["runs"][0]["summary"]["errors"] == {}


def test_200_sharegpt_conversations_run_through_both_apis(cluster, tiny_llama_dir, tmp_path):
    """The same ShareGPT file through gRPC and through the HTTP API (completions and chat):
    every usable conversation is sent, and every request sent completes."""
    dataset = write_sharegpt_file(
        tmp_path / "sharegpt.json", Tokenizer(tiny_llama_dir), 200, seed=3
    )
    client = Client(cluster.router_address)
    max_model_len = min(w.info.max_model_len for w in client.status().workers)
    client.close()
    usable = len(
        load_dataset(DatasetKind.SHAREGPT, dataset, default_output_tokens=1).sample(
            1000, 0, Tokenizer(tiny_llama_dir), max_model_len
        )
    )
    assert 100 < usable < 200  # the generator writes some conversations to be filtered out
    addresses = {
        "grpc": ["--target", cluster.router_address],
        "openai-completions": ["--base-url", cluster.http_url],
        "openai-chat": ["--base-url", cluster.http_url],
    }
    for backend, address in addresses.items():
        out = tmp_path / backend
        argv = [
            sys.executable, "-m", "services.cli", "loadtest", "--backend", backend, *address,
            "--dataset", "sharegpt", "--dataset-path", str(dataset), "--concurrency", "16",
            "--num-requests", "1000", "--duration", "600", "--no-progress", "--out", str(out),
        ]  # fmt: skip
        result = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr
        (run,) = json.loads((out / "results.json").read_text())["runs"]
        summary = run["summary"]
        assert summary["num_sent"] == usable, backend
        assert summary["errors"] == {} and summary["num_completed"] == usable, backend
        assert run["completed"] == usable and run["total_output_tokens"] > 0
        assert all(r["error"] is None and r["end_s"] for r in run["requests"])


def test_users_replay_conversations_turn_by_turn(cluster, tiny_llama_dir, tmp_path):
    """``--users``: every turn of every conversation is sent with its whole history, later
    turns reuse it from the cache, and the report says so per turn (synthetic conversations
    and a ShareGPT file's human turns)."""
    dataset = write_sharegpt_file(tmp_path / "sharegpt.json", Tokenizer(tiny_llama_dir), 20, seed=4)
    sources = {
        "synthetic": ["--system-prompt-tokens", "32", "--user-turn-tokens", "8,16"],
        "sharegpt": ["--dataset", "sharegpt", "--dataset-path", str(dataset)],
    }
    for name, source in sources.items():
        out = tmp_path / name
        argv = [
            sys.executable, "-m", "services.cli", "loadtest", "--backend", "openai-chat",
            "--base-url", cluster.http_url, "--users", "4", "--turns", "3", "--think-time-s", "0",
            "--reply-tokens", "4", *source, "--out", str(out),
        ]  # fmt: skip
        result = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr
        report = json.loads((out / "conversations.json").read_text())
        first, *later = report["per_turn"]
        assert first["num_turns"] == 4 and first["num_errors"] == 0, name
        assert all(t["num_errors"] == 0 and t["num_turns"] <= 4 for t in later), name
        assert report["later_turns"]["num_turns"] > 0
        # Each later turn's history is in the cache (it holds every conversation here).
        reused = report["later_turns"]["cached_tokens"]
        assert reused > 0 and report["later_turns_history_recomputed_tokens"] < reused
        assert "turns 2+: history tokens recomputed" in result.stdout
    refused = subprocess.run(
        [sys.executable, "-m", "services.cli", "loadtest", "--target", cluster.router_address,
         "--users", "4", "--out", str(tmp_path / "grpc")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2
    assert "--backend openai-chat" in refused.stderr
