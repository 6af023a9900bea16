"""The one build step pyproject.toml cannot say: the case library travels inside the wheel.

``cases/`` (model specs, prompt sets, shapes, tokenizer corpora, the chat template, the carried Gemma 3
tokenizer) stays a data folder at the top of the repository. A wheel built from the clone or from the sdist
(MANIFEST.in grafts ``cases/``) gets every file under it copied into the package as ``harness/_cases/``, which
an installed ``g4h`` reads (:mod:`fast.paths`). Nothing is listed: a file added under ``cases/`` is in the next
wheel. An editable install reads ``cases/`` of the clone and copies nothing.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CASES = Path(__file__).resolve().parent / "cases"
BUNDLED = Path("harness") / "_cases"


def case_files() -> list[Path]:
    """Every file under ``cases/`` (relative to it), hidden files and Python caches left out."""
    out = []
    for root, dirs, files in os.walk(CASES):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        out += [Path(root, f).relative_to(CASES) for f in sorted(files) if not f.startswith(".")]
    return out


class BuildPyWithCases(build_py):
    """``build_py`` that also copies ``cases/`` into ``<build_lib>/harness/_cases/`` (not in editable mode)."""

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


setup(cmdclass={"build_py": BuildPyWithCases})
