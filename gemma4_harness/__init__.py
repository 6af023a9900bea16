"""gemma4-harness, installed under one import name: ``gemma4_harness``.

The repository keeps its three packages at its top (``harness/``, ``reference/``, ``fast/``); they are imported as
``gemma4_harness.harness``, ``gemma4_harness.reference`` and ``gemma4_harness.fast`` everywhere (code, tests, entry
points, ``python -m``), so an engine repository's own ``harness/``, ``reference/`` or ``fast/`` folder can neither
shadow ours nor be shadowed by it (docs/architecture.md, "One import name").

* In a wheel (or an sdist install) the three packages lie inside this folder (``setup.py`` maps them there).
* In a checkout (``PYTHONPATH=.``, ``python -m`` from its root) and in an editable install this folder holds only
  this file and ``__main__.py``: the package's search path then also covers the repository root, so
  ``gemma4_harness.harness`` is the root's ``harness/``. Each of the three refuses to be imported under its folder
  name (``import harness``), which would make a second copy of every module it holds.

``python -m gemma4_harness`` is ``g4h``.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
if not (_HERE / "harness" / "__init__.py").is_file() and (_HERE.parent / "harness" / "__init__.py").is_file():
    __path__.append(str(_HERE.parent))  # noqa: F821 (a package's __path__): a checkout or an editable install


def _refuse_folder_name(name: str) -> None:
    """What ``harness/``, ``reference/`` and ``fast/`` do when imported by their folder name (``import harness``,
    a checkout on ``sys.path``): refuse, since a second copy of every module would follow (two registries, two
    classes of one name). ``python -m harness.X ARGS`` gets one line naming the command to run instead, exit 2
    (the command, not the engine, is what is wrong); any other import an :class:`ImportError` saying the same."""
    right = f"{__name__}.{name}"
    argv = list(getattr(sys, "orig_argv", ()))
    flag = next((i for i, a in enumerate(argv[1:], 1) if a.startswith("-m")), None)
    if sys.argv[:1] == ["-m"] and flag is not None:  # runpy is still finding the -m module: it names this package
        module = argv[flag][2:] or (argv[flag + 1] if flag + 1 < len(argv) else name)
        rest = argv[flag + (1 if argv[flag][2:] else 2):]
        print(f"error: the module {module} is named {__name__}.{module}: run "
              f"python -m {' '.join([f'{__name__}.{module}', *rest])}", file=sys.stderr)
        raise SystemExit(2)
    raise ImportError(f"{name!r} is gemma4-harness's {name}/, whose import name is {right} (under its folder name "
                      f"it would be a second copy of every module in it): import {right} (commands: g4h, "
                      f"python -m {__name__}, python -m {right}.MODULE)")
