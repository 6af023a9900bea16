"""``g4h parity --skip``: one list (:mod:`harness.parity.skips`) that the parser, its help, the checks and the docs
read (the docs' table: ``tests/test_docs.py``). Every name of the list is read by a check, every name a check reads
is in the list, and an unknown name is bad input naming the valid ones."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gemma4_harness.harness.cli.parity import add_arguments
from gemma4_harness.harness.core.engine_kinds import KINDS
from gemma4_harness.harness.parity import skips
from gemma4_harness.harness.parity.job import QUICK_LEAVES_OUT
from gemma4_harness.harness.pytest_plugin.run import G4HBadInput, parse_argv
from gemma4_harness.harness.tokenizer.checks import CHECKS, tokenizer_checks
from gemma4_harness.reference.errors import InputError
from tests.clitools import assert_one_line_error, run_cli

ROOT = Path(__file__).resolve().parent.parent


def _is_skip(node: ast.expr) -> bool:
    """``skip``, ``tok_skip``, ``opts.skip``: a collection of ``--skip`` names."""
    return (isinstance(node, ast.Name) and "skip" in node.id) or (isinstance(node, ast.Attribute) and node.attr == "skip")


def names_read(source: str) -> set[str]:
    """The ``--skip`` names a module's checks read: the literal name of each ``skipped(skip, "name")`` call and of
    each ``"name" in skip`` test (the spelling :func:`harness.parity.skips.skipped` replaces); ``skipped(skip,
    row.skip)`` reads the engine rows' ``skip`` names (:func:`harness.parity.checks.pair.opted_out`)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "skipped":
            if ast.unparse(node.args[1]) == "row.skip":  # an engine kind's own name (its registry row's ``skip``)
                out |= {k.skip for k in KINDS if k.skip}
                continue
            assert isinstance(node.args[1], ast.Constant), f"skipped() with a computed name: {ast.unparse(node)}"
            out.add(node.args[1].value)
        elif (isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and isinstance(node.left.value, str)
              and isinstance(node.ops[0], (ast.In, ast.NotIn)) and _is_skip(node.comparators[0])):
            out.add(node.left.value)
    return out


def test_names_read_finds_both_spellings():
    src = 'if skipped(opts.skip, "a") or "b" not in skip or "c" in tok_skip or "d" in other or x in skip: pass'
    assert names_read(src) == {"a", "b", "c"}


def test_every_listed_name_is_read_by_a_check_and_every_read_name_is_listed():
    read: dict[str, list[str]] = {}
    for path in sorted((ROOT / "harness").rglob("*.py")):
        for name in names_read(path.read_text(encoding="utf-8")):
            read.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert set(read) - set(skips.SKIPPABLE) == set(), f"read but not listed: {read}"
    assert set(skips.SKIPS) - set(read) == set(), "listed but read by no check"
    assert set(QUICK_LEAVES_OUT) <= set(skips.SKIPS)


def test_every_tokenizer_check_name_opts_that_check_out():
    """The tokenizer checks' names (the rest of the list) are read by :func:`tokenizer_checks` itself: each opted
    out is reported so, and nothing runs."""
    names = [n for n, _ in CHECKS]
    assert [n for n in skips.SKIPPABLE if n not in skips.SKIPS] == [n for n in names if n not in skips.SKIPS]
    res = tokenizer_checks(skip=tuple(names))
    assert {c["name"]: c["status"] for c in res["checks"]} == dict.fromkeys(names, "opted_out")


def test_skipped_refuses_a_name_the_list_lacks():
    assert skips.skipped(("llamacpp",), "llamacpp") and not skips.skipped((), "server-stop")
    with pytest.raises(ValueError, match="not a --skip name"):
        skips.skipped((), "server-batches")


def test_the_parser_and_its_help_take_the_list():
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    action = next(a for a in p._actions if "--skip" in a.option_strings)
    assert list(action.choices) == list(skips.SKIPPABLE)
    for name, meaning in skips.SKIPS.items():
        assert f"{name}: {meaning}" in action.help
    assert all(n in action.help for n in skips.SKIPPABLE)


def test_an_unknown_name_is_bad_input_naming_the_valid_ones():
    line = assert_one_line_error(run_cli("parity", "--skip", "server-batches", "--no-real"), "server-batches")
    assert all(repr(n) in line for n in skips.SKIPPABLE), line
    with pytest.raises(InputError) as e:
        skips.check_skip(("llamacpp", "llama"))
    assert str(e.value).startswith("--skip 'llama': expected one of ") and all(n in str(e.value) for n in skips.SKIPPABLE)
    with pytest.raises(G4HBadInput, match="--skip: invalid choice: 'llama'"):  # the pytest plugin's --g4h-skip
        parse_argv(["--skip", "llama"])
