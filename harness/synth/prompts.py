"""The synthetic prompt set (``cases/prompts/synthetic.jsonl``): how it was made, so a test can remake it.

Prompts are BOS then byte-token ids (valid in every spec's vocabulary), with lengths around and at
multiples of the built-in cases' sliding window (16). :func:`harness.core.cases.load_prompts` reads
the committed file.
"""

from __future__ import annotations

from typing import Any

import numpy as np

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
