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

Here: the hooks, the collector, the items and the fixture; the run and its checks are :mod:`.run`, the items planned
from the options and the job narrowed to the selected ones :mod:`.plan`.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Callable

import pytest

from ..core.engine_kinds import ORACLES
from .plan import CACHED, Narrowed, PlannedItem, command_line_argv, narrow, plan_job
from .run import G4HBadInput, G4HEngineCrashed, ParityCheck, ParityRun, checks_of, fmt, parity_argv, run_parity

PREFIX = "g4h"
"""First word of every item's report line (``g4h <case> <pair>``)."""


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
    g.addoption("--g4h-oracle", default=None, choices=ORACLES,
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
            for c, raw in zip(checks_of({"cases": [case]}), case.get("checks", [])):
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
            self.user_properties.append((f"FAIL {c.label()}", f"measured {fmt(c.measured)}, gate "
                                         f"{'<=' if c.op == 'le' else '>='} {fmt(c.limit)}"
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
            argv = command_line_argv(pytestconfig)
            if argv is None:
                pytest.fail("g4h_parity(): no model given and no --g4h-model on the command line", pytrace=False)
        else:
            argv = parity_argv(model, against, prompts, oracle, skip, out or pytestconfig.getoption("g4h_out"), args)
        try:
            return _cached_run(pytestconfig, argv)
        except G4HBadInput as e:
            pytest.fail(f"g4h: error: {e}", pytrace=False)
        except G4HEngineCrashed as e:
            pytest.fail(f"g4h parity stopped in an engine: {e}", pytrace=False)

    return run
