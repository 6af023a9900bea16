"""The pytest plugin's plan (:mod:`harness.pytest_plugin`): the test items of a ``g4h parity`` job, from its options
alone, before any engine runs (:func:`plan_job`: one per engine pair, and the reference's cached-vs-uncached check),
and the job narrowed to the items pytest selected (:func:`narrow`).

Only the standard library and pytest at import: the project is imported inside the functions that need it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from ..core.engine_kinds import ORACLE  # imports nothing (as the plugin's __init__)
from .run import G4HBadInput, parse_argv, parity_argv


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
    (:func:`harness.parity.checks.pair.pair_checks`): the item is named as the pair is before its engine starts
    (:func:`harness.core.gates.pair_name`; ``#N`` for the Nth engine of a kind). Its checks are the job's, found by
    their engine and number (``ParityItem._mine``): the plugin measures nothing itself."""
    from gemma4_harness.harness.core.gates import pair_name  # lazy (as above)
    from gemma4_harness.harness.engines import engine_kind  # lazy (as above)

    out, seen = [], {}
    for name in names:
        kind = engine_kind(name)
        seen[kind] = seen.get(kind, 0) + 1
        n = seen[kind]
        out.append((pair_name(kind, oracle=oracle) + (f"#{n}" if n > 1 else ""), name, n))
    return out


def plan_job(config: pytest.Config) -> Plan | None:
    """The command line's job (None without ``--g4h-model``), checked as ``g4h parity`` checks it before any work:
    its options, the models, the engine names, ``--skip``, ``--oracle`` and the prompt set. Imports the harness,
    runs nothing.

    Raises:
        G4HBadInput: bad input, one line.
    """
    argv = command_line_argv(config)
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
    base = parity_argv(None, None, config.getoption("g4h_prompts"), config.getoption("g4h_oracle"),
                 config.getoption("g4h_skip"), config.getoption("g4h_out"), extra) if narrowable else None
    items = []
    for i, (model, case) in enumerate(zip(args.model, case_names(args.model))):
        for name, engine, n in _planned_pairs(against or default_against(model, args.oracle), args.oracle):
            items.append(PlannedItem(i, model, case, name, engine, n))
        if args.oracle == ORACLE:
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
    argv = parity_argv(models, engines if engines is not None else plan.against, args=plan.base)
    by_case = {it.model_index: it.case for it in plan.items}
    return Narrowed(argv, dict(zip(case_names(models), (by_case[i] for i in indices))), engine_map)


def command_line_argv(config: pytest.Config) -> list[str] | None:
    models = config.getoption("g4h_model")
    if not models:
        return None
    return parity_argv(models, config.getoption("g4h_against"), config.getoption("g4h_prompts"),
                 config.getoption("g4h_oracle"), config.getoption("g4h_skip"), config.getoption("g4h_out"),
                 config.getoption("g4h_args"))
