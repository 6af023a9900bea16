"""No module-level function of ``harness/``, ``reference/`` or ``fast/`` that nothing calls (issue 33 found four:
``llama_cpp_available``, ``mtmd_available``, ``check_declaration``, ``canonical_to_hf``).

A function counts as called when its name appears anywhere in the repository's Python code other than its own ``def``:
a name or attribute (a call, a reference handed on), an import, or a string (``"module:function"`` in the engine
registry, ``__all__``). A decorated function is registered by its decorator (``atexit.register``), a
``pytest_*`` function is a hook pytest calls and a dunder (``__getattr__``) Python's: none needs a caller of ours;
prose (a docstring) is no call. :data:`KEPT` lists the functions that stay
without one, each with its reason."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PACKAGES = ("harness", "reference", "fast")
"""Where the functions are looked for."""

READERS = (*PACKAGES, "tests", "examples")
"""Where a caller may be (with ``noxfile.py`` and ``setup.py``)."""

KEPT: dict[str, str] = {
    "encode_prompt": "reference/mm_model.py's documented entry point (its module docstring): the reference encoders on "
                     "a prepared multimodal prompt, as the specification states them; the harness composes "
                     "encode_item itself (harness/engines/mm.py ReferenceMM)",
}
"""Function name -> why it stays although nothing calls it."""


def uncalled(root: Path = ROOT) -> dict[str, str]:
    """``name -> module`` of each module-level function of :data:`PACKAGES` under ``root`` whose name nothing else
    in :data:`READERS` names (see the module docstring)."""
    defined: dict[str, str] = {}
    named: set[str] = set()
    files = [p for top in READERS if (root / top).is_dir() for p in sorted((root / top).rglob("*.py"))]
    files += [root / n for n in ("noxfile.py", "setup.py") if (root / n).is_file()]
    for path in files:
        if path.resolve() == Path(__file__).resolve():  # KEPT names them: no call
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module = path.relative_to(root).as_posix()
        if module.split("/")[0] in PACKAGES:
            for n in tree.body:
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.decorator_list and \
                        not n.name.startswith(("pytest_", "__")):
                    defined.setdefault(n.name, module)
        prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}  # docstrings name, not call
        for n in ast.walk(tree):
            if isinstance(n, ast.Name):
                named.add(n.id)
            elif isinstance(n, ast.Attribute):
                named.add(n.attr)
            elif isinstance(n, ast.alias):
                named.add(n.name.split(".")[-1])
            elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in prose:
                parts = [x for x in n.value.replace(":", ".").split(".") if x]  # "module:function", __all__
                if parts and all(part.isidentifier() for part in parts):
                    named.add(parts[-1])
    return {name: module for name, module in defined.items() if name not in named}


def test_every_function_has_a_caller():
    left = {name: module for name, module in uncalled().items() if name not in KEPT}
    assert not left, (f"module-level functions nothing calls (name: module): {left}; remove them, or list them in "
                      "tests/test_uncalled.py KEPT with the reason they stay")


def test_kept_functions_are_still_uncalled():
    """A function of :data:`KEPT` that gained a caller (or is gone) leaves the list."""
    assert set(KEPT) <= set(uncalled())


def test_the_count_sees_an_uncalled_function(tmp_path):
    (tmp_path / "harness").mkdir()
    (tmp_path / "harness" / "a.py").write_text(
        "import atexit\n\ndef called():\n    pass\n\ndef lonely():\n    '''lonely in prose is no call'''\n\n"
        "def by_string():\n    pass\n\n@atexit.register\ndef registered():\n    pass\n\ndef pytest_configure(config):\n"
        "    pass\n\nX = 'harness.a:by_string'\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("from harness.a import called\n")
    assert uncalled(tmp_path) == {"lonely": "harness" + "/a.py"}  # in two parts: this file names no missing path
