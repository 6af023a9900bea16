"""A pytest plugin (entry point ``pytest11``): ``g4h parity`` inside an engine's own test suite.

Installed with the package, so an engine's repository needs no conftest::

    pytest --g4h-model m.gguf --g4h-against 'cmd:./my-engine' [--junitxml out.xml]

runs ``g4h parity --model m.gguf --against 'cmd:./my-engine'`` once, at collection, and collects one test item
per parity check: ``g4h::<case>::<gate>[<prompt>]``. A check beyond its gate fails with the gate, the measured
value, the first divergence and the report in its message (and as JUnit properties, ``--junitxml``); a check the
user opted out of (``--g4h-skip``) is skipped; an informational check beyond its gate is an xfail with its reason;
a case that could not run is one failing item. The run directory goes under ``reports/`` of the current folder
(``--g4h-out``). Exit status: pytest's (0 pass, 1 a check failed), except 2 when ``g4h parity`` itself would exit
2 (bad input: the model, the prompts or an option cannot be used), with its one line.

Options (``pytest --help``, group ``g4h``): ``--g4h-model`` (repeatable), ``--g4h-against`` (repeatable or a comma
list: ``fast``, ``transformers``, ``llamacpp``, ``cmd:...``, ``openai:URL``), ``--g4h-prompts``, ``--g4h-oracle``,
``--g4h-skip`` (repeatable), ``--g4h-out``, and ``--g4h-args`` for any other ``g4h parity`` option, as on its
command line.

The fixture ``g4h_parity`` runs the job from inside a test (``g4h_parity(model=..., against=...)``, or with no
arguments the run of the command line) and returns a :class:`ParityRun`; ``run.assert_passed()`` fails the test
with the same messages. Runs are kept per argument list for the session.

Without ``--g4h-model`` the plugin adds its options and its fixture and nothing else: no item, no import beyond
the standard library and pytest (torch and numpy are imported only when a run is asked for, so that a suite that
sets thread variables before importing them, as this repository's does, is not affected). The job runs in the
pytest process, so the items are collected in one process: with pytest-xdist, pass ``-p no:xdist`` (or ``-n 0``)
with ``--g4h-model``.
"""

from __future__ import annotations

import contextlib
import io
import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

PREFIX = "g4h"
"""First part of every item's node id (``g4h::<case>::<gate>[...]``)."""


@dataclass(frozen=True)
class ParityCheck:
    """One check of a parity run, as ``results.json`` holds it.

    Attributes:
        case: the case (the model's file name on a user's model).
        gate: ``<pair>.<metric>`` (:data:`harness.core.gates.DEFAULT_GATES`).
        prompt: the prompt id, or None for a figure over several.
        measured, limit, op: the figure, its gate's limit and ``le`` / ``ge``.
        passed: within the gate; informational: reported, not gating (``reason`` says why).
        detail: every other field of the check (``first_divergence``, ``why``, ``qtype``, ``variant`` ...).
    """

    case: str
    gate: str
    prompt: Any
    measured: float
    limit: float | None
    op: str | None
    passed: bool
    informational: bool
    reason: str
    detail: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def opted_out(self) -> bool:
        """The user left the check out (``--skip``), or it is one a default run leaves out."""
        return str(self.detail.get("got", "")).replace("_", " ") == "opted out"

    @property
    def first_divergence(self) -> str | None:
        """Where the engine first leaves the oracle (a trace point ``point@layer``, ``logits@position N``, a
        stream step), when the check names it."""
        fd = self.detail.get("first_divergence")
        if isinstance(fd, dict):  # llama.cpp's trace comparison: {point, layer, rel_l2}
            return f"{fd.get('point')}@{fd.get('layer')}"
        return None if fd in (None, "") else str(fd)

    def label(self) -> str:
        """``<gate>[<prompt>/<qtype>/<variant>]``: the item's name within its case."""
        parts = [str(self.detail[k]) if k in self.detail else None for k in ("qtype", "variant")]
        parts = [str(self.prompt) if self.prompt not in (None, "") else None] + parts
        inside = "/".join(p for p in parts if p)
        return f"{self.gate}[{inside}]" if inside else self.gate

    def message(self, report: str | None = None) -> str:
        """The failure message: the check, its figure against its gate, the first divergence, the engine's reason
        and the report."""
        where = f"{self.case}: {self.gate}" + (f" on prompt {self.prompt}" if self.prompt not in (None, "") else "")
        op = "<=" if self.op == "le" else ">="
        lines = [f"g4h parity check failed: {where}",
                 f"  measured {_fmt(self.measured)}, gate {op} {_fmt(self.limit)}"]
        if self.first_divergence:
            lines.append(f"  first divergence: {self.first_divergence}")
        for key in ("why", "got"):
            value = self.detail.get(key)
            if isinstance(value, str) and value and value != self.first_divergence:
                lines.append(f"  {key}: {value}")
                break
        if report:
            lines.append(f"  report: {report}")
        return "\n".join(lines)


def _fmt(x: Any) -> str:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return f"{x:.6g}" if math.isfinite(x) else str(x)
    return str(x)


def _checks(results: dict[str, Any]) -> list[ParityCheck]:
    out = []
    for case in results.get("cases", []):
        for c in case.get("checks", []):
            known = {"gate", "prompt", "measured", "limit", "op", "pass", "informational", "reason"}
            measured = c.get("measured")
            out.append(ParityCheck(case=str(case["case"]), gate=str(c["gate"]), prompt=c.get("prompt"),
                                   measured=float(measured) if isinstance(measured, (int, float)) else math.nan,
                                   limit=c.get("limit"), op=c.get("op"), passed=bool(c.get("pass")),
                                   informational=bool(c.get("informational")), reason=str(c.get("reason") or ""),
                                   detail={k: v for k, v in c.items() if k not in known}))
    return out


@dataclass
class ParityRun:
    """A finished ``g4h parity`` run.

    Attributes:
        argv: the ``g4h parity`` arguments it ran with.
        results: ``results.json`` as a dict; status: the exit status ``g4h parity`` gives (0, 1 or 2);
        verdict: its one-line verdict; report: the run's ``report.md``.
    """

    argv: list[str]
    results: dict[str, Any]
    status: int
    verdict: str
    report: Path

    @property
    def checks(self) -> list[ParityCheck]:
        """Every check, in report order."""
        return _checks(self.results)

    @property
    def case_errors(self) -> dict[str, str]:
        """Cases that could not run: case -> its one-line error."""
        return {c["case"]: c["error"] for c in self.results.get("cases", []) if c.get("error")}

    @property
    def failures(self) -> list[ParityCheck]:
        """The gating checks beyond their gate (the ones that make the run fail)."""
        return [c for c in self.checks if not c.passed and not c.informational]

    @property
    def passed(self) -> bool:
        """Exit status 0: every gate passed, every case ran."""
        return self.status == 0

    def check(self, gate: str, prompt: Any = None, case: str | None = None) -> ParityCheck:
        """The one check of ``gate`` (on ``prompt``, in ``case``).

        Raises:
            LookupError: none, or more than one, matches.
        """
        found = [c for c in self.checks if c.gate == gate and (prompt is None or c.prompt == prompt)
                 and (case is None or c.case == case)]
        if len(found) != 1:
            raise LookupError(f"{len(found)} checks of gate {gate!r}" + (f" on prompt {prompt!r}" if prompt else ""))
        return found[0]

    def assert_passed(self) -> None:
        """Raise AssertionError with the verdict and every failure's message unless the run passed."""
        if self.passed:
            return
        parts = [f"g4h parity: {self.verdict} (exit {self.status})"]
        parts += [f"{case}: could not run: {err}" for case, err in self.case_errors.items()]
        parts += [c.message() for c in self.failures]
        parts.append(f"report: {self.report}")
        raise AssertionError("\n".join(parts))


class G4HBadInput(Exception):
    """``g4h parity`` refused its input before any case ran (one line, as ``g4h: error: ...``)."""


def run_parity(argv: list[str]) -> ParityRun:
    """Run ``g4h parity ARGV`` in this process and return the run.

    Raises:
        G4HBadInput: an option or an input it refuses before running (exit 2 of ``g4h parity``), one line.
    """
    from harness.cli import _quiet_libraries, build_parser  # lazy: torch and numpy only when a run is asked for
    from harness.cli.parity import execute  # lazy (as above)
    from harness.core.workers import EngineCrashed  # lazy (as above)
    from reference.errors import InputError  # lazy (as above)

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = build_parser("parity").parse_args(["parity", *argv])
    except SystemExit:
        line = next((ln for ln in reversed(err.getvalue().splitlines()) if ln.strip()), "invalid options")
        raise G4HBadInput(f"g4h parity {shlex.join(argv)}: {line.split('error: ', 1)[-1]}") from None
    _quiet_libraries()
    try:
        results, status = execute(args)
    except (InputError, EngineCrashed) as e:
        raise G4HBadInput(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    return ParityRun(argv=list(argv), results=results, status=status, verdict=results["verdict"],
                     report=Path(results["run_dir"]) / "report.md")


def _argv(model: str | list[str] | None = None, against: str | list[str] | None = None, prompts: str | None = None,
          oracle: str | None = None, skip: list[str] | tuple[str, ...] = (), out: str | None = None,
          args: str | list[str] = ()) -> list[str]:
    """``g4h parity`` arguments from the plugin's options (or the fixture's keywords)."""
    argv: list[str] = []
    for m in [model] if isinstance(model, (str, Path)) else (model or []):
        argv += ["--model", str(m)]
    for a in [against] if isinstance(against, str) else (against or []):
        argv += ["--against", a]
    if prompts:
        argv += ["--prompts", str(prompts)]
    if oracle:
        argv += ["--oracle", oracle]
    for s in skip:
        argv += ["--skip", s]
    if out:
        argv += ["--out", str(out)]
    argv += shlex.split(args) if isinstance(args, str) else list(args)
    return argv


# --------------------------------------------------------------------------- pytest hooks


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("g4h", "gemma4-harness: g4h parity checks as test items")
    g.addoption("--g4h-model", action="append", default=[], metavar="PATH",
                help="a model (.gguf or HF folder) to run g4h parity on; one test item per check (repeatable)")
    g.addoption("--g4h-against", action="append", default=[], metavar="ENGINE[,ENGINE...]",
                help="the engines compared with the reference: fast, transformers, llamacpp, cmd:'COMMAND ...', "
                     "openai:URL (repeatable or a comma list; default: every engine that can read the model)")
    g.addoption("--g4h-prompts", default=None, metavar="FILE.jsonl", help="the prompt set (g4h parity --prompts)")
    g.addoption("--g4h-oracle", default=None, choices=("reference", "fast"),
                help="the oracle side of every pair (g4h parity --oracle; default reference)")
    g.addoption("--g4h-skip", action="append", default=[], metavar="CHECK",
                help="opt a check out (g4h parity --skip; repeatable): its items are skipped")
    g.addoption("--g4h-out", default=None, metavar="DIR",
                help="parent folder of the run directory (default reports/ under the current folder)")
    g.addoption("--g4h-args", default="", metavar="'OPTIONS'",
                help="any other g4h parity options, as on its command line (e.g. '--max-new-tokens 16 --layers 4')")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "g4h: a g4h parity check collected by the gemma4-harness plugin")
    config._g4h_runs = {}  # type: ignore[attr-defined]  # argv tuple -> ParityRun, for the session
    config._g4h_status = None  # type: ignore[attr-defined]


def _command_line_argv(config: pytest.Config) -> list[str] | None:
    models = config.getoption("g4h_model")
    if not models:
        return None
    return _argv(models, config.getoption("g4h_against"), config.getoption("g4h_prompts"),
                 config.getoption("g4h_oracle"), config.getoption("g4h_skip"), config.getoption("g4h_out"),
                 config.getoption("g4h_args"))


def _cached_run(config: pytest.Config, argv: list[str]) -> ParityRun:
    runs = config._g4h_runs  # type: ignore[attr-defined]
    if tuple(argv) not in runs:
        runs[tuple(argv)] = run_parity(argv)
    return runs[tuple(argv)]


class ParityCheckFailed(Exception):
    """A gating parity check beyond its gate (the message is :meth:`ParityCheck.message`)."""


class ParityItem(pytest.Item):
    """One check of the command line's parity run (or a case that could not run, ``check`` None)."""

    def __init__(self, *, check: ParityCheck | None, case: str, error: str | None, report: Path, **kw: Any) -> None:
        super().__init__(**kw)
        self.check, self.case, self.error, self.report = check, case, error, report
        self.add_marker("g4h")
        if check is not None:
            props = [("case", case), ("gate", check.gate), ("prompt", check.prompt),
                     ("measured", _fmt(check.measured)), ("limit", _fmt(check.limit)), ("op", check.op),
                     ("first_divergence", check.first_divergence), ("report", str(report))]
            self.user_properties += [(k, str(v)) for k, v in props if v not in (None, "")]
        else:
            self.user_properties += [("case", case), ("error", error or ""), ("report", str(report))]

    def runtest(self) -> None:
        c = self.check
        if c is None:
            raise ParityCheckFailed(f"g4h parity: {self.case} could not run: {self.error}\n  report: {self.report}")
        if c.opted_out:
            pytest.skip(f"{c.gate}: opted out ({c.reason or c.detail.get('got')})")
        if c.informational:
            if not c.passed:
                pytest.xfail(f"not gating: {c.reason}")
            return
        if not c.passed:
            raise ParityCheckFailed(c.message(str(self.report)))

    def repr_failure(self, excinfo, style=None):  # noqa: ANN001 - pytest's signature
        if isinstance(excinfo.value, ParityCheckFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.path, None, f"{PREFIX} {self.case} {self.check.label() if self.check else '(case)'}"


def _items(session: pytest.Session, run: ParityRun) -> list[ParityItem]:
    """One item per check, and one per case that could not run; node ids made unique by a ``#N`` suffix."""
    items, seen = [], {}
    errors = run.case_errors
    by_case: dict[str, list[ParityCheck]] = {}
    for c in run.checks:
        by_case.setdefault(c.case, []).append(c)
    for case in [c["case"] for c in run.results.get("cases", [])]:
        entries: list[tuple[str, ParityCheck | None]] = [("(case could not run)", None)] if case in errors else []
        entries += [(c.label(), c) for c in by_case.get(case, [])]
        for label, check in entries:
            name = f"{case}::{label}"
            seen[name] = seen.get(name, 0) + 1
            if seen[name] > 1:
                name += f"#{seen[name]}"
            items.append(ParityItem.from_parent(session, name=name, nodeid=f"{PREFIX}::{name}", check=check,
                                                case=case, error=errors.get(case), report=run.report))
    return items


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ``--g4h-model``: run the job once and put its items first (before ``-k`` / ``-m`` select)."""
    argv = _command_line_argv(config)
    if argv is None:
        return
    if hasattr(config, "workerinput"):
        pytest.exit("g4h: error: --g4h-model runs g4h parity once, in one process: add -p no:xdist (or -n 0)", 2)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"g4h: running g4h parity {shlex.join(argv)}")
    try:
        run = _cached_run(config, argv)
    except G4HBadInput as e:
        # a collection error: pytest names it ("ERROR collecting g4h") and stops with exit 2, as g4h would
        config.hook.pytest_collectreport(report=pytest.CollectReport(PREFIX, "failed", f"g4h: error: {e}", []))
        return
    config._g4h_status = run.status  # type: ignore[attr-defined]
    new = _items(session, run)
    config.hook.pytest_collectreport(report=pytest.CollectReport(PREFIX, "passed", None, new))  # counted
    items[:0] = new


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # noqa: ANN001
    for run in config._g4h_runs.values():  # type: ignore[attr-defined]
        terminalreporter.write_sep("-", "g4h parity")
        terminalreporter.write_line(f"g4h parity {shlex.join(run.argv)}")
        terminalreporter.write_line(f"{run.verdict} (exit {run.status})")
        terminalreporter.write_line(f"report: {run.report}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Exit 2 when the command line's run had bad input (a case that could not be read), as ``g4h parity``."""
    if getattr(session.config, "_g4h_status", None) == 2 and session.exitstatus in (0, 1):
        session.exitstatus = 2


@pytest.fixture(scope="session")
def g4h_parity(pytestconfig: pytest.Config) -> Callable[..., ParityRun]:
    """Run ``g4h parity`` from a test and get the :class:`ParityRun` (kept for the session per argument list).

    ``g4h_parity()`` is the command line's run (``--g4h-model`` ...); ``g4h_parity(model=..., against=...,
    prompts=..., oracle=..., skip=[...], out=..., args="...")`` runs another (``out`` defaults to ``--g4h-out``).
    Bad input fails the test with its one line.
    """

    def run(model: str | list[str] | None = None, against: str | list[str] | None = None,
            prompts: str | None = None, oracle: str | None = None, skip: list[str] | tuple[str, ...] = (),
            out: str | None = None, args: str | list[str] = ()) -> ParityRun:
        if model is None:
            argv = _command_line_argv(pytestconfig)
            if argv is None:
                pytest.fail("g4h_parity(): no model given and no --g4h-model on the command line", pytrace=False)
        else:
            argv = _argv(model, against, prompts, oracle, skip, out or pytestconfig.getoption("g4h_out"), args)
        try:
            return _cached_run(pytestconfig, argv)
        except G4HBadInput as e:
            pytest.fail(f"g4h: error: {e}", pytrace=False)

    return run
