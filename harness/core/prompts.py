"""Prompt files: the one reader of prompt JSONL (:func:`load_prompts`), the ``--prompt-ids`` list
(:func:`read_prompt_ids`), and the judgement of a prompt set against the model it runs on
(:func:`refuse_unfit_prompts`).

The one grammar of a prompt file (``--prompts FILE.jsonl``, ``cases/prompts/*.jsonl``), one JSON object a line::

    {"text": "Hello world"}
    {"id": "named", "prompt_ids": [2, 9, 10], "note": "what it exercises"}

* exactly one of ``"text"`` (a non-empty string, tokenized later by the model's own tokenizer:
  :func:`harness.tokenizer.prompt_ids.with_prompt_ids`) and ``"prompt_ids"`` (a non-empty list of integer token
  ids ``>= 0``; ``true``/``false`` are not ids);
* ``"id"``, optional: a non-empty string or an integer, kept as written (default: the line number, an integer).
  Ids name requests in reports and key results, where they are compared as text, so ``1`` and ``"1"`` are one id
  and a file holding both is refused;
* ``"note"``, optional: a string (what the prompt exercises); other keys are ignored;
* blank lines are skipped; a file with no prompt is refused.

A caller that takes token ids only (the built-in cases, ``g4h compare``, ``g4h generate``) says so with
``ids_only=True``; a ``{"text"}`` line is then bad input naming its line. Every refusal is a
:class:`reference.errors.PromptError` (exit 2), one line naming the file and line and what was expected.
"""

from __future__ import annotations

import codecs
import json
import os
from pathlib import Path
from collections.abc import Iterator
from typing import Any

from gemma4_harness.reference.errors import PromptError
from gemma4_harness.reference.files import read_bytes

from .cases import PROMPTS

MAX_PROMPT_BYTES = 256 << 20
"""The most a prompt file or prompt set may hold (256 MiB: some 30 million token ids)."""

IDS_FORM = '{"prompt_ids": [int >= 0, ...]}'
TEXT_FORM = '{"text": "..."}'
OPTIONAL = 'with an optional "id" (a string or an integer) and "note"'


def _read(path: Path) -> str:
    """A prompt file's text: a regular file or a pipe, bounded (:func:`reference.files.read_bytes`), UTF-8 (a leading
    BOM dropped); a byte that is not UTF-8 is named by its line and its offset in the file."""
    data = read_bytes(path, max_bytes=MAX_PROMPT_BYTES, error=PromptError)
    start = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[start:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = start + e.start
        line = data.count(b"\n", 0, at) + 1
        raise PromptError(f"{path}:{line}: not UTF-8 text (invalid byte 0x{data[at]:02x} at offset {at})") from None


def _json(text: str, where: str, expected: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise PromptError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); expected {expected}") from None
    except RecursionError:
        raise PromptError(f"{where}: not valid JSON (nested too deeply); expected {expected}") from None


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _token_ids(v: Any) -> bool:
    """Whether ``v`` is a non-empty list of integer token ids ``>= 0``."""
    return isinstance(v, list) and bool(v) and all(_is_id(i) and i >= 0 for i in v)


def _prompt_id(obj: dict[str, Any], where: str, line: int, seen: dict[str, int]) -> str | int:
    """The id of a line: its ``"id"``, else the line number; recorded in ``seen`` (id as text -> line)."""
    pid = obj.get("id", line)
    if isinstance(pid, bool) or not isinstance(pid, (str, int)) or pid == "":
        raise PromptError(f"{where}: \"id\": expected a non-empty string or an integer, got {json.dumps(pid)}")
    if str(pid) in seen:
        raise PromptError(f"{where}: duplicate id {pid!r} (line {seen[str(pid)]} has it too; ids are compared as "
                          "text)")
    seen[str(pid)] = line
    return pid


def jsonl_objects(path: str | os.PathLike, expected: str) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """The JSON objects of a prompt file, one a line: ``(line number, "FILE:LINE", object)``; blank lines skipped.
    Lines end at ``\n`` only (a U+2028 inside a JSON string is no line end, as :meth:`str.splitlines` would take
    it). The reader of every prompt grammar: :func:`load_prompts` and the multimodal set's
    (:func:`harness.core.mm_prompts.load_mm_prompts`).

    Raises:
        PromptError: unreadable, not UTF-8 (the line and offset named), a line that is not JSON or not an object:
            ``FILE:LINE: ...; expected <expected>``.
    """
    path = Path(path)
    for n, line in enumerate(_read(path).split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        obj = _json(line, where, expected)
        if not isinstance(obj, dict):
            raise PromptError(f"{where}: expected {expected}")
        yield n, where, obj


def load_prompts(path: str | os.PathLike = PROMPTS, *, ids_only: bool = False) -> list[dict[str, Any]]:
    """Read a prompt file in the one grammar of this module's docstring.

    Args:
        path: the JSONL file (default: the case library's set, :data:`harness.core.cases.PROMPTS`).
        ids_only: the caller takes token ids only: a ``{"text"}`` line is refused.

    Returns:
        ``[{"id", "prompt_ids" | "text", "note", "where"}, ...]`` in file order: ``id`` as written (or the line
        number), ``note`` (``""`` when not given), ``where`` ``FILE:LINE``.

    Raises:
        PromptError: unreadable file, a byte that is not UTF-8, a line that is not JSON or not one of the forms
            (both keys, neither, an empty or non-string text, ids that are not integers ``>= 0``), an id that is
            neither a non-empty string nor an integer, a duplicate id, a note that is not a string, no prompt. One
            line: ``FILE:LINE: what was expected`` (``FILE: ...`` where no line is at fault).
    """
    path = Path(path)
    expected = (f"{IDS_FORM} (token ids only here, no \"text\")" if ids_only else
                f"{TEXT_FORM} or {IDS_FORM} (one of them, non-empty)") + f", {OPTIONAL}"
    out: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    for n, where, obj in jsonl_objects(path, expected):
        ids, text = obj.get("prompt_ids"), obj.get("text")
        is_text = "text" in obj
        if (is_text and ids_only) or is_text == ("prompt_ids" in obj) or \
                not (isinstance(text, str) and text if is_text else _token_ids(ids)):
            raise PromptError(f"{where}: expected {expected}")
        note = obj.get("note", "")
        if not isinstance(note, str):
            raise PromptError(f"{where}: \"note\": expected a string, got {json.dumps(note)}")
        pid = _prompt_id(obj, where, n, seen)
        body = {"text": text} if is_text else {"prompt_ids": ids}
        out.append({"id": pid, **body, "note": note, "where": where})
    if not out:
        raise PromptError(f"{path}: no prompts (expected {expected}, one a line)")
    return out


def read_prompt_ids(path: str | os.PathLike) -> list[int]:
    """Read ``FILE.json`` (``--prompt-ids``): one non-empty JSON list of integer token ids (their range is checked by
    the engine, against its vocabulary).

    Raises:
        PromptError: unreadable, not UTF-8, not JSON, or not such a list (the file is named).
    """
    path = Path(path)
    ids = _json(_read(path), str(path), "a JSON list of token ids")
    if not isinstance(ids, list) or not ids or not all(_is_id(i) for i in ids):
        raise PromptError(f"{path}: expected a non-empty JSON list of integer token ids")
    return ids


def refuse_unfit_prompts(prompts: list[dict[str, Any]], vocab: int, context: int, new_tokens: int, model: str,
                         source: str | os.PathLike, hint: str = "") -> None:
    """Judge every prompt the user gave against the model it runs on, before any engine work: a prompt is never
    dropped in silence, it is used or the run is refused naming it.

    Args:
        prompts: records with ``prompt_ids`` (a text prompt already tokenized), ``id`` and, where the reader knows
            it, ``where`` (``FILE:LINE``) and ``text``.
        vocab: the model's vocabulary size; context: its context length in tokens; new_tokens: the greedy tokens
            asked after each prompt (``--max-new-tokens``); model: the model, as named in the message.
        source: the prompt file (named when a record has no ``where``).
        hint: what to do, said after the line where given (a server's context: how to start it with a larger one).

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
        raise PromptError(bad[0] + more + (f"; {hint}" if hint else ""))
