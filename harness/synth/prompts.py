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
