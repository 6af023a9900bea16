"""Tokenizer corpora and the comparison of two tokenizer engines on them.

* Corpora (``cases/tokenizer/``, format in its README): :func:`load_corpus` reads ``*.txt`` (one text a
  line, with the escapes of :func:`unescape`) and ``*.jsonl`` files into :class:`CorpusText`.
* :func:`compare_engines` encodes every text with two engines (:mod:`harness.tokenizer.engines`) and lists
  the texts whose ids differ, with the first differing position (:func:`first_difference`) and both
  sides' pieces there (:func:`format_diff` prints one). An engine crash is let through: the engine
  failed, not a text.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.files import read_text

from ..core.paths import CASES_DIR
from .engines import TokEngine, is_engine_crash

# --------------------------------------------------------------------------- corpora


@dataclass(frozen=True)
class CorpusText:
    """One corpus text and where it came from (``file:line``)."""

    source: str
    text: str


_ESCAPE = re.compile(r"\\(U[0-9A-Fa-f]{8}|u[0-9A-Fa-f]{4}|[nrt\\]|[uU])")  # a bare u/U: a truncated code point


def unescape(line: str) -> str:
    """Decode the corpus escapes: ``\\n \\r \\t \\\\ \\uXXXX \\UXXXXXXXX``; other backslashes stay.

    Source: ``cases/tokenizer/README.md`` (the format of the corpora).

    Raises:
        InputError: an escape that names no character text can hold (a surrogate, or beyond U+10FFFF), or a
            ``\\u`` / ``\\U`` without its 4 / 8 hex digits (a truncated code point; other unknown escapes, such as
            ``\\x`` or ``\\d``, stay as they are, as the format says).
    """
    def sub(m: re.Match) -> str:
        e = m.group(1)
        if e in ("u", "U"):
            want = 4 if e == "u" else 8
            got = m.string[m.end():m.end() + want]
            raise InputError(f"escape \\{e}{got}: expected \\{e} and {want} hex digits (a truncated code point)")
        if e[0] in "uU":
            code = int(e[1:], 16)
            if 0xD800 <= code <= 0xDFFF or code > 0x10FFFF:
                raise InputError(f"escape \\{e}: U+{code:04X} is not a character (a surrogate or beyond U+10FFFF)")
            return chr(code)
        return {"n": "\n", "r": "\r", "t": "\t", "\\": "\\"}[e]

    return _ESCAPE.sub(sub, line)


def default_corpus_dir() -> Path:
    """``cases/tokenizer`` (:data:`harness.core.paths.CASES_DIR`: the clone's, or the installed package's copy)."""
    return CASES_DIR / "tokenizer"


def load_corpus(path: str | os.PathLike | None = None) -> list[CorpusText]:
    """Texts of a corpus folder (every ``*.txt`` and ``*.jsonl``, sorted) or of one such file.

    ``.txt``: one text per line with the escapes of :func:`unescape`, empty
    lines skipped. ``.jsonl``: one ``{"text": ...}`` object per line.

    Raises:
        InputError: missing path, a folder without corpus files, an unreadable
            file, a bad JSONL line.
    """
    p = Path(path) if path is not None else default_corpus_dir()
    if p.is_dir():
        files = sorted(list(p.glob("*.txt")) + list(p.glob("*.jsonl")))
        if not files:
            raise InputError(f"{p}: no corpus files (*.txt, *.jsonl)")
    elif p.exists():
        files = [p]  # a regular file, or a pipe (read_text takes both and refuses the rest)
    else:
        raise InputError(f"{p}: no such corpus file or folder")
    out: list[CorpusText] = []
    for f in files:
        raw = read_text(f, "corpus")
        for n, line in enumerate(raw.split("\n"), 1):
            if not line:
                continue
            if f.suffix == ".jsonl":
                try:
                    text = json.loads(line)["text"]
                    if not isinstance(text, str):
                        raise TypeError
                except (ValueError, KeyError, TypeError):
                    raise InputError(f"{f}:{n}: expected a JSON object with a string 'text'") from None
            else:
                text = unescape(line)
            out.append(CorpusText(f"{f.name}:{n}", text))
    return out


# --------------------------------------------------------------------------- comparison


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _encode_each(engine: TokEngine, texts: list[str]) -> list[list[int] | Exception]:
    """Ids of each text, or the exception the engine raised on it (an engine failing on a text is a finding).

    All texts go through :meth:`TokEngine.encode_many` at once; when that raises, text by text.

    Raises:
        EngineCrashed: the engine's process died: it failed, not one text.
    """
    try:
        return list(engine.encode_many(texts))
    except Exception as e:  # noqa: BLE001
        if is_engine_crash(e):
            raise
    out: list[list[int] | Exception] = []
    for t in texts:
        try:
            out.append(engine.encode(t))
        except Exception as e:  # noqa: BLE001
            if is_engine_crash(e):
                raise
            out.append(e)
    return out


def compare_engines(a: TokEngine, b: TokEngine, texts: Iterable[CorpusText | str],
                    max_examples: int | None = None) -> dict:
    """Encode every text with both engines and list the ones whose ids differ.

    Returns:
        JSON-able ``{"a", "b", "texts", "differing", "diffs": [...]}``; each
        diff has ``source``, ``text``, ``position`` (first differing index),
        ``a_ids``/``b_ids`` and ``a_pieces``/``b_pieces`` from 2 before that
        position to 4 after, and ``error`` when an engine raised on the text.
        ``diffs`` is cut at ``max_examples`` (``differing`` counts all).

    Raises:
        EngineCrashed: an engine's worker process died (llama.cpp aborted): the engine failed, so there is
            no comparison; ``str(err)`` is ``engine crashed: ...``.
    """
    items = [(it.source, it.text) if isinstance(it, CorpusText) else (f"#{k}", it) for k, it in enumerate(texts)]
    all_a = _encode_each(a, [t for _, t in items])
    all_b = _encode_each(b, [t for _, t in items])
    diffs: list[dict] = []
    n = differing = 0
    for (src, text), ia, ib in zip(items, all_a, all_b):
        n += 1
        err = None
        if isinstance(ia, Exception):
            ia, err = None, f"{a.name}: {type(ia).__name__}: {ia}"
        if isinstance(ib, Exception):
            ib, err = None, (err + "; " if err else "") + f"{b.name}: {type(ib).__name__}: {ib}"
        if err is None and ia == ib:
            continue
        differing += 1
        if max_examples is not None and len(diffs) >= max_examples:
            continue
        d: dict = {"source": src, "text": text}
        if err is not None:
            d["error"] = err
        else:
            pos = first_difference(ia, ib)
            lo, hi = max(0, pos - 2), pos + 5
            d.update(position=pos, a_ids=ia[lo:hi], b_ids=ib[lo:hi],
                     a_pieces=a.pieces(ia[lo:hi]), b_pieces=b.pieces(ib[lo:hi]), window_start=lo)
        diffs.append(d)
    return {"a": a.describe(), "b": b.describe(), "texts": n, "differing": differing, "diffs": diffs}


def format_diff(d: dict) -> str:
    """One human line for a diff of :func:`compare_engines`."""
    text = d["text"] if len(d["text"]) <= 60 else d["text"][:57] + "..."
    if "error" in d:
        return f"{d['source']}: {text!r}: {d['error']}"
    return (f"{d['source']}: {text!r}: first difference at token {d['position']}: "
            f"{d['a_pieces']} {d['a_ids']} vs {d['b_pieces']} {d['b_ids']}")
