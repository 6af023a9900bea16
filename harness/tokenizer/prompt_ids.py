"""The one text-to-ids path of prompts: a ``{"text"}`` prompt (:func:`harness.core.prompts.load_prompts`) becomes
token ids through the model's own tokenizer, as a server tokenizes a text prompt.

* :func:`model_tokenizer`: our tokenizer of the model (:class:`reference.tokenizer.GGUFTokenizer` on a GGUF's
  vocabulary, or on an HF folder's ``tokenizer.json``);
* :func:`text_ids`: one text -> ids, BOS added and special-token text parsed; a text that starts with ``<bos>`` gets
  the added BOS too (``"<bos>hi"`` is ``[2, 2, ...]``), as llama.cpp's ``llama_tokenize(add_special=true,
  parse_special=true)`` and transformers' Gemma tokenizer give it (issue 35; the rule is
  :meth:`reference.tokenizer.GGUFTokenizer.encode`'s, held to both by tests/test_tokenizer.py);
* :func:`with_prompt_ids`: a prompt set with ``prompt_ids`` on every record, what ``g4h parity --model``,
  ``g4h explain --prompts`` and ``g4h sweep`` run on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.tokenizer import GGUFTokenizer

from .files import load_tokenizer_metadata


def model_tokenizer(path: str | Path) -> GGUFTokenizer:
    """Our tokenizer of the model at ``path``: the GGUF's vocabulary, or an HF folder's ``tokenizer.json``.

    Raises:
        InputError: no tokenizer there (the path is named).
    """
    p = Path(path)
    src = p / "tokenizer.json" if p.is_dir() else p
    if not src.is_file():
        raise InputError(f"{p}: no tokenizer.json in this folder (text prompts need our tokenizer of the model)")
    return GGUFTokenizer(load_tokenizer_metadata(src), source=str(src))


def text_ids(tok: GGUFTokenizer, text: str) -> list[int]:
    """Our ids of a text prompt: BOS added (also before a ``<bos>`` the text starts with), special-token text parsed,
    as a server tokenizes a text prompt."""
    return [int(i) for i in tok.encode(text, add_bos=True, parse_special=True)]


def with_prompt_ids(prompts: Sequence[dict[str, Any]], path: str | Path) -> list[dict[str, Any]]:
    """The prompts with ``prompt_ids`` on each: a ``{"text"}`` record gets our tokenizer's ids of the model at ``path``
    (:func:`text_ids`) and keeps its text (a server's tokenizer check reads it, and a refusal says the ids are its
    text's); an ids record is as it was. The tokenizer is read only when some record is text.

    Raises:
        InputError: text prompts, and no tokenizer in the model (the path is named).
    """
    if not any("prompt_ids" not in p for p in prompts):
        return list(prompts)
    tok = model_tokenizer(path)
    return [p if "prompt_ids" in p else {**p, "prompt_ids": text_ids(tok, p["text"])} for p in prompts]
