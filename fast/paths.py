"""Where the project's carried data and its caches lie, in a clone and in an installed wheel.

The rule lives here, in the lowest layer that needs it (:mod:`fast.shapes` reads the shape files,
:mod:`fast.cpu_kernels` caches its compiled kernels); :mod:`harness.core.paths` re-exports it.

* :data:`IMPORT_ROOT`: the folder holding the packages ``reference``, ``fast`` and ``harness`` (imported as
  ``gemma4_harness.reference``, ...): the repository in a clone (or an editable install),
  ``site-packages/gemma4_harness`` in an installed wheel. Nothing is ever written there.
* :data:`SEARCH_ROOT`: the folder holding the ``gemma4_harness`` package (the same repository in a clone,
  ``site-packages`` when installed): first on a worker process's ``PYTHONPATH``, and its folder.
* :data:`CASES_DIR`: the case library (model specs, prompt sets, shapes, tokenizer corpora, the chat
  template, the carried Gemma 3 tokenizer). In a clone it is ``<repo>/cases``; a built wheel or sdist install
  carries its own copy inside the package, ``gemma4_harness/harness/_cases`` (the build step of ``setup.py``
  copies every file of ``cases/`` there), and that copy wins when present.
* :func:`user_cache_dir`: ``$XDG_CACHE_HOME/gemma4-harness``, else ``~/.cache/gemma4-harness``.
* :func:`cache_root`: the project cache (built synthetic checkpoints, the assembled real Gemma 3 GGUF, the
  derived tokenizer files, compiled CPU kernels): an explicit folder, else ``$G4H_CACHE``, else
  :func:`user_cache_dir`. Never a folder inside the environment or the clone, so an installed ``g4h`` writes
  nothing into its virtualenv and clones share one cache (every entry is keyed by what built it and
  written atomically).
"""

from __future__ import annotations

import os
from pathlib import Path

IMPORT_ROOT = Path(__file__).resolve().parents[1]
"""The folder holding the three packages (the repository in a clone, ``site-packages/gemma4_harness`` when
installed)."""

SEARCH_ROOT = IMPORT_ROOT if (IMPORT_ROOT / "gemma4_harness" / "__init__.py").is_file() else IMPORT_ROOT.parent
"""The folder holding the ``gemma4_harness`` package (the repository in a clone, ``site-packages`` when installed):
what a worker process puts first on its ``PYTHONPATH`` and runs in, so that it imports this checkout or install."""

BUNDLED_CASES_DIR = IMPORT_ROOT / "harness" / "_cases"
"""Where a wheel carries the case library (``setup.py``'s build step copies ``cases/`` there)."""

CASES_DIR = BUNDLED_CASES_DIR if BUNDLED_CASES_DIR.is_dir() else IMPORT_ROOT / "cases"
"""The case library: the package's own copy when installed from a wheel or sdist, else the clone's ``cases/``."""

CACHE_ENV = "G4H_CACHE"
"""The environment variable that moves the project cache."""


def user_cache_dir() -> Path:
    """The user cache directory of the harness: ``$XDG_CACHE_HOME/gemma4-harness`` or
    ``~/.cache/gemma4-harness`` (builds that outlive a clone or a virtualenv, such as llama.cpp)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gemma4-harness"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The project cache folder: ``cache_dir``, else ``$G4H_CACHE``, else :func:`user_cache_dir`."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else user_cache_dir()
