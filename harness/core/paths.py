"""Where the harness reads and writes: the repository, its cache, and the user cache.

* :data:`REPO_ROOT`: the repository (the folder holding ``harness/``, ``cases/``, ``reports/``).
* :func:`cache_root`: the project's own cache, ``$G4H_CACHE`` or ``<repo>/.g4h-cache`` (built
  synthetic checkpoints, the assembled real Gemma 3 GGUF, compiled CPU kernels).
* :func:`user_cache_dir`: the user cache directory, ``$XDG_CACHE_HOME/gemma4-harness`` or
  ``~/.cache/gemma4-harness``, for builds that outlive a clone (llama.cpp, keyed by version).

Nothing else is read: the project carries its data in ``cases/``, or takes it from an installed
package or one of these caches.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The repository root (the folder that holds ``harness/``)."""

CASES_DIR = REPO_ROOT / "cases"
"""The case library: model specs, prompt sets, tokenizer corpora, shapes (data, not code)."""


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The project cache folder: ``cache_dir``, else ``$G4H_CACHE``, else ``<repo>/.g4h-cache``."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("G4H_CACHE")
    return Path(env) if env else REPO_ROOT / ".g4h-cache"


def user_cache_dir() -> Path:
    """The user cache directory of the harness: ``$XDG_CACHE_HOME/gemma4-harness`` or
    ``~/.cache/gemma4-harness`` (builds that survive a fresh clone, such as llama.cpp)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gemma4-harness"
