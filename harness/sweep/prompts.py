"""The prompt set of a sweep, per group: the prompt file (:func:`harness.core.prompts.load_prompts`, token ids or
text a line) as ids for the group's base file.

Text is tokenized by the harness's own tokenizer of the group's base file (its GGUF vocabulary, or an HF folder's
``tokenizer.json``) through the one text-to-ids path (:func:`harness.tokenizer.prompt_ids.with_prompt_ids`: BOS
added, special-token text parsed), so every file and engine of a group sees the same ids. Every prompt must fit
every group's model (every id inside the vocabulary, the prompt plus the greedy tokens inside the context): one that
does not is bad input naming its file, line and why, never left out
(:func:`harness.core.prompts.refuse_unfit_prompts`).

A sweep keys its rows, logits and resumable runs by a prompt's id as text (``str(id)``: the reader keeps an id as
written, ``1`` or ``"1"``, and compares ids as text).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

from ..core.prompts import refuse_unfit_prompts
from ..tokenizer.prompt_ids import with_prompt_ids


def for_model(prompts: Sequence[dict[str, Any]], model: str | Path, vocab: int, context: int, new_tokens: int,
              source: str | Path) -> list[dict[str, Any]]:
    """The prompts as ids for one group: texts tokenized with the base file's tokenizer; ``{"id", "prompt_ids"}``
    records, the id as text.

    Raises:
        InputError: text prompts and no tokenizer in ``model``; a prompt with an id outside the vocabulary or too long
            for the context (with ``new_tokens`` more): its file and line named, and why.
    """
    ready = with_prompt_ids(prompts, model)
    refuse_unfit_prompts(ready, vocab, context, new_tokens, str(model), source)
    return [{"id": str(p["id"]), "prompt_ids": [int(i) for i in p["prompt_ids"]]} for p in ready]


def digest(prompts: Sequence[dict[str, Any]]) -> str:
    """12 hex digits naming a prompt set's ids (a resumed sweep reruns rows measured on other prompts)."""
    blob = json.dumps([[p["id"], p["prompt_ids"]] for p in prompts])
    return hashlib.sha256(blob.encode()).hexdigest()[:12]
