"""The prompt set of a sweep: token ids (``{"prompt_ids": [...]}``) or text (``{"text": "..."}``) a line.

Text is tokenized by the harness's own tokenizer of the group's base file (its GGUF vocabulary, or an HF folder's
``tokenizer.json``), BOS added and special-token text parsed, so every file and engine of a group sees the same ids.
Every prompt must fit every group's model (every id inside the vocabulary, the prompt plus the greedy tokens inside
the context): one that does not is bad input naming its file, line and why, never left out
(:func:`harness.core.cases.refuse_unfit_prompts`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

from gemma4_harness.reference.errors import InputError, PromptError
from gemma4_harness.reference.tokenizer import GGUFTokenizer

from ..core.cases import refuse_unfit_prompts
from ..tokenizer.files import load_tokenizer_metadata


def load(path: str | Path) -> list[dict[str, Any]]:
    """Read a prompt file: ``{"prompt_ids": [int, ...]}`` or ``{"text": "..."}`` a line, optional ``"id"`` (default the
    line number); blank lines skipped.

    Raises:
        PromptError: unreadable or non-UTF-8 file, a line of neither form, a duplicate id, no prompt (file and line
            named).
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise PromptError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise PromptError(f"{path}: cannot read ({e.strerror or e})") from None
    out, seen = [], set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise PromptError(f"{path}:{n}: not valid JSON") from None
        ids = obj.get("prompt_ids") if isinstance(obj, dict) else None
        text = obj.get("text") if isinstance(obj, dict) else None
        good_ids = isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                         for i in ids)
        if (ids is None) == (text is None) or (text is not None and not (isinstance(text, str) and text)) or \
                (ids is not None and not good_ids):
            raise PromptError(f"{path}:{n}: expected {{\"prompt_ids\": [int >= 0, ...]}} or {{\"text\": \"...\"}} (one "
                              "of them, non-empty), with an optional \"id\"")
        pid = obj.get("id", n)
        if str(pid) in seen:
            raise PromptError(f"{path}:{n}: duplicate id {pid!r}")
        seen.add(str(pid))
        where = f"{path}:{n}"
        out.append({"id": str(pid), "text": text, "where": where} if text is not None else
                   {"id": str(pid), "prompt_ids": ids, "where": where})
    if not out:
        raise PromptError(f"{path}: no prompts")
    return out


def for_model(prompts: Sequence[dict[str, Any]], model: str | Path, vocab: int, context: int, new_tokens: int,
              source: str | Path) -> list[dict[str, Any]]:
    """The prompts as ids for one group: texts tokenized with the base file's tokenizer.

    Raises:
        InputError: text prompts and no tokenizer in ``model``; a prompt with an id outside the vocabulary or too long
            for the context (with ``new_tokens`` more): its file and line named, and why.
    """
    tok = None
    out = []
    for p in prompts:
        if "prompt_ids" in p:
            ids = list(p["prompt_ids"])
        else:
            if tok is None:
                m = Path(model)
                src = m / "tokenizer.json" if m.is_dir() else m
                if not src.is_file():
                    raise InputError(f"{m}: no tokenizer.json in this folder (the text prompts of {source} need one)")
                tok = GGUFTokenizer(load_tokenizer_metadata(src), source=str(src))
            ids = tok.encode(p["text"], add_bos=True, parse_special=True)
        refuse_unfit_prompts([{**p, "prompt_ids": ids}], vocab, context, new_tokens, str(model), source)
        out.append({"id": p["id"], "prompt_ids": [int(i) for i in ids]})
    return out


def digest(prompts: Sequence[dict[str, Any]]) -> str:
    """12 hex digits naming a prompt set's ids (a resumed sweep reruns rows measured on other prompts)."""
    blob = json.dumps([[p["id"], p["prompt_ids"]] for p in prompts])
    return hashlib.sha256(blob.encode()).hexdigest()[:12]
