"""Spec variants as data: every known rule where Gemma 4 implementations differ from the reference, with its sources
and the one small override that runs the reference under it (:mod:`.core` says how).

* :data:`VARIANTS`: name -> :class:`Variant`, the text decoder's (:mod:`.text`), the multimodal merge's (:mod:`.mm`)
  and the MTP drafter's (:mod:`.drafter`);
* :func:`parse_spec`: ``--spec VARIANT[,VARIANT]`` as variants (bad input is one line);
* :func:`under`: the reference (and the fast twin where a variant has a fast form) under chosen variants;
* :func:`markdown`: ``docs/spec-variants.md``, generated from this catalogue (``python -m gemma4_harness.harness.engines.variants``
  prints it; a test checks the file is up to date).

The parity job, ``g4h compare``, ``g4h diff`` and ``g4h explain`` use the catalogue to name the variant that explains
a divergence (:mod:`harness.parity.explain`).
"""

from __future__ import annotations

import contextlib
import re
import sys
from typing import Iterable, Sequence

from gemma4_harness.reference.errors import InputError

from .core import COMMAND_SPEC, KINDS, Patch, Source, Variant, conflict, under
from .drafter import DRAFTER_VARIANTS
from .mm import MM_VARIANTS
from .text import TEXT_VARIANTS

__all__ = ["FAMILIES", "KINDS", "Patch", "Source", "VARIANTS", "Variant", "activate_spec", "active",
           "conflict", "family", "markdown", "parse_spec", "spec_context", "under"]

VARIANTS: dict[str, Variant] = {v.name: v for v in (*TEXT_VARIANTS, *MM_VARIANTS, *DRAFTER_VARIANTS)}
"""Every variant by name, in catalogue order (within a family: the disagreements between published
implementations first, then approximations, then faults)."""

FAMILIES = ("text", "multimodal", "drafter")


def family(name: str) -> tuple[Variant, ...]:
    """The variants of one family (:data:`FAMILIES`), in catalogue order."""
    return tuple(v for v in VARIANTS.values() if v.family == name)


def parse_spec(text: str | Sequence[str] | None, what: str = "--spec") -> tuple[Variant, ...]:
    """``VARIANT[,VARIANT...]`` (or a list of such strings) as variants, in the order given.

    Raises:
        InputError: an unknown name (the known ones listed), a name given twice, or two variants of one rule.
    """
    if not text:
        return ()
    parts = [text] if isinstance(text, str) else list(text)
    names = [n.strip() for part in parts for n in part.split(",") if n.strip()]
    out: list[Variant] = []
    for n in names:
        if n not in VARIANTS:
            raise InputError(f"{what} {n!r}: not a known variant (known: {', '.join(VARIANTS)}; "
                             "docs/spec-variants.md describes them)")
        v = VARIANTS[n]
        clash = next((o for o in out if conflict(o, v)), None)
        if clash is not None:
            why = "given twice" if clash.name == n else f"another form of the rule of {clash.name!r}"
            raise InputError(f"{what} {n!r}: {why}")
        out.append(v)
    return tuple(out)


def spec_context(text: str | Sequence[str] | None) -> contextlib.AbstractContextManager:
    """The context a ``g4h`` command runs in for ``--spec``: the variants applied (reference and fast) and named by
    :func:`active` (the parity job hands them to the case workers it spawns); a no-op without ``--spec``.

    Raises:
        InputError: see :func:`parse_spec`.
    """
    variants = parse_spec(text)
    return under(variants, fast=True, spec=True) if variants else contextlib.nullcontext()


_ACTIVE: list[contextlib.ExitStack] = []


def activate_spec(names: Sequence[str]) -> tuple[str, ...]:
    """In a worker process: apply the variants ``names`` (the parent's :func:`active`, handed over as an argument:
    ``harness.parity.job``'s worker initializer) for the rest of the process, as the command's ``--spec``; returns
    :func:`active`. Once per process: a second call applies nothing more.

    Raises:
        InputError: see :func:`parse_spec` (the parent checked the names: a caller's mistake).
    """
    variants = parse_spec(list(names))
    if variants and not _ACTIVE:
        stack = contextlib.ExitStack()
        stack.enter_context(under(variants, fast=True, spec=True))
        _ACTIVE.append(stack)
    return active()


def active() -> tuple[str, ...]:
    """The variants this process runs the reference under for the whole command (``--spec``), by name
    (:data:`.core.COMMAND_SPEC`)."""
    return tuple(COMMAND_SPEC)


# --------------------------------------------------------------------------- docs/spec-variants.md


def _override_name(v: Variant) -> str:
    f = v.override  # named by its place in the repository, without the gemma4_harness. prefix
    return f"`{f.__module__.removeprefix('gemma4_harness.')}.{f.__name__}`" if f is not None else "(none)"


def _cell(text: str) -> str:
    """One Markdown table cell or line: whitespace collapsed, Sphinx roles dropped (``:func:`x``` -> ```x```),
    pipes escaped, reST double backquotes as single."""
    text = re.sub(r":\w+:`", "`", " ".join(text.split())).replace("``", "`")
    return text.replace("|", "\\|")


def markdown() -> str:
    """``docs/spec-variants.md``: the catalogue as tables, one section per variant with its sources (generated; do
    not edit the file by hand: ``python -m gemma4_harness.harness.engines.variants > docs/spec-variants.md``)."""
    lines = ["# Spec variants", "",
             "<!-- generated by `python -m gemma4_harness.harness.engines.variants > docs/spec-variants.md`: edit "
             "harness/engines/variants/, not this file (tests/test_variants.py checks it is up to date) -->", "",
             "Every rule where a Gemma 4 implementation is known to compute something other than the reference: "
             "a *disagreement* between published implementations (transformers 5.23, llama.cpp as vendored in "
             "llama-cpp-python 0.3.36, Google's JAX `gemma` 4.0.1), an *approximation* one of them makes on purpose, "
             "or a *fault* engines are known to make (the self-test's mutant families). Each is one small override of "
             "the reference (`harness/engines/variants/`). `--spec NAME[,NAME]` runs the reference (and the fast "
             "twin, where the variant has a fast form) under chosen variants for any `g4h` command; a failing pair "
             "(`g4h parity`, `g4h compare`, `g4h diff`, `g4h explain`) is re-run under the variants whose first trace "
             "point is where the engine first diverges, and the report names the one that makes the engine agree "
             "(`docs/design.md`, \"Explaining a divergence\").", ""]
    for fam in FAMILIES:
        vs = family(fam)
        lines += [f"## {fam}", "", "| variant | kind | what the engine computes | the reference | followed by | fast |",
                  "|---|---|---|---|---|---|"]
        for v in vs:
            lines.append(f"| [`{v.name}`](#{v.name.replace('_', '-')}) | {v.kind} | {_cell(v.description)} | "
                         f"{_cell(v.reference)} | {_cell(', '.join(v.followed_by) or '(none: a fault)')} | "
                         f"{'yes' if v.has_fast else 'reference only'} |")
        lines.append("")
    for fam in FAMILIES:
        for v in family(fam):
            doc = _cell((v.override.__doc__ or "").strip()) if v.override else ""
            lines += [f"### {v.name}", "", f"{v.kind}, {v.family}: {v.description}.", "",
                      f"- the reference: {v.reference}",
                      f"- followed by: {', '.join(v.followed_by) or 'none (a fault)'}",
                      f"- override: {_override_name(v)}: {doc}",
                      f"- combines with any variant outside its rule (`{v.group}`)", "- sources:"]
            lines += [f"  - {s.project} `{s.where}`: {_cell(s.says)}" for s in v.sources]
            lines.append("")
    return "\n".join(lines)


def main(argv: Iterable[str] | None = None) -> int:
    """``python -m gemma4_harness.harness.engines.variants``: print :func:`markdown`."""
    sys.stdout.write(markdown())
    return 0
