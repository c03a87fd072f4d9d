"""Flags declared once on config dataclasses, with env vars that never crash a start they do
not concern (engine.flags)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from engine.flags import EnvValueError, add_flags, flag, from_args, parse_flags


@dataclass(frozen=True, slots=True)
class Demo:
    port: int = flag(0, "port")
    ratio: float = flag(0.5, "ratio")
    verbose: bool = flag(False, "verbose")
    policy: str = flag("cost", "policy", choices=("cost", "random"))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="demo")
    add_flags(p, Demo)
    return p


def test_env_values_are_defaults(monkeypatch):
    for var, value in {"PORT": "7", "RATIO": "0.25", "VERBOSE": "yes", "POLICY": "random"}.items():
        monkeypatch.setenv(f"SPLITSERVE_{var}", value)
    assert from_args(Demo, parse_flags(parser(), [])) == Demo(7, 0.25, True, "random")


def test_a_flag_on_the_command_line_wins_over_an_unparsable_env_value(monkeypatch):
    """Kubernetes service links inject SPLITSERVE_PORT=tcp://... for a Service named
    splitserve; --port must still parse."""
    monkeypatch.setenv("SPLITSERVE_PORT", "tcp://10.96.0.12:50051")
    assert from_args(Demo, parse_flags(parser(), ["--port", "50051"])).port == 50051


@pytest.mark.parametrize(
    "var,value,expected",
    [
        ("SPLITSERVE_PORT", "tcp://10.96.0.12:50051", "expected an integer"),
        ("SPLITSERVE_RATIO", "half", "expected a number"),
        ("SPLITSERVE_VERBOSE", "maybe", "expected a boolean"),
        ("SPLITSERVE_POLICY", "fastest", "expected one of cost, random"),
    ],
)
def test_an_unparsable_env_value_is_one_line_naming_it(monkeypatch, capsys, var, value, expected):
    monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as exit_info:
        parse_flags(parser(), [])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"{var}={value!r}" in err and expected in err


def test_from_args_parses_env_defaults_too(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_RATIO", "half")
    args = parser().parse_args([])
    with pytest.raises(EnvValueError, match="SPLITSERVE_RATIO"):
        from_args(Demo, args)
