"""The case library (``cases/``): built-in model specs and prompt sets.

``cases/`` is data, not code:

* ``cases/models/*.toml``: tiny synthetic model specs (:func:`builtin_specs`; built by :mod:`harness.synth`), and
  beside some a drafter spec ``<name>-assistant.toml`` (:func:`builtin_drafter_specs`);
* ``cases/prompts/*.jsonl``: prompt sets, one ``{"id", "prompt_ids", "note"}`` object a line (read by
  :func:`harness.core.prompts.load_prompts`, the one prompt-file reader);
* ``cases/shapes/*.toml``: real-size text configs with their sources (shape-only models);
* ``cases/bench/*.toml``: benchmark model specs;
* ``cases/tokenizer/``: tokenizer corpora and the Gemma 4 chat template;
* ``cases/data/``: real data the project carries (the Gemma 3 tokenizer model, with its terms).

A *case name* is the stem of a built-in spec (``e2b`` for ``cases/models/e2b.toml``);
:func:`resolve_spec` turns a name or a path into the spec file.
"""

from __future__ import annotations

import os
from pathlib import Path

from gemma4_harness.reference.errors import InputError

from .paths import CASES_DIR

MODELS_DIR = CASES_DIR / "models"
"""Built-in synthetic model specs."""

PROMPTS = CASES_DIR / "prompts" / "synthetic.jsonl"
"""The default prompt set (lengths around and at multiples of the sliding window 16)."""


DRAFTER_SUFFIX = "-assistant"
"""A spec named ``<target>-assistant.toml`` is the MTP drafter of ``<target>.toml`` (:mod:`harness.synth.drafter`),
not a case of its own."""


def builtin_specs() -> list[Path]:
    """The target spec files shipped in ``cases/models/``, sorted by path (absolute paths; may be empty);
    drafter specs (``*-assistant.toml``) are not cases of their own (:func:`builtin_drafter_specs`)."""
    return sorted(p for p in MODELS_DIR.glob("*.toml") if not p.stem.endswith(DRAFTER_SUFFIX))


def builtin_drafter_specs() -> list[Path]:
    """The drafter specs shipped in ``cases/models/`` (``<target>-assistant.toml``), sorted by path."""
    return sorted(p for p in MODELS_DIR.glob("*.toml") if p.stem.endswith(DRAFTER_SUFFIX))


def drafter_spec_for(spec_path: str | os.PathLike) -> Path | None:
    """The drafter spec beside a target spec (``<stem>-assistant.toml``), or None when it has none."""
    p = Path(spec_path)
    cand = p.with_name(f"{p.stem}{DRAFTER_SUFFIX}.toml")
    return cand if cand.is_file() else None


def builtin_names() -> list[str]:
    """Names of the built-in cases (spec stems), sorted."""
    return [p.stem for p in builtin_specs()]


def resolve_spec(name_or_path: str | os.PathLike) -> Path:
    """A built-in case name (``e2b``) or a ``.toml`` path -> the spec file.

    Raises:
        InputError: neither a built-in name nor an existing ``.toml`` file (the built-in names are listed).
    """
    p = Path(name_or_path)
    if p.suffix == ".toml":
        if not p.is_file():
            raise InputError(f"{p}: no such spec file")
        return p
    cand = MODELS_DIR / f"{name_or_path}.toml"
    if cand.is_file():
        return cand
    raise InputError(f"unknown case {str(name_or_path)!r}: expected one of {', '.join(builtin_names())} "
                     "or a .toml spec file")
