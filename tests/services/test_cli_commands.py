"""``splitserve``'s sub-commands load lazily: the light ones import no torch, Ray or loadtest."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from services.cli import COMMANDS, build_parser, chosen_command

HEAVY_MODULES = ("torch", "ray", "transformers", "loadtest", "engine.llm")

_PROBE = """
import contextlib, io, json, sys
from services.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
    main(sys.argv[1:])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {heavy} or m in {heavy})
print(json.dumps({{"help": out.getvalue(), "heavy": heavy}}))
"""


def run_help(*argv: str) -> dict:
    """Run ``splitserve *argv`` in a fresh interpreter; its help text and the heavy modules
    it imported."""
    probe = _PROBE.format(heavy=repr(set(HEAVY_MODULES)))
    proc = subprocess.run(
        [sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("command", ["status", "scale", "client"])
def test_light_commands_import_nothing_heavy(command):
    result = run_help(command, "--help")
    assert result["heavy"] == []
    assert f"usage: splitserve {command}" in result["help"]
    assert "--target" in result["help"]  # its own flags are declared


def test_top_level_help_lists_every_command_and_loads_none():
    result = run_help("--help")
    assert result["heavy"] == []
    for command in COMMANDS:
        assert command.name in result["help"]


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["status"], "status"),
        (["--log-level", "DEBUG", "scale", "decode", "2"], "scale"),
        (["--help"], None),
        ([], None),
    ],
)
def test_chosen_command(argv, command):
    assert chosen_command(argv) == command


def test_full_parser_declares_every_command():
    parser = build_parser()
    assert parser.parse_args(["scale", "decode", "2"]).num_workers == 2
    assert parser.parse_args(["scale", "decode", "2", "--model", "b"]).model == "b"
    assert parser.parse_args(["client", "hi"]).prompt == "hi"
