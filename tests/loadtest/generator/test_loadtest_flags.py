"""``splitserve loadtest``'s flags without a cluster: combinations refused in one line with
exit status 2, and whole runs through the HTTP backends against a fake OpenAI server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.tokenizer import Tokenizer
from loadtest.generator.datasets import write_sharegpt_file
from services.cli import main
from tests.loadtest.generator.fake_openai import FakeServer, serving


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--backend", "openai-chat", "--target", "h:1"], "--target is for --backend grpc;"),
        (["--base-url", "http://h:1"], "--base-url is for the openai-* backends;"),
        (["--backend", "openai-completions", "--base-url", "h:1"], "must start with http://"),
        (["--dataset", "sharegpt"], "--dataset sharegpt needs --dataset-path FILE"),
        (["--dataset-path", "d.json"], "--dataset-path needs --dataset jsonl or sharegpt"),
        (["--dataset", "jsonl", "--dataset-path", "d", "--workload", "chat"], "--workload is"),
        (["--output-len", "5"], "--output-len is for --dataset jsonl"),
        (["--dataset", "jsonl", "--dataset-path", "d", "--output-len", "0"], "must be >= 1"),
        (["--num-requests", "0"], "num_requests must be >= 1"),
        (["--dataset", "jsonl", "--dataset-path", "/nonexistent.jsonl"], "cannot read"),
    ],
)
def test_bad_flags_fail_in_one_line(tmp_path, capsys, flags, message):
    argv = ["loadtest", "--concurrency", "1", "--out", str(tmp_path), *flags]
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("splitserve loadtest: ") and message in line


def test_a_malformed_dataset_names_its_line(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": 3}\n')
    argv = ["loadtest", "--rate", "1", "--dataset", "jsonl", "--dataset-path", str(path)]
    assert main([*argv, "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"splitserve loadtest: {path}:2: needs a non-empty string 'prompt'\n"
    )


def test_unknown_backend_is_an_argparse_error(tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["loadtest", "--rate", "1", "--backend", "http", "--out", str(tmp_path)])
    assert exc.value.code == 2


@pytest.mark.parametrize("backend", ["openai-completions", "openai-chat"])
def test_a_sharegpt_run_over_http_writes_vllm_keys(tiny_llama_dir, tmp_path, backend):
    dataset = write_sharegpt_file(tmp_path / "sg.json", Tokenizer(tiny_llama_dir), 40, seed=1)
    out = tmp_path / "out"
    with serving(FakeServer(root=str(tiny_llama_dir), max_model_len=512)) as server:
        argv = [
            "loadtest", "--backend", backend, "--base-url", server.base_url + "/",
            "--dataset", "sharegpt", "--dataset-path", str(dataset), "--num-requests", "6",
            "--concurrency", "2", "--no-progress", "--timeout-s", "30", "--out", str(out),
        ]  # fmt: skip
        assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    config = results["config"]
    assert (config["backend"], config["dataset"], config["workload"]) == (
        backend,
        "sharegpt",
        "sharegpt",
    )
    assert config["target"] == server.base_url and config["model"] == "fake-model"
    (run,) = results["runs"]
    assert run["summary"]["errors"] == {} and run["completed"] == 6 == len(server.bodies)
    assert run["total_output_tokens"] == sum(
        b.get("max_tokens", b.get("max_completion_tokens")) for b in server.bodies
    )
    for key in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            assert run[f"{stat}_{key}_ms"] >= 0
    assert run["mean_ttft_ms"] > 0 and run["request_throughput"] > 0
    prompts = [
        b["messages"][0]["content"] if "messages" in b else b["prompt"] for b in server.bodies
    ]
    assert all(isinstance(p, str) and p for p in prompts)


def test_a_synthetic_chat_run_sends_text_that_fits(tiny_llama_dir: Path, tmp_path):
    tokenizer = Tokenizer(tiny_llama_dir)
    with serving(FakeServer(root=str(tiny_llama_dir), max_model_len=300)) as server:
        argv = [
            "loadtest", "--backend", "openai-chat", "--base-url", server.base_url,
            "--workload", "long-mixed", "--num-requests", "8", "--rate", "50", "--seed", "2",
            "--no-progress", "--out", str(tmp_path),
        ]  # fmt: skip
        assert main(argv) == 0
    assert len(server.bodies) == 8
    for body in server.bodies:
        (message,) = body["messages"]
        prompt = tokenizer.encode_chat([message])
        assert len(prompt) + body["max_completion_tokens"] <= 300
