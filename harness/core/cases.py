"""The case library (``cases/``): built-in model specs, prompt sets, and the prompt-file readers.

``cases/`` is data, not code:

* ``cases/models/*.toml``: tiny synthetic model specs (:func:`builtin_specs`; built by :mod:`harness.synth`), and
  beside some a drafter spec ``<name>-assistant.toml`` (:func:`builtin_drafter_specs`);
* ``cases/prompts/*.jsonl``: prompt sets, one ``{"id", "prompt_ids", "note"}`` object a line
  (:func:`load_prompts`, the one prompt-set reader);
* ``cases/shapes/*.toml``: real-size text configs with their sources (shape-only models);
* ``cases/bench/*.toml``: benchmark model specs;
* ``cases/tokenizer/``: tokenizer corpora and the Gemma 4 chat template;
* ``cases/data/``: real data the project carries (the Gemma 3 tokenizer model, with its terms).

A *case name* is the stem of a built-in spec (``e2b`` for ``cases/models/e2b.toml``);
:func:`resolve_spec` turns a name or a path into the spec file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gemma4_harness.reference.errors import InputError, PromptError
from gemma4_harness.reference.files import read_text

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


MAX_PROMPT_BYTES = 256 << 20
"""The most a prompt file or prompt set may hold (256 MiB: some 30 million token ids)."""


def _read_text(path: Path) -> str:
    """A prompt file's text through the one reader (:func:`reference.files.read_text`: a regular file, or a pipe
    read with a bound and a timeout; UTF-8)."""
    return read_text(path, max_bytes=MAX_PROMPT_BYTES, error=PromptError)


def _json(text: str, where: str, expected: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise PromptError(f"{where}: not valid JSON ({expected})") from None
    except RecursionError:
        raise PromptError(f"{where}: not valid JSON (nested too deeply; {expected})") from None


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def prompt_id(obj: dict[str, Any], line: int, path: Path, seen: set[str]) -> str | int:
    """The id of a prompt-file line: its ``"id"`` (a string or an integer), else the line number; added to ``seen``.

    Ids name requests in reports and key results, where they are compared as text: ``1`` and ``"1"`` are one id.

    Raises:
        PromptError: an id that is neither a string nor an integer (null, a float, a list, ...), or one already
            in ``seen`` (the file and line are named).
    """
    pid = obj.get("id", line)
    if isinstance(pid, bool) or not isinstance(pid, (str, int)) or pid == "":
        raise PromptError(f"{path}:{line}: \"id\": expected a non-empty string or an integer, got {json.dumps(pid)}")
    if str(pid) in seen:
        raise PromptError(f"{path}:{line}: duplicate id {pid!r}")
    seen.add(str(pid))
    return pid


def load_prompts(path: str | os.PathLike = PROMPTS) -> list[dict[str, Any]]:
    """Read a prompt set: JSONL lines ``{"id": ..., "prompt_ids": [int, ...], "note": ...}``.

    ``id`` (a string or an integer) defaults to the line number; ``note`` is optional; blank lines are skipped.

    Returns:
        ``[{"id", "prompt_ids", "note"}, ...]`` in file order.

    Raises:
        PromptError: unreadable or non-UTF-8 file, a line that is not such an object, prompt ids that are not
            a list of integers, an id that is neither a string nor an integer, a duplicate id (compared as
            text), or no prompt (the file and line are named).
    """
    path = Path(path)
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for n, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        obj = _json(line, f"{path}:{n}", 'expected {"id": ..., "prompt_ids": [int, ...]}')
        ids = obj.get("prompt_ids") if isinstance(obj, dict) else None
        if not isinstance(ids, list) or not ids or not all(_is_id(i) for i in ids):
            raise PromptError(f"{path}:{n}: expected {{\"id\": ..., \"prompt_ids\": [int, ...]}}")
        pid = prompt_id(obj, n, path, seen)
        out.append({"id": pid, "prompt_ids": ids, "note": obj.get("note", "")})
    if not out:
        raise PromptError(f"{path}: no prompts")
    return out


def read_prompt_ids(path: str | os.PathLike) -> list[int]:
    """Read ``FILE.json``: a non-empty JSON list of integer token ids (their range is checked by the engine, against its vocabulary).

    Raises:
        PromptError: unreadable, not UTF-8, not JSON, or not such a list (the file is named).
    """
    path = Path(path)
    ids = _json(_read_text(path), str(path), "expected a JSON list of token ids")
    if not isinstance(ids, list) or not ids or not all(_is_id(i) for i in ids):
        raise PromptError(f"{path}: expected a non-empty JSON list of integer token ids")
    return ids


def refuse_unfit_prompts(prompts: list[dict[str, Any]], vocab: int, context: int, new_tokens: int, model: str,
                         source: str | os.PathLike) -> None:
    """Judge every prompt the user gave against the model it runs on, before any engine work: a prompt is never
    dropped in silence, it is used or the run is refused naming it.

    Args:
        prompts: records with ``prompt_ids`` (a text prompt already tokenized), ``id`` and, where the reader knows
            it, ``where`` (``FILE:LINE``) and ``text``.
        vocab: the model's vocabulary size; context: its context length in tokens; new_tokens: the greedy tokens
            asked after each prompt (``--max-new-tokens``); model: the model, as named in the message.
        source: the prompt file (named when a record has no ``where``).

    Raises:
        PromptError: the first prompt with a token id outside ``[0, vocab)``, or longer than ``context - new_tokens``
            tokens (one line: file and line, the prompt's id, the id or the lengths, and how many more do not fit).
    """
    bad = []
    for p in prompts:
        ids = list(p["prompt_ids"])
        where = p.get("where") or f"{source}"
        what = f"prompt {p['id']!r}" + (" (its text tokenized)" if "text" in p else "")
        out = next((i for i in ids if not 0 <= int(i) < vocab), None)
        if out is not None:
            bad.append(f"{where}: {what}: token id {out} is outside the vocabulary of {model} (ids 0 to {vocab - 1})")
        elif len(ids) + new_tokens > context:
            bad.append(f"{where}: {what}: {len(ids)} tokens and {new_tokens} new tokens (--max-new-tokens) do not fit "
                       f"the context of {model} ({context} tokens: at most {max(context - new_tokens, 0)} prompt "
                       "tokens)")
    if bad:
        more = f" ({len(bad) - 1} more prompt(s) do not fit either)" if len(bad) > 1 else ""
        raise PromptError(bad[0] + more)
