"""An oracle's problem stays in the oracle's rows.

transformers is the oracle of several checks of a case (reference vs transformers on the logits and traces, its
image and audio processors, its multimodal model, its assistant), and its newest release may not do what the pinned
one did. :func:`oracle_rows` runs the figures of one oracle: when the oracle cannot be built or fails on the way,
whatever it raises, the result is its one ``<pair>.runs`` row, failing, with the reason (``not run: transformers
<version>: <type>: <line>``); the other checks of the case still run. It is never bad input: the case's files are
the harness's own, read by the reference. When the oracle runs, the row passes and names the version, so a
report (and ``g4h parity --oracle-drift``) says which transformers made the figures.
"""

from __future__ import annotations

from typing import Callable

from ..result import Figure, fig


def transformers_version() -> str:
    """The installed transformers' version (``"not installed"`` without it)."""
    try:
        import transformers  # heavy, and imported by every oracle of the case already
    except ImportError:
        return "not installed"
    return transformers.__version__


def oracle_rows(runs_gate: str, make: Callable[[], list[Figure]], prompt: str | None = None) -> list[Figure]:
    """``[<runs_gate> = 1] + make()``, or, when ``make`` raises, ``[<runs_gate> = 0]`` with the oracle's reason.

    Args:
        runs_gate: the gate that says the oracle ran (``reference~transformers.runs``, ...).
        make: measures the oracle's figures (builds the oracle and compares with it).
        prompt: the row's prompt field (None: the case as a whole).
    """
    version = transformers_version()
    try:
        figs = make()
    except Exception as e:  # the oracle's problem, whatever it raises: its row, with the reason; the case goes on
        line = (str(e).strip().splitlines() or [""])[0]
        why = line if line.startswith("transformers ") else f"transformers {version}: {type(e).__name__}: {line}"
        return [fig(runs_gate, 0.0, prompt, transformers=version, got=f"not run: {why}"[:400])]
    return [fig(runs_gate, 1.0, prompt, transformers=version)] + figs
