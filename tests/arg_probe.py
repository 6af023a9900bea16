"""A bad-argument probe over every option of every ``g4h`` command, generated from the argument parsers.

For each command of :data:`harness.cli.COMMANDS` its parser is built and every option and positional argument is
given bad values chosen by what the option declares (its ``type=``, an :class:`harness.cli._args.ArgType`, or its
``choices``), one at a time, on top of a cheap valid command line (:func:`bases`). A new option is covered without
editing this file; an option without a declared type is probed as text.

Values, per kind:

* ``int`` / ``float``: below the lower bound, above the upper bound, not a number, empty, NaN, Inf, beyond int64;
* ``device``: ``tpu``, ``cpu:99``, ``cuda:-1``, ``cuda:99``, and ``cuda`` where there is none;
* ``in_file`` / ``model``: a FIFO with no writer, ``/dev/zero``, a folder, a missing path, an empty string;
* ``out_file``: a folder, a path under a file, a FIFO with no reader, ``/dev/full``, ``/dev/null``;
* ``out_dir``: a file, ``/dev/null``, a path under a file;
* ``choices``: a value not among them; ``text``: empty, ``x``, a FIFO, ``/dev/zero``.

Each argv is parsed here first (argparse refuses most values, cheaply); an argv the parser accepts runs
``harness.cli.main`` in a forked child bounded in time, stdout and stderr captured. Outcomes: ``refused`` (exit 2,
one line), ``accepted`` (exit 0 or 1: the value was usable, or the base run's own verdict), and the failures
``traceback`` (any exception escaping, or an exit status other than 0/1/2), ``bad_message`` (exit 2 with other than
one line), ``hang`` (past the bound). Values that are bad by declaration (a number outside its range, a path
that is not a file) must be refused.

    python tests/arg_probe.py [--out probe.json]       # every command; prints the counts
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BYTES = [f"<0x{i:02X}>" for i in range(256)]
"""The byte tokens of a small vocabulary (``tests/test_tokenizer.py``)."""

RUN_TIMEOUT_S = 120.0
"""Bound of one command run (a hang is a failure); the base runs take well under it."""


@dataclass
class Probe:
    command: str
    option: str
    value: str
    bad: bool  # bad by declaration: must be refused
    outcome: str = ""
    detail: str = ""
    seconds: float = 0.0


# --------------------------------------------------------------------------- the files the bases and values need


def make_files(tmp: Path) -> dict[str, str]:
    """The cheap valid inputs of the bases, and the hostile paths of the values."""
    from conftest import write_tiny_gguf

    f: dict[str, str] = {}
    tiny = write_tiny_gguf(tmp / "tiny.gguf")
    f["tiny"] = str(tiny)
    (tmp / "p.json").write_text("[2, 5, 7]")
    f["prompt"] = str(tmp / "p.json")
    (tmp / "p.jsonl").write_text('{"id": "a", "prompt_ids": [2, 5, 7]}\n')
    f["prompts"] = str(tmp / "p.jsonl")
    (tmp / "t.txt").write_text("hello world\nsecond line\n")
    f["text"] = str(tmp / "t.txt")
    from gemma4_harness.harness.tokenizer.build import write_vocab_gguf

    f["tokenizer"] = str(write_vocab_gguf(tmp / "vocab.gguf", {  # a small vocabulary: loads in milliseconds
        "tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": ["a", "b", "ab"] + BYTES,
        "tokenizer.ggml.token_type": [1, 1, 1] + [6] * 256, "tokenizer.ggml.merges": ["a b"]}))
    import numpy as np

    np.save(tmp / "a.npy", np.zeros((3, 32)))
    f["npy"] = str(tmp / "a.npy")
    from gemma4_harness.harness.cli import main

    main(["trace", "--model", f["tiny"], "--prompt-ids", f["prompt"], "--out", str(tmp / "tr.jsonl")])
    f["trace"] = str(tmp / "tr.jsonl")
    os.mkfifo(tmp / "fifo")
    f["fifo"] = str(tmp / "fifo")
    (tmp / "folder").mkdir()
    f["folder"] = str(tmp / "folder")
    (tmp / "afile").write_text("x")
    f["afile"] = str(tmp / "afile")
    f["under_file"] = str(tmp / "afile" / "x")
    f["missing"] = str(tmp / "no-such-file")
    f["out"] = str(tmp / "outs")
    return f


def bases(f: dict[str, str]) -> dict[str, list[str]]:
    """A cheap, valid command line per command (or, for a command with no cheap run, one that ends at its first
    step: ``selftest --case`` of no case, ``device-bench --steps`` of no step, ``sweep`` of a glob that matches
    nothing, ``quantize`` to no known type). Outputs go under ``f['out']``."""
    o = f["out"]
    return {
        "logits": ["--model", f["tiny"], "--prompt-ids", f["prompt"], "--out", f"{o}/o.npy"],
        "generate": ["--model", f["tiny"], "--engine", "reference", "--prompts", f["prompts"], "--max-new-tokens",
                     "2", "--out", f"{o}/g.jsonl"],
        "trace": ["--model", f["tiny"], "--prompt-ids", f["prompt"], "--out", f"{o}/t.jsonl"],
        "diff": [f["trace"], f["trace"]],
        "parity": ["--model", f["tiny"], "--against", "fast", "--quiet", "--out", f"{o}/runs"],
        "selftest": ["--case", "no-such-case", "--quiet", "--out", f"{o}/runs"],
        "bench": ["--model", f["tiny"], "--engines", "reference", "--pp", "4", "--tg", "2", "--reps", "1", "--warmup",
                  "0", "--out", f"{o}/runs"],
        "compare": [f["npy"], f["npy"]],
        "tokenize": ["--tokenizer", f["tokenizer"], "--text-file", f["text"], "--out", f"{o}/tok.jsonl"],
        "tokcheck": ["--tokenizer", f["tokenizer"], "--against", "ours", "--corpus", f["text"]],
        "synth": ["--shape", "no-such-shape", "--out", f"{o}/s.gguf"],
        "device-check": ["--gguf", f["tiny"], "--out", f"{o}/dc.json", "--device", "cpu", "--prompts", "1"],
        "device-bench": ["--device", "cpu", "--smoke", "--steps", "no-such-step", "--out", f"{o}/runs"],
        "inspect": [f["tiny"]],
        "explain": ["--model", f["tiny"], "--engine", "reference", "--prompt-ids", f["prompt"]],
        "sweep": [f"{o}/no-such-model-*.gguf", "--quiet", "--out", f"{o}/runs"],  # ends before any cluster starts
        "quantize": [f["tiny"], "--types", "NO_SUCH_TYPE", "--out-dir", f"{o}/q"],  # ends before any build
    }


# --------------------------------------------------------------------------- values per declared kind


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def values_for(action: argparse.Action, f: dict[str, str]) -> list[tuple[str, bool]]:
    """``(value, bad by declaration)`` for one option."""
    t = action.type
    kind = getattr(t, "kind", None)
    if action.choices is not None and kind is None:
        return [("not-a-choice", True), ("", True)]
    if kind == "int":
        out = [("abc", True), ("1.5", True), ("", True), ("nan", True), (str(10**30), True)]
        if t.lo is not None:
            out.append((str(t.lo - 1), True))
        if t.hi < 2**63 - 1:
            out.append((str(t.hi + 1), True))
        return out
    if kind == "float":
        out = [("abc", True), ("", True), ("nan", True), ("inf", True), ("-inf", True), ("1e999", True)]
        if t.lo is not None:
            out.append((repr(t.lo) if t.lo_open else repr(t.lo - 1.0), True))
        if t.hi is not None:
            out.append((repr(t.hi * 10 + 1), True))
        return out
    if kind == "device":
        out = [("tpu", True), ("cpu:99", True), ("cuda:-1", True), ("", True), ("cuda:99", True)]
        if not _cuda():
            out.append(("cuda", True))
        return out
    if kind in ("in_file", "model"):
        streams = getattr(t, "streams", False)
        out = [(f["fifo"], not streams), ("/dev/zero", not streams), ("", True)]
        if not getattr(t, "folders", False):
            out.append((f["folder"], True))
        if kind == "in_file":
            out.append((f["missing"], True))
        return out
    if kind == "out_file":
        return [(f["folder"], True), (f["under_file"], True), (f["fifo"], False), ("/dev/full", False),
                ("/dev/null", False), ("", True)]
    if kind == "out_dir":
        return [(f["afile"], True), ("/dev/null", True), (f["under_file"], True), ("", True)]
    return [("", False), ("x", False), (f["fifo"], False), ("/dev/zero", False)]


def argv_with(base: list[str], action: argparse.Action, value: str) -> list[str]:
    """``base`` with ``action`` set to ``value``: an option replaced where the base has it, else appended; a
    positional replaced (its first occurrence among the base's positionals)."""
    argv = list(base)
    if action.option_strings:
        opt = action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
        names = set(action.option_strings)
        for i, a in enumerate(argv):
            if a in names:
                argv[i + 1] = value
                return argv
        return argv + [opt, value]
    positionals = [i for i, a in enumerate(argv) if not a.startswith("-") and (i == 0 or not argv[i - 1].startswith(
        "--") or argv[i - 1] in ("--quiet", "--smoke"))]
    index = {"a": 0, "b": 1, "ours": 0, "oracle": 1, "path": 0, "specs": 0}.get(action.dest, 0)
    if index < len(positionals):
        argv[positionals[index]] = value
        return argv
    return argv + [value]


def probes(f: dict[str, str], commands: list[str] | None = None) -> list[tuple[list[str], Probe]]:
    """Every (argv, probe) of every command's every option."""
    from gemma4_harness.harness.cli import COMMANDS, build_parser

    out = []
    b = bases(f)
    for cmd in commands or list(COMMANDS):
        parser = build_parser(cmd)
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[cmd]
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or action.nargs == 0:
                continue
            name = action.option_strings[-1] if action.option_strings else action.dest
            for value, bad in values_for(action, f):
                out.append(([cmd, *argv_with(b[cmd], action, value)], Probe(cmd, name, value, bad)))
    return out


# --------------------------------------------------------------------------- running one


def _parse_refusal(argv: list[str]) -> tuple[int, str] | None:
    """Parse ``argv`` here: ``(2, stderr)`` when argparse refuses it, None when it parses."""
    import contextlib
    import io

    from gemma4_harness.harness.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser(argv[0]).parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0), err.getvalue()
    return None


def _child(argv: list[str], err_path: str) -> None:  # pragma: no cover - in the forked child
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # stdout: the command's output, not judged
    os.dup2(os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - not a test runner's capture object: the fds
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    os.setpgid(0, 0)  # its own group: a hang is killed with everything it started
    rc = 1
    try:
        import torch

        torch.set_num_threads(1)
        from gemma4_harness.harness.cli import main

        rc = main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - the finding: shown as the interpreter would
        traceback.print_exc()
        rc = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(int(rc) if isinstance(rc, int) else 1)


def run_one(argv: list[str], probe: Probe, work: Path, timeout: float = RUN_TIMEOUT_S, run: bool = True) -> Probe:
    """Classify one argv (see the module docstring); ``run`` False: stop at the parser (outcome ``parsed`` when
    it accepts the value)."""
    t0 = time.perf_counter()
    parsed = _parse_refusal(argv)
    if parsed is None and not run:
        probe.outcome, probe.seconds = "parsed", time.perf_counter() - t0
        return probe
    if parsed is not None:
        rc, err = parsed
    else:
        out = work / "child.out"
        pid = os.fork()
        if pid == 0:
            _child(argv, str(out))
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                with_group = True
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    with_group = False
                if not with_group:
                    os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                probe.outcome, probe.detail = "hang", f"still running after {timeout:g} s"
                probe.seconds = time.perf_counter() - t0
                return probe
            time.sleep(0.02)
        rc = os.waitstatus_to_exitcode(status)
        err = out.read_text(errors="replace")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if "Traceback" in err or rc not in (0, 1, 2):
        probe.outcome = "traceback"
        probe.detail = f"exit {rc}: " + " | ".join(lines[-3:])[:300]
    elif rc == 2:  # one error line, the last; progress lines of a long command before it are fine, warnings not
        noisy = [ln for ln in lines[:-1] if "error" in ln.lower() or "warning" in ln.lower()]
        probe.outcome = "refused" if lines and " error: " in lines[-1] and not noisy else "bad_message"
        probe.detail = lines[-1][:300] if probe.outcome == "refused" else " | ".join(lines)[:300]
    else:
        probe.outcome = "accepted"
        probe.detail = f"exit {rc}" + (f": {lines[-1][:200]}" if lines else "")
    probe.seconds = time.perf_counter() - t0
    return probe


CHEAP = ("logits", "generate", "trace", "diff", "compare", "tokenize", "tokcheck", "inspect", "synth", "selftest",
         "device-bench")
"""Commands whose base run takes a fraction of a second (or ends at its first step): every value the parser accepts
is run in CI. The others (parity, bench, device-check) run them in the slow test and the script."""


def run_probe(commands: list[str] | None = None, work: Path | None = None, run: tuple[str, ...] | None = None
              ) -> list[Probe]:
    """Every probe of ``commands`` (default: all), in a scratch folder; ``run``: the commands whose accepted values
    are run (default: all), the others stop at the parser."""
    tmp = Path(work or tempfile.mkdtemp(prefix="g4h-argprobe-"))
    os.environ.setdefault("G4H_INPUT_TIMEOUT_S", "1")  # a FIFO with no writer: refused after 1 s, not 60
    f = make_files(tmp)
    Path(f["out"]).mkdir(exist_ok=True)
    return [run_one(argv, p, tmp, run=run is None or p.command in run) for argv, p in probes(f, commands)]


FAILURES = ("traceback", "bad_message", "hang")


def summary(results: list[Probe]) -> dict:
    """Counts per outcome and command, the failures, and the bad-by-declaration values that were accepted."""
    by_cmd: dict[str, Counter] = {}
    for p in results:
        by_cmd.setdefault(p.command, Counter())[p.outcome] += 1
    return {"probes": len(results), "options": len({(p.command, p.option) for p in results}),
            "outcomes": dict(Counter(p.outcome for p in results)),
            "by_command": {k: dict(v) for k, v in by_cmd.items()},
            "failures": [p.__dict__ for p in results if p.outcome in FAILURES],
            "bad_accepted": [p.__dict__ for p in results if p.bad and p.outcome == "accepted"],
            "seconds": round(sum(p.seconds for p in results), 1)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--command", action="append", default=None, help="only this command (repeatable)")
    ap.add_argument("--out", default=None, help="write every probe as JSON here")
    a = ap.parse_args()
    res = run_probe(a.command)
    s = summary(res)
    print(json.dumps({k: v for k, v in s.items()}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps([p.__dict__ for p in res], indent=1))
    sys.exit(1 if s["failures"] or s["bad_accepted"] or not math.isfinite(s["seconds"]) else 0)
