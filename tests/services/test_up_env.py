"""``splitserve up`` under the env vars a Kubernetes namespace injects, and with bad ones."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.flags import parse_flags
from services.cli import build_parser
from services.up import configs_from_args

# What a Service named "splitserve" injects into every pod of its namespace (service links).
SERVICE_LINKS = {
    "SPLITSERVE_PORT": "tcp://10.96.0.12:50051",
    "SPLITSERVE_PORT_50051_TCP": "tcp://10.96.0.12:50051",
    "SPLITSERVE_SERVICE_HOST": "10.96.0.12",
}


def splitserve(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        env=os.environ | env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_up_help_and_parsing_survive_service_links(monkeypatch):
    proc = splitserve("up", "--help", env=SERVICE_LINKS)
    assert proc.returncode == 0, proc.stderr
    assert "--port" in proc.stdout
    for var, value in SERVICE_LINKS.items():
        monkeypatch.setenv(var, value)
    args = parse_flags(build_parser(), ["up", "--model", "smollm2-135m", "--port", "50051"])
    cluster, _, router, _ = configs_from_args(args)
    assert cluster.port == router.port == 50051


def test_up_with_a_garbage_env_value_fails_with_one_line_naming_it():
    proc = splitserve(
        "up", "--model", "smollm2-135m", "--no-ray", env={"SPLITSERVE_MAX_NUM_SEQS": "lots"}
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "SPLITSERVE_MAX_NUM_SEQS='lots'" in lines[0] and "integer" in lines[0]


@pytest.mark.parametrize("command", ["client", "status"])
def test_commands_that_do_not_take_the_flag_ignore_its_bad_env_value(command):
    proc = splitserve(command, "--help", env={"SPLITSERVE_MAX_NUM_SEQS": "lots"})
    assert proc.returncode == 0, proc.stderr
