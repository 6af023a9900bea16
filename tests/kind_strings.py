"""Which modules name an engine kind as a string (issue 33: "modules that name an engine kind outside the registry
and the engine's own package: a handful at most").

Run ``python tests/kind_strings.py [ROOT]`` for the table (per kind: the modules, each with its lines and whether
the literal is a kind, another meaning, or the kind's own package); ``tests/test_kind_strings.py`` holds it.

How a literal is told apart:

- Only a string constant *equal* to a kind's name counts (``"llamacpp"``, ``"fast"``): a pair or gate name that
  contains one (``"reference~fast"``, ``"reference~llamacpp_q8.mean_kld"``), a bench row (``"fast-graph"``), an
  f-string's fragment and prose are other strings (:func:`literals`, by :mod:`ast`).
- Docstrings and the bare string statements under an assignment (attribute docstrings) are prose, not counted.
- Three places are not "outside": the registry (:data:`REGISTRY`), and each kind's own package (:data:`OWN`: the
  engine's modules, its multimodal engine, its built-in checks in ``harness/parity/checks/``, and for ``reference``
  and ``fast`` the packages of the same name).
- A literal equal to a kind's name may mean something else: the Python package ``transformers`` (``sys.modules``,
  the versions a report prints), the generic OpenAI server *dialect* ``openai``, the tokenizer engine ``llamacpp``
  (``harness/tokenizer/engines.py``, a list of tokenizers of its own). Those are listed in :data:`OTHER_MEANINGS`
  with their count and reason, read off each line by hand; the count is held exactly, so a kind literal added to
  such a module shows as one more.
- What is left names an engine kind. :data:`MUST_NAME` lists where that stays and why.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

KINDS = ("reference", "transformers", "fast", "llamacpp", "cmd", "openai")
"""The kinds of :data:`harness.core.engine_kinds.KINDS`, written out so that the count reads no harness module."""

PACKAGES = ("harness", "fast", "reference")
"""The folders whose modules are counted."""

REGISTRY = "harness/core/engine_kinds.py"

OWN: dict[str, tuple[str, ...]] = {
    "reference": ("reference/", "harness/engines/reference.py", "harness/parity/checks/reference.py"),
    "transformers": ("harness/engines/transformers.py", "harness/engines/mm_transformers.py"),
    "fast": ("fast/", "harness/engines/fast.py", "harness/engines/mm_fast.py", "harness/parity/checks/fast.py"),
    "llamacpp": ("harness/engines/llamacpp/", "harness/parity/checks/llamacpp.py"),
    "cmd": ("harness/engines/cmd.py",),
    "openai": ("harness/engines/openai/", "harness/parity/checks/server.py", "harness/parity/checks/server_base.py",
               "harness/parity/checks/server_prompt.py", "harness/parity/checks/server_generation.py"),
}
"""Each kind's own package (path prefixes from the repository root): the server checks are the ``openai`` kind's own
checks (``OWN_CHECKS``)."""

OTHER_MEANINGS: dict[tuple[str, str], tuple[int, str]] = {
    ("harness/cli/__init__.py", "transformers"): (1, "the Python package (sys.modules)"),
    ("harness/parity/job.py", "transformers"): (1, "the Python package (VERSIONED: the versions a result records)"),
    ("harness/parity/report.py", "transformers"): (1, "the Python package (the versions a report prints)"),
    ("harness/parity/drift.py", "transformers"): (2, "the Python package: its version, and the prefix of the "
                                                     "figures transformers makes (ORACLE_MARKERS)"),
    ("harness/synth/cache.py", "transformers"): (1, "the Python package (the versions a built case records)"),
    ("harness/parity/cases.py", "transformers"): (1, "a folder-name word (GENERIC_DIRS: folder names a case name "
                                                     "skips)"),
    ("harness/cli/_args.py", "openai"): (1, "the generic server dialect (--dialect choices)"),
    ("harness/engines/numerics.py", "openai"): (1, "the generic server dialect (SERVER_NUMERICS)"),
    ("harness/engines/openai/engine.py", "llamacpp"): (1, "a server's owned_by in its model list (llama-server "
                                                          "says llamacpp): how the dialect is told"),
    ("harness/tokenizer/engines.py", "llamacpp"): (4, "the tokenizer engine llamacpp (tokenizer.engines."
                                                      "ENGINE_NAMES: tokenizers, not engine kinds)"),
    ("harness/tokenizer/checks.py", "llamacpp"): (4, "the tokenizer engine llamacpp (its checks' names)"),
}
"""``(module, kind) -> (literals of another meaning, what they mean)``."""

MUST_NAME: dict[tuple[str, str], tuple[int, str]] = {
    ("harness/parity/cases.py", "transformers"): (2, "the built-in cases' extras: transformers as the oracle of a "
                                                     "built case's HF folder (reference~transformers, and the "
                                                     "multimodal vision mask)"),
    ("harness/parity/cases.py", "llamacpp"): (2, "the built-in cases' extras: llama.cpp's drafter and multimodal "
                                                 "(mtmd) checks, opted out by its --skip name"),
}
"""``(module, kind) -> (at most this many literals, why the module names the kind)``: what is left after the
registry work (issue 33); ``tests/test_kind_strings.py`` holds every module to it."""


def _prose(tree: ast.AST) -> set[int]:
    """The ids of the string constants that are not a string of their own: docstrings and bare string statements
    (prose), and the fixed parts of an f-string (``f"{oracle}~fast"``: a pair name)."""
    out = {id(n.value) for n in ast.walk(tree)
           if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}
    return out | {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}


def literals(source: str) -> dict[str, list[int]]:
    """``kind -> lines`` of the string constants of ``source`` equal to a kind's name, prose left out."""
    tree = ast.parse(source)
    prose = _prose(tree)
    out: dict[str, list[int]] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in KINDS and id(n) not in prose:
            out.setdefault(n.value, []).append(n.lineno)
    return {k: sorted(v) for k, v in out.items()}


def own(module: str, kind: str) -> bool:
    """Whether ``module`` (a path from the root) is the registry or ``kind``'s own package."""
    return module == REGISTRY or module.startswith(OWN[kind])


def scan(root: Path) -> dict[str, dict[str, list[int]]]:
    """``kind -> module -> lines`` of every kind literal under :data:`PACKAGES` of ``root``."""
    out: dict[str, dict[str, list[int]]] = {k: {} for k in KINDS}
    for top in PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            module = path.relative_to(root).as_posix()
            for kind, lines in literals(path.read_text()).items():
                out[kind][module] = lines
    return out


def naming(root: Path) -> dict[str, dict[str, int]]:
    """``kind -> module -> literals naming the kind`` outside the registry and the kind's own package: every kind
    literal less the :data:`OTHER_MEANINGS` counted for the module."""
    out: dict[str, dict[str, int]] = {k: {} for k in KINDS}
    for kind, modules in scan(root).items():
        for module, lines in modules.items():
            n = len(lines) - OTHER_MEANINGS.get((module, kind), (0, ""))[0]
            if not own(module, kind) and n > 0:
                out[kind][module] = n
    return out


def main(argv: list[str]) -> int:
    """Print the table for the tree at ``argv[0]`` (default: this checkout)."""
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[1]
    found, named = scan(root), naming(root)
    for kind in KINDS:
        print(f"{kind}: {len(named[kind])} modules name it outside the registry and its own package")
        for module, lines in found[kind].items():
            other = OTHER_MEANINGS.get((module, kind))
            what = ("registry/own" if own(module, kind) else f"naming {named[kind][module]}" if module in named[kind]
                    else "")
            if other and other[0]:
                what += f"{'; ' if what else ''}other meaning {other[0]}: {other[1]}"
            print(f"    {module} {lines}  [{what}]")
    total = {m for k in KINDS for m in named[k]}
    print(f"distinct modules naming some kind: {len(total)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
