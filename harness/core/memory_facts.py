"""The model's facts a memory plan needs (:mod:`.memory`), read without any tensor data: each tensor's shape, stored
type and bytes (:class:`TensorFacts`), and the model's config with its tensor table (:class:`ModelInfo`).

Units: bytes; ``GB`` = 10^9 bytes in every message.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from gguf import GGML_QUANT_SIZES

from gemma4_harness.reference.config import ModelConfig, cut_layers, expected_tensors

GB = 10**9


_BLOCK_TYPES = {t.name: GGML_QUANT_SIZES[t] for t in GGML_QUANT_SIZES}
"""GGUF type name -> (elements, bytes) per block (gguf-py's table)."""


# --------------------------------------------------------------------------- the model's facts


@dataclass(frozen=True)
class TensorFacts:
    """One tensor of the file as the engines will read it: numpy shape, stored type, stored bytes."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    @property
    def elements(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelInfo:
    """What a memory estimate needs to know of a model, read without any tensor data.

    Attributes:
        path: the file or folder.
        form: ``gguf`` or ``hf``.
        cfg: the config (after ``--layers``, when given).
        tensors: canonical name -> :class:`TensorFacts`, the tensors the decoder reads.
        file_bytes: size of the file (GGUF) or of every ``*.safetensors`` (HF folder).
    """

    path: str
    form: str
    cfg: ModelConfig
    tensors: Mapping[str, TensorFacts]
    file_bytes: int

    @classmethod
    def from_loaded(cls, path: str | os.PathLike, cfg: ModelConfig, W: Any) -> "ModelInfo":
        """From an opened model (``reference.weights.load_model``'s ``(cfg, W)``, or shape-only random
        weights): shapes and stored types from ``W``, stored bytes from the GGUF view or the dtype."""
        p = Path(path)
        tensors = {}
        for name in W:
            shape = tuple(W.shape(name))
            stored = W.stored(name) if hasattr(W, "stored") else None
            dtype = W.raw_dtype(name) if hasattr(W, "raw_dtype") else "F32"
            if stored is not None:
                nbytes = int(stored.nbytes)
            elif dtype in _BLOCK_TYPES:  # random packed blocks of a shape-only model (fast.shapes.RandomWeights)
                bs, ts = _BLOCK_TYPES[dtype]
                nbytes = math.prod(shape) // bs * ts
            else:
                nbytes = math.prod(shape) * {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}.get(dtype, 4)
            tensors[name] = TensorFacts(shape, dtype, nbytes)
        if p.is_dir():
            size = sum(f.stat().st_size for f in p.glob("*.safetensors"))
        else:
            size = p.stat().st_size if p.is_file() else 0
        return cls(str(p), "hf" if p.is_dir() else "gguf", cfg, tensors, size)

    def cut(self, n: int) -> "ModelInfo":
        """The same model cut to its first ``n`` layers (:func:`reference.config.cut_layers`), for advice."""
        cfg = cut_layers(self.cfg, n)
        keep = expected_tensors(cfg)
        tensors = {}
        for name, t in self.tensors.items():
            if name in keep or (not name.startswith("blk.") and name not in ("per_layer_token_embd.weight",
                                                                              "per_layer_model_proj.weight")):
                want = keep.get(name, t.shape)
                scale = math.prod(want) / max(1, t.elements)
                tensors[name] = TensorFacts(tuple(want), t.dtype, int(t.nbytes * scale))
        return ModelInfo(self.path, self.form, cfg, tensors, self.file_bytes)
