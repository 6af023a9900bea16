"""The progress display of long work (:mod:`harness.core.progress`, issue 36 item 5): counts and the time left on
stderr, plain lines when it is not a terminal, a live line when it is, nothing with ``--quiet``, and nothing of it
in the results."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gemma4_harness.harness.core import progress
from gemma4_harness.harness.core.progress import Display, activate, counter, duration, eta


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_time_left_is_the_linear_extrapolation():
    assert eta(10.0, 2, 6) == "20s" and eta(30.0, 1, 5) == "2m00s" and eta(3600.0, 1, 3) == "2h00m"
    assert eta(5.0, 0, 4) is None and duration(59.4) == "59s" and duration(61) == "1m01s"


def test_plain_lines_are_rate_limited_and_carry_counts_and_the_time_left(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    d = Display("g4h parity", stream=out)
    assert d.every == progress.PLAIN_EVERY_S
    d("loading")
    with d.counter("reference pass 1: layer", 10) as c:
        for _ in range(10):
            clock[0] += 1.0  # one second a layer: a line at the 5th and the 10th
            c.step()
    lines = out.getvalue().splitlines()
    assert lines[0] == "g4h parity: loading"
    assert lines[1] == "g4h parity: reference pass 1: layer 5/10, 5s, about 5s left", lines
    assert lines[2:] == ["g4h parity: reference pass 1: layer 10/10, 10s"], lines
    cut = io.StringIO()
    with Display("g4h parity", stream=cut).counter("layer", 10) as c:
        clock[0] += 6.0
        c.step(7)
        c.step(2)  # the end said once, the phase stopped short of its total
    assert cut.getvalue().splitlines() == ["g4h parity: layer 7/10, 6s, about 3s left", "g4h parity: layer 9/10, 6s, about 1s left"]
    short = io.StringIO()
    with Display("g4h parity", stream=short).counter("fast", 3) as c:
        c.step(3)  # no time passed: a phase shorter than the interval prints nothing
    assert short.getvalue() == ""


def test_nested_counters_show_the_outer_phase_with_the_inner_ones_share(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    monkeypatch.setenv(progress.EVERY_ENV, "0")
    out = io.StringIO()
    with activate(Display("g4h parity", stream=out)), counter("reference greedy steps", 4) as steps:
        with counter("layer", 2) as layers:
            clock[0] += 3.0
            layers.step()  # half of step 1 in 3 s: 8 steps of 3 s, 21 s left of the 24 s
    assert "reference greedy steps 0/4, 3s, about 21s left | layer 1/2, 3s, about 3s left" in out.getvalue()
    assert steps.display is not None and counter("x", 1).display is None  # none active: nothing shown


def test_a_terminal_gets_one_live_line_redrawn_in_place(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    tty = _Tty()
    d = Display("g4h parity", stream=tty)
    with d.counter("openai requests", 4) as c:
        for _ in range(4):
            clock[0] += 1.0
            c.step()
        d("a phase line")
    text = tty.getvalue()
    assert "\n" not in text.replace("g4h parity: a phase line\n", "")  # only the phase line ends a line
    assert "\rg4h parity: openai requests 3/4, 3s, about 1s left" in text.replace(" " * 60, "")
    assert text.endswith("\r")  # the live line cleared at the end


def test_quiet_shows_nothing_and_a_worker_copy_draws_plain_lines(monkeypatch):
    monkeypatch.setenv(progress.EVERY_ENV, "0")
    out = io.StringIO()
    q = Display("g4h parity", quiet=True, stream=out)
    q("hello")
    with q.counter("layer", 3) as c:
        c.step(3)
    assert out.getvalue() == ""
    copy = pickle.loads(pickle.dumps(Display("g4h parity", live=True, stream=None)))
    assert copy.live is False and copy.stream is None


def _parity(tmp: Path, model: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp / f"out{len(list(tmp.glob('out*')))}"
    env = {**os.environ, progress.EVERY_ENV: "0"}
    proc = subprocess.run([sys.executable, "-m", "gemma4_harness.harness.cli", "parity", "--model", str(model), "--against",
                           "fast", "--max-new-tokens", "3", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=900, env=env)
    return proc, json.loads(next(out.glob("*/results.json")).read_text())


@pytest.mark.slow
def test_parity_shows_progress_in_a_log_and_none_with_quiet_and_the_results_do_not_change(tmp_path):
    from gemma4_harness.harness import synth
    from gemma4_harness.harness.core.cases import MODELS_DIR
    from gemma4_harness.harness.parity.baseline import strip_volatile

    gguf = synth.ensure_built(MODELS_DIR / "e2b.toml").gguf["F32"]
    shown, with_display = _parity(tmp_path, gguf)
    quiet, without = _parity(tmp_path, gguf, "--quiet")
    assert shown.returncode == quiet.returncode == 0, shown.stdout[-1500:] + shown.stderr[-1500:]
    n = with_display["cases"][0]["info"]["config"]["n_layer"]
    layer_lines = re.findall(r"^g4h parity: reference pass 1: layer (\d+)/(\d+), \d+s(, about \d+s left)?$",
                             shown.stderr, re.M)
    assert layer_lines and all(int(a) <= int(b) for a, b, _ in layer_lines), shown.stderr[-3000:]
    assert any(left for _, _, left in layer_lines)
    assert int(layer_lines[0][1]) == n
    assert re.search(r"^g4h parity: reference greedy steps \d+/2, .*\| layer \d+/\d+", shown.stderr, re.M)
    assert "g4h parity:" not in quiet.stderr, quiet.stderr[-1500:]
    assert "g4h parity:" not in json.dumps(with_display)  # nothing of the display in the results
    assert strip_volatile(with_display) == strip_volatile(without)
