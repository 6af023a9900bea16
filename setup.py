"""The build steps pyproject.toml cannot say: one import name, and the case library inside the wheel.

The repository's three packages (``harness/``, ``reference/``, ``fast/``, at its top) are installed under one
import name, ``gemma4_harness`` (``gemma4_harness/__init__.py``): ``gemma4_harness.harness``,
``gemma4_harness.reference``, ``gemma4_harness.fast`` with their subpackages, found here (a package added under
them needs no edit). A wheel's only top-level name is ``gemma4_harness`` (docs/architecture.md, "One import name").

``cases/`` (model specs, prompt sets, shapes, tokenizer corpora, the chat template, the carried Gemma 3
tokenizer) stays a data folder at the top of the repository. A wheel built from the clone or from the sdist
(MANIFEST.in grafts ``cases/``) gets every file under it copied into the package as ``gemma4_harness/harness/_cases/``, which
an installed ``g4h`` reads (``fast/paths.py``). Nothing is listed: a file added under ``cases/`` is in the next
wheel. An editable install reads ``cases/`` of the clone and copies nothing.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CASES = ROOT / "cases"
NAMESPACE = "gemma4_harness"
PACKAGES = ("harness", "reference", "fast")
BUNDLED = Path(NAMESPACE) / "harness" / "_cases"


def packages() -> list[str]:
    """``gemma4_harness`` and every package under the three, named under it (``gemma4_harness.harness.core``)."""
    found = find_packages(where=str(ROOT), include=[f"{p}{tail}" for p in PACKAGES for tail in ("", ".*")])
    return [NAMESPACE] + [f"{NAMESPACE}.{name}" for name in found]


def case_files() -> list[Path]:
    """Every file under ``cases/`` (relative to it), hidden files and Python caches left out."""
    out = []
    for root, dirs, files in os.walk(CASES):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        out += [Path(root, f).relative_to(CASES) for f in sorted(files) if not f.startswith(".")]
    return out


class BuildPyWithCases(build_py):
    """``build_py`` that also copies ``cases/`` into ``<build_lib>/gemma4_harness/harness/_cases/`` (not in editable
    mode)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False) or not CASES.is_dir():
            return
        for rel in case_files():
            dst = Path(self.build_lib) / BUNDLED / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(CASES / rel, dst)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        extra = [] if getattr(self, "editable_mode", False) or not CASES.is_dir() else [
            str(Path(self.build_lib) / BUNDLED / rel) for rel in case_files()]
        return super().get_outputs(include_bytecode) + extra


setup(
    packages=packages(),
    # the folders stay where they are in the repository; each is installed under the one import name
    package_dir={NAMESPACE: NAMESPACE, **{f"{NAMESPACE}.{p}": p for p in PACKAGES}},
    # the CPU kernels' sources and headers, compiled on first use (fast/cpu_kernels.py, fast/quant_kernels.py)
    package_data={f"{NAMESPACE}.fast": ["csrc/*.c", "csrc/*.h"]},
    cmdclass={"build_py": BuildPyWithCases},
)
