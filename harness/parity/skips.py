"""The checks ``g4h parity --skip`` may leave out: one list, with what each name leaves out.

The argument parser takes its choices and its help text from :data:`SKIPPABLE`, :func:`check_skip` refuses any
other name (the pytest plugin's ``--g4h-skip`` and :func:`harness.parity.job.run`), the checks ask
:func:`skipped` (which refuses a name the list lacks), and docs/usage.md holds :func:`skip_table` (printed by
``python -m gemma4_harness.harness.parity.skips``; ``tests/test_docs.py`` holds it equal). A tokenizer check's own name
(:data:`harness.tokenizer.checks.CHECKS`) opts that check out; ``llamacpp`` is both, and means llama.cpp everywhere.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from gemma4_harness.reference.errors import InputError

from ..core.engine_kinds import KINDS
from ..tokenizer.checks import CHECKS as TOKENIZER_CHECKS

__all__ = ["KIND_SKIPS", "SKIPS", "SKIPPABLE", "check_skip", "help_text", "skip_table", "skipped"]

KIND_SKIPS: dict[str, str] = {k.skip: k.skip_help for k in KINDS if k.skip}
"""The names that opt an engine kind out everywhere (its registry row's ``skip`` and ``skip_help``): ``llamacpp``."""

SKIPS: dict[str, str] = {
    **KIND_SKIPS,
    "gemma3-real": "the real Gemma 3 270M GGUF's case, gemma3-270m-real",
    "tokenizer": "the tokenizer case: every tokenizer check",
    "speculative": "the drafter and speculative-decoding checks of the built-in cases",
    "multimodal": "the built-in multimodal cases, cases/models/multimodal/",
    "server-batch": "a server's batch-invariance check, server.batched~alone",
    "server-stream": "a server's streaming check, server.stream~nostream",
    "server-stop": "a server's max_tokens, stop-string and EOS checks, server.stop",
    "server-template": "a server's chat-template check, server.chat_template",
}
"""The names a check asks :func:`skipped` about, with what each leaves out."""


def _summary(fn) -> str:
    """The first line of ``fn``'s docstring, as plain text."""
    return (fn.__doc__ or "").strip().splitlines()[0].replace(":func:", "").replace("``", "`").rstrip(".")


SKIPPABLE: dict[str, str] = {**SKIPS, **{name: f"tokenizer check: {_summary(fn)}"
                                         for name, fn in TOKENIZER_CHECKS if name not in SKIPS}}
"""Every name ``--skip`` takes, with its meaning: :data:`SKIPS`, then each tokenizer check's own name."""


def skipped(skip: Iterable[str], name: str) -> bool:
    """Whether the user opted ``name`` out (``--skip name``).

    Raises:
        ValueError: ``name`` is not in :data:`SKIPPABLE` (a check asking about a name the list lacks).
    """
    if name not in SKIPPABLE:
        raise ValueError(f"{name!r} is not a --skip name (harness/parity/skips.py SKIPPABLE)")
    return name in tuple(skip)


def check_skip(skip: Iterable[str]) -> None:
    """Refuse an unknown ``--skip`` name.

    Raises:
        InputError: a name not in :data:`SKIPPABLE`, naming the valid ones.
    """
    bad = [s for s in skip if s not in SKIPPABLE]
    if bad:
        raise InputError(f"--skip {bad[0]!r}: expected one of {', '.join(SKIPPABLE)}")


def help_text() -> str:
    """``--skip``'s help: each name of :data:`SKIPS` with its meaning, then the tokenizer checks' names."""
    tok = [n for n in SKIPPABLE if n not in SKIPS]
    return ("opt a check out (repeatable): " + "; ".join(f"{n}: {m}" for n, m in SKIPS.items())
            + f"; or one tokenizer check: {', '.join(tok)} (docs/usage.md). A check that cannot run here and was "
              "not opted out fails the run")


def skip_table() -> str:
    """:data:`SKIPPABLE` as a Markdown table (docs/usage.md)."""
    return "\n".join(["| `--skip` | leaves out |", "|---|---|",
                      *(f"| `{n}` | {m.replace('|', chr(92) + '|')} |" for n, m in SKIPPABLE.items())]) + "\n"


if __name__ == "__main__":
    sys.stdout.write(skip_table())
