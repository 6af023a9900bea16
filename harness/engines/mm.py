"""Engines for multimodal prompts: the reference, the fast path and transformers, over one prepared prompt.

A prompt is prepared once (:func:`reference.mm_model.prepare_prompt`: the media preprocessed by our image
processor and mel front end, the placeholders expanded); every engine then takes the same pixels and
features, so the figures of one stage are not blurred by another (the preprocessing is compared with
transformers' processors on its own: :mod:`harness.parity.checks.multimodal`). Each engine has

* ``soft_tokens(prompt, trace=None)`` -> the projected soft tokens of every item, in prompt order (encoder
  trace points prefixed ``v<i>.`` / ``a<j>.``, :func:`reference.mm_model.item_prefix`);
* ``logits(prompt, trace=None, embeds=None)`` -> ``[T, V]`` over the expanded prompt; ``embeds`` injects the
  given soft tokens (``[n, h]``, prompt order) instead of the engine's own (the merge checked alone);
* ``generate_full(prompt, max_new_tokens)`` -> :class:`harness.engines.base.Generated`-like greedy tokens
  with top-5 log-probabilities (``mm_token_type_ids`` on the prefill only, as transformers' ``generate``).

Engines: ``reference`` (float64, here), ``fast`` (torch; ``device``, ``dtype``: :mod:`.mm_fast`),
``transformers`` (``Gemma4ForConditionalGeneration``, eager; an HF folder only; float32, the oracle, or
float64: :mod:`.mm_transformers`). :func:`make_mm_engine` imports the torch ones only when asked for.
"""

from __future__ import annotations

import importlib
import os
from typing import Sequence

import numpy as np

from gemma4_harness.reference import model as RM
from gemma4_harness.reference.errors import PromptError
from gemma4_harness.reference.mm_model import (
    MultimodalModel,
    MultimodalPrompt,
    encode_item,
    item_prefix,
    load_multimodal,
    prefixed,
)
from gemma4_harness.reference.model import TraceFn

from ..core.engine_kinds import KIND, ORACLE, multimodal_kinds
from .base import EngineUnavailable, Generated
from .checked import CheckedEngine

MM_ENGINES = multimodal_kinds()
"""The engines that take images and audio (the registry rows with ``multimodal``: reference, transformers, fast)."""


def check_rows(prompt: MultimodalPrompt, rows: Sequence[np.ndarray]) -> None:
    """Each item's rows must number its soft tokens.

    Raises:
        PromptError: one line naming the item and both counts.
    """
    for it, r in zip(prompt.items, rows):
        if r.shape[0] != it.n_soft:
            raise PromptError(f"{it.source}: the encoder gave {r.shape[0]} soft tokens for {it.n_soft} placeholders")


class ReferenceMM:
    """The float64 reference: :mod:`reference.vision`, :mod:`reference.audio`, :func:`reference.model.forward`."""

    name = ORACLE

    def __init__(self, mm: MultimodalModel):
        self.mm = mm

    @classmethod
    def for_model(cls, mm: MultimodalModel, device: str | None = None, dtype: str | None = None) -> "ReferenceMM":
        """The engine over ``mm`` (:func:`make_mm_engine`; ``device`` and ``dtype`` do not apply: float64, CPU)."""
        return cls(mm)

    def soft_tokens(self, prompt: MultimodalPrompt, trace: TraceFn | None = None) -> list[np.ndarray]:
        """float64 ``[n_soft, h]`` per item."""
        rows = [encode_item(self.mm, it, prefixed(trace, item_prefix(prompt.items, i)))
                for i, it in enumerate(prompt.items)]
        check_rows(prompt, rows)
        return rows

    def _injection(self, prompt, trace, embeds):
        rows = self.soft_tokens(prompt, trace) if embeds is None else [np.asarray(embeds, dtype=np.float64)]
        return prompt.injection(np.concatenate(rows) if rows else np.zeros((0, self.mm.cfg.hidden_size)))

    def logits(self, prompt: MultimodalPrompt, trace: TraceFn | None = None, embeds=None) -> np.ndarray:
        """float64 ``[T, V]``."""
        return RM.forward(self.mm.cfg, self.mm.W, prompt.ids, trace=trace, mm=self._injection(prompt, trace, embeds))

    def generate_full(self, prompt: MultimodalPrompt, max_new_tokens: int) -> Generated:
        """Greedy with the KV cache: the prompt (with its soft tokens) in one forward, then one token per step."""
        RM.check_generation(self.mm.cfg, [[0] * len(prompt.ids)], max_new_tokens)
        cache = RM.KVCache(self.mm.cfg)
        logits = RM.forward(self.mm.cfg, self.mm.W, prompt.ids, cache, mm=self._injection(prompt, None, None))[-1]
        g = Generated()
        for _ in range(max_new_tokens):
            g.add(logits)
            logits = RM.forward(self.mm.cfg, self.mm.W, [g.tokens[-1]], cache)[-1]
        return g


def make_mm_engine(name: str, mm: MultimodalModel, device: str | None = None, dtype: str | None = None):
    """Build multimodal engine ``name`` over a loaded model.

    The engine's outputs go through the output check (:class:`harness.engines.checked.CheckedEngine`).

    Raises:
        EngineUnavailable: an unknown engine, or transformers on a GGUF model.
    """
    return CheckedEngine(_make_mm_engine(name, mm, device, dtype), name)  # outputs checked (harness.core.finite)


def _make_mm_engine(name: str, mm: MultimodalModel, device: str | None, dtype: str | None):
    row = KIND.get(name)
    if row is None or row.scheme or row.multimodal is None:
        raise EngineUnavailable(f"engine {name!r} does not take images or audio (multimodal engines: "
                                f"{', '.join(MM_ENGINES)})")
    module, cls = row.multimodal.split(":")
    return getattr(importlib.import_module(module), cls).for_model(mm, device, dtype)  # the torch ones imported here


def open_mm(path: str | os.PathLike, mmproj: str | os.PathLike | None = None) -> MultimodalModel:
    """:func:`reference.mm_model.load_multimodal` (here so that the CLI needs one import)."""
    return load_multimodal(path, mmproj)
