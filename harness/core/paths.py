"""Where the harness reads and writes: its carried data, its cache, the user cache, the reports.

The rule is :mod:`fast.paths` (the lowest layer that needs it), re-exported here:

* :data:`REPO_ROOT`: the folder holding the import packages (the repository in a clone, ``site-packages`` when
  installed from a wheel); read only.
* :data:`CASES_DIR`: the case library, the package's own copy when installed (``harness/_cases``), else the
  clone's ``cases/``.
* :func:`cache_root`: the project's own cache, ``$G4H_CACHE`` or the user cache directory (built synthetic
  checkpoints, the assembled real Gemma 3 GGUF, derived tokenizer files, compiled CPU kernels).
* :func:`user_cache_dir`: ``$XDG_CACHE_HOME/gemma4-harness`` or ``~/.cache/gemma4-harness``, for builds that
  outlive a clone (llama.cpp, keyed by version) and, by default, the project cache.
* :func:`default_reports_dir`: ``reports/`` under the current folder, where runs go unless ``--out``.

Nothing else is read: the project carries its data in ``cases/``, or takes it from an installed
package or one of these caches. Nothing is written inside the environment or the package.
"""

from __future__ import annotations

from pathlib import Path

from gemma4_harness.fast.paths import CASES_DIR, IMPORT_ROOT, cache_root, user_cache_dir

REPO_ROOT = IMPORT_ROOT
"""The folder holding ``harness/``, ``fast/`` and ``reference/``: the repository in a clone, ``site-packages``
when installed (read only)."""

__all__ = ["CASES_DIR", "REPO_ROOT", "cache_root", "default_reports_dir", "user_cache_dir"]


def default_reports_dir() -> Path:
    """Where runs write when no ``--out`` is given: ``reports/`` under the current working directory (read when
    called, so a process that changes folder writes under the new one)."""
    return Path.cwd() / "reports"
