"""The ``fast`` multimodal engine: the torch twins of the encoders and the decoder over one prepared prompt
(:mod:`harness.engines.mm` describes the protocol)."""

from __future__ import annotations

import numpy as np
import torch

from gemma4_harness.fast import audio as FA
from gemma4_harness.fast import vision as FV
from gemma4_harness.fast.engine import generate
from gemma4_harness.fast.mm_weights import EncoderWeights
from gemma4_harness.fast.model import FastModel, resolve_dtype
from gemma4_harness.reference.mm_model import MultimodalModel, MultimodalPrompt, item_prefix, prefixed
from gemma4_harness.reference.model import TraceFn

from .mm import check_rows


class FastMM:
    """The torch twins (:mod:`fast.vision`, :mod:`fast.audio`, :class:`fast.model.FastModel`).

    Args:
        mm: the loaded model.
        device: ``cpu`` / ``cuda`` / None (cuda when present).
        dtype: ``float32`` / ``bfloat16`` / ``float16`` for the matrices (encoders and decoder).
        model: an already built :class:`fast.model.FastModel` to use (the self-test's mutants), else one is built.
    """

    name = "fast"

    def __init__(self, mm: MultimodalModel, device: str | None = None, dtype: str = "float32", model=None):
        self.mm = mm
        self.model = model if model is not None else FastModel(mm.cfg, mm.W, device, dtype)
        dev, dt = self.model.device, resolve_dtype(dtype)
        self.vw = None if mm.vision is None else EncoderWeights(mm.vision[1], dev, dt)
        self.aw = None if mm.audio is None else EncoderWeights(mm.audio[1], dev, dt)
        self.name = f"fast-{dev.type}-{dtype}"

    @classmethod
    def for_model(cls, mm: MultimodalModel, device: str | None = None, dtype: str | None = None) -> "FastMM":
        """The engine over ``mm`` (:func:`harness.engines.mm.make_mm_engine`; ``dtype`` None: float32)."""
        return cls(mm, device, dtype or "float32")

    def encode(self, item, trace: TraceFn | None = None):
        """One item's soft tokens, float32 torch ``[n_soft, h]``."""
        if item.kind == "image":
            return FV.encode_image(self.mm.vision[0], self.vw, item.image.pixel_values, item.image.position_ids,
                                   trace=trace)
        return FA.encode_audio(self.mm.audio[0], self.aw, item.features, item.mask, trace=trace)

    def _rows(self, prompt: MultimodalPrompt, trace: TraceFn | None):
        with torch.inference_mode():
            return [self.encode(it, prefixed(trace, item_prefix(prompt.items, i))) for i, it in enumerate(prompt.items)]

    def soft_tokens(self, prompt: MultimodalPrompt, trace: TraceFn | None = None) -> list[np.ndarray]:
        """float32 values as float64 ``[n_soft, h]`` per item."""
        rows = [r.double().cpu().numpy() for r in self._rows(prompt, trace)]
        check_rows(prompt, rows)
        return rows

    def injection(self, prompt: MultimodalPrompt, trace: TraceFn | None = None, embeds=None):
        """The prompt's :class:`reference.multimodal.Injection` with this engine's soft tokens (torch rows)."""
        if embeds is not None:
            return prompt.injection(torch.as_tensor(np.asarray(embeds), dtype=torch.float32))
        rows = self._rows(prompt, trace)
        check_rows(prompt, rows)
        return prompt.injection(torch.cat(rows) if rows else torch.zeros((0, self.mm.cfg.hidden_size)))

    def logits(self, prompt: MultimodalPrompt, trace: TraceFn | None = None, embeds=None,
               chunk: int | None = None) -> np.ndarray:
        """float32 logits as float64 ``[T, V]`` (one-shot prefill, or chunks of ``chunk`` that never cut an image)."""
        inj = self.injection(prompt, trace, embeds)
        return self.model.logits(prompt.ids, chunk=chunk, trace=trace, mm=inj).double().cpu().numpy()

    def generate_full(self, prompt: MultimodalPrompt, max_new_tokens: int):
        """Greedy through the continuous batcher (:func:`fast.engine.generate`); returns its ``Result``."""
        return generate(self.model, [prompt.ids], max_new_tokens, batched=False, mm=[self.injection(prompt)])[0]
