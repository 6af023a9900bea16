"""The documents against the code: every repository path they name exists, the gate tables (in docs/gates.md only)
are the ones :mod:`harness.core.gates` generates, and docs/usage.md's ``--skip`` table is
:mod:`harness.parity.skips`' (so none can rot again)."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from gemma4_harness.harness.core import gates
from gemma4_harness.harness.parity import skips

ROOT = Path(__file__).resolve().parent.parent

TOP = ("harness", "reference", "fast", "docs", "tests", "cases", "examples", "reports")
_FILE = re.compile(rf"(?<![\w./~$-])((?:{'|'.join(TOP)})/[\w./-]*\.(?:py|md|toml|jsonl|json|txt|cfg|ini|yaml|yml|c|h))"
                   r"(?![\w/-])")
_DIR = re.compile(rf"(?<![\w./~$-])((?:{'|'.join(TOP)})/(?:[\w.-]+/)*)(?![\w*<{{-])")

FOREIGN = {
    "tests/models/utils.py": "vLLM (check_logprobs_close)",
    "examples/model-conversion/scripts/utils/check-nmse.py": "llama.cpp (calculate_nmse)",
    "docs/gguf.md": "ggml (the GGUF specification)",
}
"""Paths of other projects' trees that our text names as its sources: not ours, so not checked."""

GENERATED = ("reports/", "harness/_cases/")
"""Paths that exist only once written: run directories (``reports/``, not committed) and the wheel's copy of the
case library (``setup.py``'s build step)."""


def _documents() -> list[Path]:
    """README.md, docs/*.md, cases/**/*.toml|md, pyproject.toml and every Python file of the repository."""
    names = ["README.md", "pyproject.toml", "noxfile.py", "setup.py", "MANIFEST.in", "reports/README.md"]
    found = [ROOT / n for n in names if (ROOT / n).is_file()]
    found += sorted((ROOT / "docs").glob("*.md"))
    found += sorted(p for p in (ROOT / "cases").rglob("*") if p.suffix in (".toml", ".md"))
    for top in ("harness", "reference", "fast", "tests", "examples"):
        found += sorted(p for p in (ROOT / top).rglob("*.py") if "_cases" not in p.parts)
    return found


def repo_paths(text: str) -> list[str]:
    """Every repository-relative path ``text`` names (``harness/core/gates.py``, ``docs/``, ``cases/prompts/``)."""
    return [m.group(1) for pat in (_FILE, _DIR) for m in pat.finditer(text)]


def test_repo_paths_finds_paths_and_only_paths():
    gone = "harness" + "/gone.py"  # spelt in two parts, so that this file names no missing path
    text = (f"see `{gone}`, harness/core/gates.py, (docs/trace-format.md) and cases/prompts/; not "
            "~/.cache/gemma4-harness/x.py, llama.cpp/tests/test-backend-ops.cpp, fast/transformers, "
            "cases/models/*.toml or reports/<run>/")
    assert repo_paths(text) == [gone, "harness/core/gates.py", "docs/trace-format.md", "cases/prompts/"]


def test_every_repository_path_named_exists():
    """A path named in a document, a case file or a Python string or comment names a file or folder of this
    repository (other projects' paths: :data:`FOREIGN`; written at run time: :data:`GENERATED`)."""
    missing, foreign_seen = [], set()
    for doc in _documents():
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for path in repo_paths(line):
                if path in FOREIGN:
                    foreign_seen.add(path)
                elif not path.startswith(GENERATED) and not (ROOT / path).exists():
                    missing.append(f"{doc.relative_to(ROOT)}:{n}: {path}")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)
    assert foreign_seen == set(FOREIGN), f"FOREIGN lists paths no document names: {set(FOREIGN) - foreign_seen}"


# --------------------------------------------------------------------------- the gate tables


def test_gate_tables_in_the_documents_are_generated_from_gates_py():
    """docs/gates.md holds both tables, :func:`harness.core.gates.gate_table`'s character for character, and no other
    document holds one (README.md links it; rewrite them with ``python -m gemma4_harness.harness.core.gates --write``)."""
    held: dict[str, set[str]] = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for kind, table in gates.gate_tables_in(doc.read_text(encoding="utf-8")).items():
            held.setdefault(kind, set()).add(doc.name)
            assert table == gates.gate_table(kind), (
                f"{doc.relative_to(ROOT)}: the {kind} gate table differs from harness/core/gates.py; run "
                f"python -m gemma4_harness.harness.core.gates --write {doc.relative_to(ROOT)}")
    assert held == {"summary": {"gates.md"}, "full": {"gates.md"}}


def test_gate_tables_list_every_gate_with_its_limit():
    """The generated tables are derived from :data:`DEFAULT_GATES`: every gate appears with its limit, in both."""
    full, summary = gates.gate_table("full"), gates.gate_table("summary")
    for g in gates.DEFAULT_GATES.values():
        pair, _, metric = g.name.rpartition(".")
        assert f"| `{g.name}` | {gates._limit(g)} |" in full
        row = next(ln for ln in summary.splitlines() if ln.startswith(f"| `{pair}` |"))
        assert f"`{metric}` {gates._limit(g)}" in row
    assert gates._limit(gates.DEFAULT_GATES["reference~cmd.layer_rel_l2"]) == "≤ 1e-3"
    assert gates._limit(gates.DEFAULT_GATES["oracle~engine_bf16.max_abs_logit"]) == "≤ 1 (informational)"
    with pytest.raises(ValueError, match="unknown gate table"):
        gates.gate_table("neither")


def test_gate_tables_are_rewritten_between_their_markers(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n<!-- gates:summary -->\n| stale |\n<!-- /gates:summary -->\nafter\n", encoding="utf-8")
    assert gates._main(["--write", str(doc)]) == 0
    text = doc.read_text(encoding="utf-8")
    assert text == f"intro\n<!-- gates:summary -->\n{gates.gate_table('summary')}<!-- /gates:summary -->\nafter\n"
    (tmp_path / "none.md").write_text("no table\n", encoding="utf-8")
    assert gates._main(["--write", str(tmp_path / "none.md")]) == 2
    assert gates.GATES_DOC == ROOT / "docs" / "gates.md"  # --write alone: the one place


def test_skip_table_in_the_docs_is_generated_from_skips_py():
    """docs/usage.md holds :func:`harness.parity.skips.skip_table` (``python -m gemma4_harness.harness.parity.skips`` prints it)."""
    assert skips.skip_table() in (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")


_NAMED_LIMIT = re.compile(r"`([\w.~#]+)`\s*(<=|>=|≤|≥)\s*([0-9][0-9.e+-]*)")


def test_limits_quoted_in_prose_match_gates_py():
    """Where a document quotes a gate by name with a bare limit (``\\`sweep~engines.mean_kld\\` <= 1e-5``), the limit
    is the module's."""
    wrong = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for name, _op, value in _NAMED_LIMIT.findall(line):
                g = gates.DEFAULT_GATES.get(name)
                if g is not None and float(value.rstrip(".")) != g.limit:
                    wrong.append(f"{doc.relative_to(ROOT)}:{n}: {name} {value}, gates.py {g.limit:g}")
    assert not wrong, "\n".join(wrong)


_ROLE = re.compile(r":(?:func|data|class|mod|meth|attr|exc|obj):`~?((?:harness|reference|fast)(?:\.\w+)+)`")


@functools.lru_cache(maxsize=None)
def _defined(module: Path) -> set[str]:
    """The names ``module`` binds anywhere (defs, classes, assignments, imports) and lists in ``__all__`` (a package's
    lazy ``__getattr__`` serves those)."""
    out: set[str] = set()
    for n in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, (ast.Name, ast.Attribute)) and isinstance(n.ctx, ast.Store):
            out.add(n.id if isinstance(n, ast.Name) else n.attr)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier():
            out.add(n.value)  # __all__'s entries
    return out


def unresolved(dotted: str, root: Path = ROOT) -> str | None:
    """Why ``dotted`` (``harness.core.gates.DEFAULT_GATES``) names nothing in the tree at ``root``, or None: its longest
    module prefix must be a module or package, and the next part a name that module binds."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:k])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module.is_file():
            rest = parts[k:]
            found = not rest or rest[0] in _defined(module)
            return None if found else f"{rest[0]} is not in {module.relative_to(root)}"
    return "no such module"


def test_unresolved_finds_a_name_that_moved(tmp_path):
    (tmp_path / "harness" / "core").mkdir(parents=True)
    (tmp_path / "harness" / "core" / "gates.py").write_text("LIMIT = 1\n")
    assert unresolved("harness.core.gates.LIMIT", tmp_path) is None
    assert unresolved("harness.core.gates", tmp_path) is None
    assert unresolved("harness.core.gates.GONE", tmp_path) == "GONE is not in harness/core/gates.py"
    assert unresolved("harness.gone.LIMIT", tmp_path) == "no such module"


def test_every_named_module_member_exists():
    """A cross-reference by full dotted name (``:func:`harness.parity.checks.pair.pair_checks```) in a document or a
    docstring names something its module still defines: a name that moved in a split is named where it now lives."""
    bad = [f"{doc.relative_to(ROOT)}:{n}: {m}: {why}" for doc in _documents()
           for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1)
           for m in _ROLE.findall(line) if (why := unresolved(m)) is not None]
    assert not bad, "cross-references to names that are not there:\n" + "\n".join(bad)
