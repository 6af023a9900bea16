"""A pytest plugin (entry point ``pytest11``): ``g4h parity`` inside an engine's own test suite.

Installed with the package, so an engine's repository needs no conftest::

    pytest --g4h-model m.gguf --g4h-against 'cmd:./my-engine' [--junitxml out.xml]

collects one test item per engine pair of ``g4h parity --model m.gguf --against 'cmd:./my-engine'``
(``m.gguf::reference~cmd``) and, with the reference oracle, one for its cached-vs-uncached check
(``m.gguf::reference.cached~uncached``): the model is a collector (:class:`ModelFile`) whose items follow from the
options (:func:`plan_job`), before any engine runs, so ``--collect-only`` runs nothing and ``-k``, node ids and
``--lf`` select items. The job runs once, at the first selected item's setup, for the selected items only
(:func:`narrow`), and is kept on ``config.stash``. An item fails naming each of its checks beyond its gate (the
gate, the measured value, the first divergence) and the report (in its message and as JUnit properties,
``--junitxml``), or its engine's failure (the request and the step), or why its case could not run; an item whose
pair the user opted out of (``--g4h-skip``) is skipped. The run directory goes under ``reports/`` of the current
folder (``--g4h-out``). Exit status: pytest's (0 pass, 1 an item failed: a gate, an engine that crashed or broke
the protocol), and 2 for bad input, as ``g4h parity``: the options, the models, the engine names or the prompts,
checked before collection (one line, ``pytest.exit``), or a model or server the job could not use.

Options (``pytest --help``, group ``g4h``): ``--g4h-model`` (repeatable), ``--g4h-against`` (repeatable or a comma
list: ``fast``, ``transformers``, ``llamacpp``, ``cmd:...``, ``openai:URL``), ``--g4h-prompts``, ``--g4h-oracle``,
``--g4h-skip`` (repeatable), ``--g4h-out``, and ``--g4h-args`` for any other ``g4h parity`` option, as on its
command line.

The fixture ``g4h_parity`` runs the job from inside a test (``g4h_parity(model=..., against=...)``, or with no
arguments the run of the command line) and returns a :class:`ParityRun`; ``run.assert_passed()`` fails the test
with the same messages. Runs are kept per argument list for the session.

Without ``--g4h-model`` the plugin adds its options and its fixture and nothing else: no item, no import beyond
the standard library and pytest (torch and numpy are imported only when a run is asked for, so that a suite that
sets thread variables before importing them, as this repository's does, is not affected). Under pytest-xdist a
model's items run on one worker (:class:`_XdistController`), so the job runs once.
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
"""First word of every item's report line (``g4h <case> <pair>``)."""


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


class G4HEngineCrashed(Exception):
    """The job stopped in an engine (a worker process that died): one line naming where."""


def parse_argv(argv: list[str]) -> Any:
    """``g4h parity ARGV`` parsed (an ``argparse.Namespace``), its one-line error as :class:`G4HBadInput`."""
    from gemma4_harness.harness.cli import build_parser  # lazy: torch and numpy only when a run is asked for

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser("parity").parse_args(["parity", *argv])
    except SystemExit:
        line = next((ln for ln in reversed(err.getvalue().splitlines()) if ln.strip()), "invalid options")
        raise G4HBadInput(f"g4h parity {shlex.join(argv)}: {line.split('error: ', 1)[-1]}") from None


def run_parity(argv: list[str]) -> ParityRun:
    """Run ``g4h parity ARGV`` in this process and return the run.

    Raises:
        G4HBadInput: an option or an input it refuses before running (exit 2 of ``g4h parity``), one line.
        G4HEngineCrashed: the job itself stopped in an engine (exit 1 of ``g4h parity``), one line.
    """
    from gemma4_harness.harness.cli import _quiet_libraries  # lazy (as above)
    from gemma4_harness.harness.cli.parity import execute  # lazy (as above)
    from gemma4_harness.harness.core.workers import EngineCrashed  # lazy (as above)
    from gemma4_harness.reference.errors import InputError  # lazy (as above)

    args = parse_argv(argv)
    _quiet_libraries()
    try:
        results, status = execute(args)
    except InputError as e:
        raise G4HBadInput(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    except EngineCrashed as e:
        raise G4HEngineCrashed(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
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


# --------------------------------------------------------------------------- the plan: items before any run

CACHED = "reference.cached~uncached"
"""The item of the reference's own cached-vs-uncached check (a ``--oracle reference`` run)."""


@dataclass(frozen=True)
class PlannedItem:
    """One item the command line's job will give a verdict on, known before any engine runs.

    Attributes:
        model_index, model: the ``--model``'s place and path as given; case: its case name in the job
            (:func:`harness.parity.cases.case_names`).
        name: ``<oracle>~<kind>`` (``#N`` for the Nth engine of a kind), or :data:`CACHED`.
        engine: the ``--against`` engine of the pair (None for :data:`CACHED`); number: its place among the
            engines of its kind (``engine_number`` of its checks).
    """

    model_index: int
    model: str
    case: str
    name: str
    engine: str | None
    number: int = 1


@dataclass
class Plan:
    """The command line's job: its arguments and the items it will give (:func:`plan_job`).

    Attributes:
        argv: the ``g4h parity`` arguments; base: the same without ``--model`` / ``--against`` (None when
            ``--g4h-args`` names those, so that the run cannot be narrowed to the selected items);
        models: the ``--model`` paths; against: the ``--against`` engines (None: each model's default);
        oracle: ``reference`` or ``fast``; items: in job order.
    """

    argv: list[str]
    base: list[str] | None
    models: list[str]
    against: list[str] | None
    oracle: str
    items: list[PlannedItem]


def _planned_pairs(names: list[str], oracle: str) -> list[tuple[str, str, int]]:
    """``(item name, engine, number)`` of each engine of ``names``, numbered per kind as the job numbers them
    (:func:`harness.parity.checks.pair.pair_checks`)."""
    from gemma4_harness.harness.engines import engine_kind  # lazy (as above)

    out, seen = [], {}
    for name in names:
        kind = engine_kind(name)
        seen[kind] = seen.get(kind, 0) + 1
        n = seen[kind]
        out.append((f"{oracle}~{kind}" + (f"#{n}" if n > 1 else ""), name, n))
    return out


def plan_job(config: pytest.Config) -> Plan | None:
    """The command line's job (None without ``--g4h-model``), checked as ``g4h parity`` checks it before any work:
    its options, the models, the engine names, ``--skip``, ``--oracle`` and the prompt set. Imports the harness,
    runs nothing.

    Raises:
        G4HBadInput: bad input, one line.
    """
    argv = _command_line_argv(config)
    if argv is None:
        return None
    from gemma4_harness.harness.core.cases import PROMPTS  # lazy (as above)
    from gemma4_harness.harness.core.prompts import load_prompts  # lazy (as above)
    from gemma4_harness.harness.engines import check_engine_name, split_engines  # lazy (as above)
    from gemma4_harness.harness.parity.cases import case_names, default_against  # lazy (as above)
    from gemma4_harness.harness.parity.job import check_oracle  # lazy (as above)
    from gemma4_harness.harness.parity.skips import check_skip  # lazy (as above)
    from gemma4_harness.reference.errors import InputError  # lazy (as above)

    args = parse_argv(argv)
    try:
        for m in args.model:
            if not Path(m).exists():
                raise InputError(f"--g4h-model {m}: no such file or folder (a .gguf file or an HF model folder)")
        against = [n for text in args.against for n in split_engines(text)] if args.against else None
        for name in against or ():
            try:
                check_engine_name(name)
            except InputError as e:
                raise InputError(f"--g4h-against: {e}") from None
        check_skip(tuple(args.skip))
        check_oracle(args.oracle, args.model, against)
        load_prompts(args.prompts or PROMPTS)
    except InputError as e:
        raise G4HBadInput(str(e).splitlines()[0]) from None
    extra = shlex.split(config.getoption("g4h_args") or "")
    narrowable = not any(t.startswith(("--model", "--against")) for t in extra)
    base = _argv(None, None, config.getoption("g4h_prompts"), config.getoption("g4h_oracle"),
                 config.getoption("g4h_skip"), config.getoption("g4h_out"), extra) if narrowable else None
    items = []
    for i, (model, case) in enumerate(zip(args.model, case_names(args.model))):
        for name, engine, n in _planned_pairs(against or default_against(model, args.oracle), args.oracle):
            items.append(PlannedItem(i, model, case, name, engine, n))
        if args.oracle == "reference":
            items.append(PlannedItem(i, model, case, CACHED, None))
    return Plan(argv=argv, base=base, models=list(args.model), against=against, oracle=args.oracle, items=items)


@dataclass
class Narrowed:
    """The job run for some of the plan's items: its arguments and how its cases and pairs map to the plan's."""

    argv: list[str]
    cases: dict[str, str]  # the run's case name -> the plan's
    engines: dict[tuple[str, int], int]  # (engine, the run's number) -> the plan's number


def narrow(plan: Plan, selected: list[PlannedItem]) -> Narrowed:
    """The arguments that run only what ``selected`` needs: its models and, when every selected model has the
    same engines, its engines (all of them when only :data:`CACHED` items are selected)."""
    from gemma4_harness.harness.parity.cases import case_names, default_against  # lazy (as above)

    identity = Narrowed(plan.argv, {it.case: it.case for it in plan.items},
                        {(it.engine, it.number): it.number for it in plan.items if it.engine})
    if plan.base is None or {(it.model_index, it.name) for it in selected} == \
            {(it.model_index, it.name) for it in plan.items}:
        return identity
    indices = sorted({it.model_index for it in selected})
    models = [plan.models[i] for i in indices]
    lists = {tuple(plan.against or default_against(m, plan.oracle)) for m in models}
    wanted = {(it.engine, it.number) for it in selected if it.engine}
    engines, engine_map = None, identity.engines
    if len(lists) == 1 and wanted:
        sel = [(name, n) for _, name, n in _planned_pairs(list(next(iter(lists))), plan.oracle) if (name, n) in wanted]
        engines = [name for name, _ in sel]
        engine_map = {(name, new_n): orig_n for (_, name, new_n), (_, orig_n) in
                      zip(_planned_pairs(engines, plan.oracle), sel)}
    argv = _argv(models, engines if engines is not None else plan.against, args=plan.base)
    by_case = {it.model_index: it.case for it in plan.items}
    return Narrowed(argv, dict(zip(case_names(models), (by_case[i] for i in indices))), engine_map)


# --------------------------------------------------------------------------- pytest hooks

PLAN = pytest.StashKey["Plan | None"]()
RUNS = pytest.StashKey["dict[tuple[str, ...], ParityRun | Exception]"]()
SELECTED = pytest.StashKey["list[PlannedItem]"]()
BAD_INPUT = pytest.StashKey[bool]()
XDIST_GROUP = "g4h"
"""The ``xdist_group`` of every item: under pytest-xdist they run on one worker, so the job runs once
(:class:`_XdistController`)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("g4h", "gemma4-harness: g4h parity checks as test items")
    g.addoption("--g4h-model", action="append", default=[], metavar="PATH",
                help="a model (.gguf or HF folder) to run g4h parity on; one test item per engine (repeatable)")
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


class _Outcomes:
    """Sees every test report (on the xdist controller too): a bad-input run makes the exit status 2."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if ("g4h_status", "2") in report.user_properties:
            self.config.stash[BAD_INPUT] = True


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "g4h: a g4h parity check collected by the gemma4-harness plugin")
    config.stash[RUNS] = {}
    config.stash[BAD_INPUT] = False
    config.stash[PLAN] = None
    if not config.getoption("g4h_model") or config.getoption("help", False):
        return
    try:
        config.stash[PLAN] = plan_job(config)
    except G4HBadInput as e:
        pytest.exit(f"g4h: error: {e}", returncode=2)
    config.pluginmanager.register(_Outcomes(config), "g4h-outcomes")
    if not config.pluginmanager.hasplugin("xdist"):  # the mark each item carries, known without xdist too
        config.addinivalue_line("markers", "xdist_group(name): pytest-xdist's group (--dist loadgroup)")
    if not hasattr(config, "workerinput") and config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistController(), "g4h-xdist")


class _XdistController:
    """pytest-xdist's hook on the controller (registered only with xdist, whose hook it is): with ``--dist load``,
    ``loadgroup`` or ``worksteal`` (``-n N`` alone is ``load``), the scheduler keeps every item of a ``--g4h-model``
    on one worker, as one unit, so the job runs once; the other tests are spread as ``load`` spreads them (and an
    ``xdist_group`` kept together, as ``loadgroup`` does). Other modes already keep a file's items together
    (``loadfile``, ``loadscope``) or run everything everywhere (``each``).

    The grouping is by node id, not by xdist's own ``xdist_group`` suffix: pytest-xdist 3.8 writes that suffix
    to ``item._nodeid``, which pytest 9.2 no longer reads."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        if config.getvalue("dist") not in ("load", "loadgroup", "worksteal") or config.stash[PLAN] is None:
            return None
        from xdist.scheduler import LoadScopeScheduling  # only under pytest-xdist

        models, root = set(_model_paths(config)), config.rootpath

        class G4HGroupScheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                if (root / nodeid.split("::", 1)[0]).resolve() in models:
                    return XDIST_GROUP
                if nodeid.rfind("@") > nodeid.rfind("]"):  # xdist's loadgroup suffix, where pytest keeps it
                    return nodeid.split("@")[-1]
                return nodeid

        return G4HGroupScheduling(config, log)


def _model_paths(config: pytest.Config) -> dict[Path, list[int]]:
    plan = config.stash.get(PLAN, None)
    out: dict[Path, list[int]] = {}
    for i, m in enumerate(plan.models if plan else ()):
        out.setdefault(Path(m).resolve(), []).append(i)
    return out


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session: pytest.Session) -> None:
    """With ``--g4h-model``: collect each model too, unless an argument already names it (``m.gguf``,
    ``m.gguf::reference~fast``) or a folder above it."""
    config = session.config
    here = config.invocation_params.dir
    for path in _model_paths(config):
        named = [(here / str(a).split("::", 1)[0]).resolve() for a in config.args]
        if not any(p == path or p in path.parents for p in named):
            config.args.append(str(path))


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if file_path.resolve() in _model_paths(parent.config):
        return ModelFile.from_parent(parent, path=file_path)
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collect_directory(path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if path.resolve() in _model_paths(parent.config):  # an HF model folder
        return ModelFile.from_parent(parent, path=path)
    return None


class ModelFile(pytest.File):
    """A ``--g4h-model`` (a GGUF file or an HF folder): one item per engine pair of the job, and one for the
    reference's own cached-vs-uncached check; nothing runs at collection."""

    def collect(self):  # noqa: ANN201 - pytest's signature
        plan = self.config.stash[PLAN]
        indices = _model_paths(self.config)[self.path.resolve()]
        for it in plan.items:
            if it.model_index in indices:
                name = it.name if len(indices) == 1 else f"{it.name}[{it.case}]"
                yield ParityItem.from_parent(self, name=name, planned=it)


class ParityCheckFailed(Exception):
    """A pair with gating checks beyond their gates, an engine that failed, or a job that could not run."""


def _run_for(config: pytest.Config) -> tuple[ParityRun | Exception, Narrowed | None]:
    """The job for the selected items, run once per session (at the first item's setup)."""
    plan = config.stash[PLAN]
    selected = config.stash.get(SELECTED, None) or plan.items
    try:
        narrowed = narrow(plan, selected)
    except Exception as e:  # noqa: BLE001 - reported by the item
        return e, None
    runs = config.stash[RUNS]
    key = tuple(narrowed.argv)
    if key not in runs:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None and not hasattr(config, "workerinput"):
            reporter.write_line(f"\ng4h: running g4h parity {shlex.join(narrowed.argv)}")
        try:
            runs[key] = run_parity(narrowed.argv)
        except (G4HBadInput, G4HEngineCrashed) as e:
            runs[key] = e
    return runs[key], narrowed


class ParityItem(pytest.Item):
    """One engine pair of the command line's job (or :data:`CACHED`): passes when every gating check of the pair
    is within its gate; fails naming each check beyond it (gate, figure, first divergence), the engine failure
    (request and step), or why the case could not run; skipped when the user opted the pair out."""

    def __init__(self, *, planned: PlannedItem, **kw: Any) -> None:
        super().__init__(**kw)
        self.planned = planned
        self.checks: list[ParityCheck] = []
        self.add_marker("g4h")
        self.add_marker(pytest.mark.xdist_group(XDIST_GROUP))
        self.user_properties += [("case", planned.case), ("pair", planned.name)]

    def setup(self) -> None:
        self.run, self.narrowed = _run_for(self.config)

    def _mine(self, run: ParityRun) -> tuple[list[ParityCheck], str | None]:
        """This item's checks in ``run`` and its case's error; a check that belongs to no planned item is a
        plugin defect, reported, never dropped."""
        n, it = self.narrowed, self.planned
        mine, error, stray = [], None, []
        for case in run.results.get("cases", []):
            orig_case = n.cases.get(case["case"])
            if orig_case != it.case:
                continue
            error = case.get("error") or None
            for c, raw in zip(_checks({"cases": [case]}), case.get("checks", [])):
                engine = raw.get("against")
                if engine is None:
                    name, number = (CACHED, 1) if c.gate.startswith(CACHED + ".") else (None, 1)
                else:
                    name, number = engine, n.engines.get((engine, int(raw.get("engine_number") or 1)))
                if name is None or number is None:
                    stray.append(c.gate)
                elif (it.engine, it.number) == (name, number) or (it.engine is None and name == CACHED):
                    mine.append(c)
        if stray:
            raise ParityCheckFailed(f"g4h plugin: checks of {it.case} outside the planned items: {stray[:4]}")
        return mine, error

    def runtest(self) -> None:
        it = self.planned
        run = self.run
        if isinstance(run, G4HBadInput):
            self.user_properties.append(("g4h_status", "2"))
            raise ParityCheckFailed(f"g4h: error: {run}")
        if isinstance(run, Exception):
            raise ParityCheckFailed(f"g4h parity stopped in an engine: {run}")
        if run.status == 2:
            self.user_properties.append(("g4h_status", "2"))
        self.user_properties.append(("report", str(run.report)))
        mine, error = self._mine(run)
        self.checks = mine
        if error:
            raise ParityCheckFailed(f"g4h parity: {it.case} could not run: {error}\n  report: {run.report}")
        if not mine:
            raise ParityCheckFailed(f"g4h parity: {it.case}: the job reported no check of {it.name}\n"
                                    f"  report: {run.report}")
        if all(c.opted_out for c in mine):
            pytest.skip(f"{it.name}: opted out ({mine[0].reason or mine[0].detail.get('got')})")
        failed = [c for c in mine if not c.passed and not c.informational]
        self.user_properties += [("checks", str(len(mine))), ("failed", str(len(failed)))]
        for c in failed:
            fd = c.first_divergence
            self.user_properties.append((f"FAIL {c.label()}", f"measured {_fmt(c.measured)}, gate "
                                         f"{'<=' if c.op == 'le' else '>='} {_fmt(c.limit)}"
                                         + (f", first divergence {fd}" if fd else "")))
        for c in mine:  # reported beside the verdict, never gating: a finding or a check the engine does not offer
            if c.informational and not c.passed and not c.opted_out:
                self.user_properties.append((f"not gating {c.label()}", c.reason or str(c.detail.get("got", ""))))
        if failed:
            head = f"g4h parity: {it.case} {it.name}: {len(failed)} of {len(mine)} gating checks failed"
            raise ParityCheckFailed("\n".join([head] + [c.message() for c in failed] + [f"report: {run.report}"]))

    def repr_failure(self, excinfo, style=None):  # noqa: ANN001 - pytest's signature
        if isinstance(excinfo.value, ParityCheckFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.path, None, f"{PREFIX} {self.planned.case} {self.planned.name}"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Note the g4h items left after ``-k``, ``-m``, ``--lf`` and node ids: the job runs for them only."""
    if config.stash.get(PLAN, None) is not None:
        config.stash[SELECTED] = [i.planned for i in items if isinstance(i, ParityItem)]


def _command_line_argv(config: pytest.Config) -> list[str] | None:
    models = config.getoption("g4h_model")
    if not models:
        return None
    return _argv(models, config.getoption("g4h_against"), config.getoption("g4h_prompts"),
                 config.getoption("g4h_oracle"), config.getoption("g4h_skip"), config.getoption("g4h_out"),
                 config.getoption("g4h_args"))


def _cached_run(config: pytest.Config, argv: list[str]) -> ParityRun:
    runs = config.stash[RUNS]
    if tuple(argv) not in runs:
        try:
            runs[tuple(argv)] = run_parity(argv)
        except (G4HBadInput, G4HEngineCrashed) as e:
            runs[tuple(argv)] = e
    found = runs[tuple(argv)]
    if isinstance(found, Exception):
        raise found
    return found


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # noqa: ANN001
    for run in config.stash.get(RUNS, {}).values():
        terminalreporter.write_sep("-", "g4h parity")
        if isinstance(run, Exception):
            terminalreporter.write_line(f"g4h: {'error' if isinstance(run, G4HBadInput) else 'engine'}: {run}")
            continue
        terminalreporter.write_line(f"g4h parity {shlex.join(run.argv)}")
        terminalreporter.write_line(f"{run.verdict} (exit {run.status})")
        terminalreporter.write_line(f"report: {run.report}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Exit 2 when the job had bad input (a model that could not be read, a server that is down), as
    ``g4h parity``."""
    if session.config.stash.get(BAD_INPUT, False) and session.exitstatus in (0, 1):
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
        except G4HEngineCrashed as e:
            pytest.fail(f"g4h parity stopped in an engine: {e}", pytrace=False)

    return run
