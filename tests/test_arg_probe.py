"""Every option of every ``g4h`` command, given bad values by what it declares (``tests/arg_probe.py``, generated
from the argument parsers: a new option is probed without editing a test): no traceback, no hang, one line; a value
bad by declaration (a number out of its range, NaN, a FIFO where a file is read) refused with exit 2."""

from __future__ import annotations

import argparse

import pytest
from arg_probe import CHEAP, FAILURES, run_probe, summary

from gemma4_harness.harness.cli import COMMANDS, build_parser


def _option_count() -> int:
    n = 0
    for cmd in COMMANDS:
        sub = next(a for a in build_parser(cmd)._actions if isinstance(a, argparse._SubParsersAction)).choices[cmd]
        n += sum(1 for a in sub._actions if not isinstance(a, argparse._HelpAction) and a.nargs != 0)
    return n


def _check(results) -> dict:
    s = summary(results)
    assert not s["failures"], s["failures"][:5]
    assert not s["bad_accepted"], s["bad_accepted"][:5]
    return s


def test_every_option_of_every_command(tmp_path, monkeypatch):
    """CI: every probe through the parser; the values it accepts run for the commands whose base run is cheap."""
    monkeypatch.setenv("G4H_INPUT_TIMEOUT_S", "1")
    results = run_probe(work=tmp_path, run=CHEAP)
    s = _check(results)
    assert s["options"] == _option_count()  # every option of every command was probed
    assert {p.command for p in results} == set(COMMANDS)
    assert s["outcomes"].get("refused", 0) > 0.8 * s["probes"]
    assert not set(s["outcomes"]) & set(FAILURES)


@pytest.mark.slow
def test_every_option_of_every_command_run(tmp_path, monkeypatch):
    """Every value the parser accepts is run, parity, bench and device-check included (minutes)."""
    monkeypatch.setenv("G4H_INPUT_TIMEOUT_S", "1")
    _check(run_probe(work=tmp_path))
