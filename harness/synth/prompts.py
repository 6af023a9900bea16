"""The synthetic prompt set (``cases/prompts/synthetic.jsonl``): how it was made, so a test can remake it.

Prompts are BOS then byte-token ids (valid in every spec's vocabulary), with lengths around and at
multiples of the built-in cases' sliding window (16). :func:`harness.core.prompts.load_prompts` reads
the committed file.

Random byte tokens are rarely UTF-8, so a server that takes text prompts only (llama-cpp-python's, the generic
OpenAI dialect) cannot be sent them: for such a server the set is remade as text of the model's own vocabulary,
the same names and lengths, by :func:`text_prompt` (docs/usage.md, "Prompts").
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from gemma4_harness.reference.tokenizer import BYTE, NORMAL

from .gguf import BOS_ID, BYTE_BASE

#: (id, length, note) of the synthetic prompts; lengths are relative to sliding_window = 16.
PROMPT_LAYOUT: tuple[tuple[str, int, str], ...] = (
    ("len1-bos", 1, "BOS only"),
    ("len5", 5, "short"),
    ("len15-window-1", 15, "sliding_window - 1"),
    ("len16-window", 16, "exactly sliding_window"),
    ("len17-window+1", 17, "sliding_window + 1: first position whose window drops a key"),
    ("len32-2xwindow", 32, "2 x sliding_window"),
    ("len48-3xwindow", 48, "3 x sliding_window"),
    ("len83-5xwindow+3", 83, "5 x sliding_window + 3"),
)
PROMPT_SEED = 20260401


def make_prompts(seed: int = PROMPT_SEED) -> list[dict[str, Any]]:
    """Generate the synthetic prompt set (what ``cases/prompts/synthetic.jsonl`` holds).

    Args:
        seed: numpy ``default_rng`` seed.

    Returns:
        One dict per :data:`PROMPT_LAYOUT` entry: ``id``, ``prompt_ids`` (BOS id 2,
        then ids uniform in [4, 256): byte tokens, valid in every spec's
        vocabulary), ``note``.
    """
    rng = np.random.default_rng(seed)
    out = []
    for pid, n, note in PROMPT_LAYOUT:
        ids = [BOS_ID] + [int(x) for x in rng.integers(BYTE_BASE, 256, size=n - 1)]
        out.append({"id": pid, "prompt_ids": ids, "note": note})
    return out


def layout_name(n: int, window: int | None) -> str:
    """The name of a :data:`PROMPT_LAYOUT` prompt of ``n`` tokens for a model whose sliding window is ``window``
    (None: no sliding layers): ``len{n}``, then where ``n`` stands to the window (``-window-1``, ``-window``,
    ``-window+1``, ``-window+2``, ``-{k}xwindow``, ``-{k}xwindow+r`` for r up to 3), ``len1-bos`` for BOS alone. For
    the built-in cases' window of 16 these are the layout's own names; on another model they say what its own window
    makes of the prompt (a ``len16-window`` prompt on a model whose window is 3 is ``len16-5xwindow+1``)."""
    if n == 1:
        return "len1-bos"
    name = f"len{n}"
    if not window or window < 2:
        return name
    k, r = divmod(n, window)
    if n == window - 1:
        return f"{name}-window-1"
    if k == 1 and r <= 3:
        return f"{name}-window" + (f"+{r}" if r else "")
    if k >= 2 and r <= 3:
        return f"{name}-{k}xwindow" + (f"+{r}" if r else "")
    return name


WINDOW_NAMED = "window_named"
"""The key that marks a record of the synthetic set as the harness's own default (``g4h parity --model`` without
``--prompts``): only such records are renamed by :func:`named_for_window` (a user's file keeps its names)."""


def named_for_window(prompts: list[dict[str, Any]], window: int | None) -> list[dict[str, Any]]:
    """``prompts`` with every record of the default synthetic set (marked :data:`WINDOW_NAMED`, an id of
    :data:`PROMPT_LAYOUT` with that layout's length) renamed by :func:`layout_name` for ``window``, the mark dropped;
    other records as they are. A new name that another record already has keeps the old one."""
    lengths = {pid: n for pid, n, _ in PROMPT_LAYOUT}
    taken = {str(p.get("id")) for p in prompts}
    out = []
    for p in prompts:
        pid = str(p.get("id"))
        if not p.get(WINDOW_NAMED):
            out.append(p)
            continue
        p = {k: v for k, v in p.items() if k != WINDOW_NAMED}
        if lengths.get(pid) == len(p.get("prompt_ids") or ()):
            new = layout_name(lengths[pid], window)
            if new != pid and new not in taken:
                taken.add(new)
                p = {**p, "id": new}
        out.append(p)
    return out


TEXT_TRIES = 256
"""Candidate tokens :func:`text_prompt` draws for one step before it gives the prompt up."""


def text_pieces(tokens: Sequence[str], types: Sequence[int]) -> tuple[list[int], list[str]]:
    """The tokens a default text prompt is drawn from, and the text each spells: normal tokens whose piece (``▁`` as
    a space) is printable text, and byte tokens of printable ASCII (``<0x20>`` to ``<0x7E>``: one character each).
    Control, unknown, user-defined and unused tokens and the other byte tokens are left out (a server renders them
    differently, or they are no text of their own)."""
    ids, texts = [], []
    for tid, (piece, ty) in enumerate(zip(tokens, types)):
        if ty == NORMAL:
            text = piece.replace("\u2581", " ")
        elif ty == BYTE and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                text = chr(int(piece[3:5], 16))
            except ValueError:
                continue
            text = text if " " <= text <= "~" else ""
        else:
            continue
        if text and text.isprintable():
            ids.append(tid)
            texts.append(text)
    return ids, texts


def text_prompt(tok: Any, encode: Callable[[str], list[int]], n: int, seed: int = PROMPT_SEED,
                tries: int = TEXT_TRIES, pieces: tuple[list[int], list[str]] | None = None) -> str | None:
    """A text whose ids are ``n`` tokens long and survive the round trip ids -> text -> ids, built token by token.

    Each step draws up to ``tries`` tokens of :func:`text_pieces` (numpy ``default_rng((seed, n))``: the same text
    for the same vocabulary, whichever other prompts are made) and appends the first whose text keeps the ids made so
    far (it does not merge with its neighbour), grows them by exactly that token, and leaves ``encode(decode(ids))``
    equal to the ids (``decode`` after BOS: the text a server's detokenizer gives back); when none of the draws adds
    exactly its own token (a vocabulary where a character has no token of its own and falls back to bytes, such as
    the synthetic one's leading ``▁``), the first draw that passes the other tests and adds several. A token that
    merges, that text encodes otherwise, or that would pass ``n`` is skipped, and so is a first token whose text starts
    with whitespace (where tokenizers part: whether a space prefix goes in front of a text that has one).

    Args:
        tok: the model's tokenizer (:class:`reference.tokenizer.GGUFTokenizer`: ``tokens``, ``types``, ``bos_id``,
            ``decode``).
        encode: text -> the ids the run uses (:func:`harness.tokenizer.prompt_ids.text_ids`: BOS added, special-token
            text parsed).
        n: the length in tokens (BOS included); seed: the draws' seed.
        pieces: :func:`text_pieces` of ``tok`` (made here when None; pass it to make several prompts).

    Returns:
        the text (``""`` for ``n`` 1 with a BOS), or None when no text of ``n`` tokens was found (a step none of its
        draws could take, or ``n`` below what the empty text encodes to).
    """
    ids_pool, texts = pieces or text_pieces(tok.tokens, tok.types)
    text, ids = "", encode("")
    if not ids_pool or len(ids) > n:
        return None
    rng = np.random.default_rng((seed, n))
    while len(ids) < n:
        step = None
        for k in rng.integers(0, len(ids_pool), size=tries):
            cand = text + texts[k]
            if cand[0].isspace():  # where tokenizers part: a space prefix added to it or not (llama.cpp, SentencePiece)
                continue
            got = encode(cand)
            if len(got) <= len(ids) or len(got) > n or got[:len(ids)] != ids or not _round_trips(tok, encode, got):
                continue
            if got == ids + [ids_pool[k]]:
                step = (cand, got)
                break
            step = step or (cand, got)
        if step is None:
            return None
        text, ids = step
    return text if ids else None


def _round_trips(tok: Any, encode: Callable[[str], list[int]], ids: list[int]) -> bool:
    """Whether the text of ``ids`` (after BOS: what a server detokenizes) encodes back to ``ids``."""
    body = ids[1:] if tok.bos_id is not None and ids[:1] == [tok.bos_id] else ids
    return encode(tok.decode(body)) == ids
