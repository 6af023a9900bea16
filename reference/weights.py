"""One loader for every engine: GGUF or HF safetensors -> (config, canonical weights).

Both formats map onto the canonical GGUF tensor names of :mod:`reference.names`.
A GGUF is checked and parsed once by :func:`reference.gguf_check.check_gguf`
(header, keys, tensor table and data layout, before any tensor is trusted).
Tensors are read lazily: the GGUF stays memory-mapped and a
tensor is dequantized (once, into a new float64 array) only when first asked
for, so the mapped file is never copied twice. Safetensors are opened with
``safetensors.safe_open`` and read tensor by tensor.

Quantized GGUF types are dequantized with ``gguf.quants.dequantize`` (every type
it supports), so the reference sees exactly what llama.cpp's conversion tools
produce. ``rope_freqs`` is kept as stored (float32), never recomputed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import gguf
import numpy as np
from safetensors import safe_open

from .config import (
    ModelConfig,
    attach_rope_freqs,
    config_from_gguf,
    config_from_hf,
    expected_tensors,
    optional_tensors,
    unread_tensors,
)
from .errors import ConfigError, ModelFileError
from .gguf_check import GGUFFile, check_gguf
from .names import hf_to_gguf
from .weight_check import check_stored, check_values


@dataclass
class _Lazy:
    shape: tuple[int, ...]
    dtype: str  # GGML type name or numpy dtype name, for reports
    read: Callable[[], np.ndarray]  # returns an array of `shape` (any float dtype)
    stored: np.ndarray | None = None  # GGUF only: the tensor's bytes as mapped (no copy)


class Weights(Mapping):
    """Read-only mapping canonical name -> float64 ndarray, dequantized on first access.

    Shapes are numpy order: linear weights ``[out, in]``, expert stacks
    ``[n_expert, out, in]``, norms ``[n]``. ``raw_dtype(name)`` tells the stored type.

    Raises (on access):
        KeyError: unknown name.
        ModelFileError: the tensor holds NaN, Inf or |w| > 1e30 (named; see
            :mod:`reference.weight_check`).
    """

    def __init__(self, source: str, tensors: dict[str, _Lazy]):
        self.source = source
        self._lazy = tensors
        self._cache: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._cache:
            lazy = self._lazy[name]
            if lazy.stored is not None:  # GGUF: checked as stored (scale fields), before dequantizing
                check_stored(self.source, name, lazy.dtype, lazy.stored, lazy.shape)
            arr = np.asarray(lazy.read(), dtype=np.float64).reshape(lazy.shape)
            if lazy.stored is None:
                check_values(self.source, name, arr)  # NaN, Inf, |w| > 1e30 (rope_freqs: > 0)
            arr.setflags(write=False)
            self._cache[name] = arr
        return self._cache[name]

    def __contains__(self, name: object) -> bool:
        # Mapping's default looks the item up, which would dequantize it.
        return name in self._lazy

    def __iter__(self) -> Iterator[str]:
        return iter(self._lazy)

    def __len__(self) -> int:
        return len(self._lazy)

    def shape(self, name: str) -> tuple[int, ...]:
        """Stored shape of ``name`` without reading it."""
        return self._lazy[name].shape

    def raw_dtype(self, name: str) -> str:
        """Stored type of ``name`` (GGML type name such as ``Q8_0``, or a numpy dtype name)."""
        return self._lazy[name].dtype

    def stored(self, name: str) -> np.ndarray | None:
        """The tensor's bytes exactly as stored in a GGUF (memory-mapped view, not a copy), or None
        for safetensors. Used by ``fast/`` to dequantize on its own device."""
        return self._lazy[name].stored

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored after dequantization, in its natural float dtype (no float64 copy kept)."""
        lazy = self._lazy[name]
        return np.asarray(lazy.read()).reshape(lazy.shape)


# --------------------------------------------------------------------------- GGUF


def _gguf_tensors(gf: GGUFFile) -> dict[str, _Lazy]:
    out: dict[str, _Lazy] = {}
    for t in gf.tensors.values():  # sizes, offsets and types already checked by check_gguf
        data = gf.view(t.name)

        def read(data=data, t=t):
            try:
                return gguf.quants.dequantize(data, gguf.GGMLQuantizationType(t.ggml_type))
            except NotImplementedError:
                raise ModelFileError(f"{gf.path}: tensor {t.name}: type {t.type_name} cannot be dequantized by "
                                     "gguf.quants") from None

        out[t.name] = _Lazy(shape=t.shape, dtype=t.type_name, read=read, stored=data)
    return out


def load_gguf(path: str | os.PathLike) -> tuple[ModelConfig, Weights]:
    """Open a ``.gguf`` file: config from its metadata, lazily dequantized weights.

    Args:
        path: the file.

    Returns:
        ``(config, weights)``.

    Raises:
        ModelFileError: not a GGUF file, truncated, missing/mis-shaped tensor,
            undequantizable type.
        ConfigError: bad or missing metadata (the key is named).
    """
    path = Path(path)
    gf = check_gguf(path)  # structure checked before any tensor is trusted (reference.gguf_check)
    meta = gf.metadata
    tensors = _gguf_tensors(gf)
    cfg = config_from_gguf(meta, {k: v.shape for k, v in tensors.items()}, str(path))
    weights = Weights(str(path), tensors)
    weights.metadata = meta  # type: ignore[attr-defined]
    weights.gguf = gf  # type: ignore[attr-defined]  # keeps the map alive
    if "rope_freqs.weight" in tensors:  # through __getitem__: checked finite and > 0 (exact: float32 values)
        cfg = attach_rope_freqs(cfg, np.asarray(weights["rope_freqs.weight"], dtype=np.float32))
    _validate(cfg, weights)
    return cfg, weights


# --------------------------------------------------------------------------- safetensors


def load_hf(path: str | os.PathLike) -> tuple[ModelConfig, Weights]:
    """Open an HF model folder (``config.json`` + ``*.safetensors``).

    A multimodal checkpoint (``model_type`` ``gemma4`` with ``text_config``,
    tensors under ``model.language_model.``) loads its text decoder; vision and
    audio tensors are ignored.

    Args:
        path: the folder.

    Returns:
        ``(config, weights)`` with canonical GGUF names.

    Raises:
        ModelFileError: no config.json or safetensors, unreadable file,
            missing/mis-shaped tensor.
        ConfigError: bad config fields (named).
    """
    path = Path(path)
    cfg_path = path / "config.json"
    try:
        raw_cfg = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise ModelFileError(f"{cfg_path}: missing (an HF model folder needs config.json)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ModelFileError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(raw_cfg, dict):
        raise ConfigError(f"{cfg_path}: expected a JSON object")
    cfg = config_from_hf(raw_cfg, str(cfg_path))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{path}: no *.safetensors files")
    tensors: dict[str, _Lazy] = {}
    for f in files:
        try:
            handle = safe_open(str(f), framework="numpy")
            keys = list(handle.keys())
        except Exception as e:
            raise ModelFileError(f"{f}: cannot read safetensors ({str(e)[:120]})") from None
        for key in keys:
            canon = hf_to_gguf(key)
            if canon is None:
                continue
            if canon in tensors:
                raise ModelFileError(f"{f}: tensor {key} maps to {canon}, which another tensor already provides")
            shape = tuple(handle.get_slice(key).get_shape())

            def read(handle=handle, key=key, f=f):
                try:
                    return handle.get_tensor(key)
                except TypeError:  # bfloat16 has no numpy dtype: go through torch
                    with safe_open(str(f), framework="pt") as h:  # needs torch installed (safetensors' pt path)
                        return h.get_tensor(key).float().numpy()

            dtype = str(handle.get_slice(key).get_dtype())
            tensors[canon] = _Lazy(shape=shape, dtype=dtype, read=read)
    weights = Weights(str(path), tensors)
    _validate(cfg, weights)
    return cfg, weights


# --------------------------------------------------------------------------- common


def _validate(cfg: ModelConfig, weights: Weights) -> None:
    expected = expected_tensors(cfg)
    optional = optional_tensors(cfg)
    for name, shape in expected.items():
        if name not in weights:
            if name in optional:
                continue
            raise ModelFileError(f"{weights.source}: missing tensor {name} (expected shape {list(shape)})")
        got = weights.shape(name)
        if tuple(got) != tuple(shape):
            raise ModelFileError(f"{weights.source}: tensor {name} has shape {list(got)}, expected {list(shape)}")
    for name in unread_tensors(cfg, weights)[:1]:
        raise ModelFileError(f"{weights.source}: tensor {name} is not one this {cfg.arch} config reads "
                             "(a misspelt or damaged name, or keys that do not match the tensors)")


def load_model(path: str | os.PathLike) -> tuple[ModelConfig, Weights]:
    """Load a model from a ``.gguf`` file or an HF folder; the one entry point every engine uses.

    Args:
        path: ``*.gguf`` file, or a folder with ``config.json`` and safetensors.

    Returns:
        ``(config, weights)``.

    Raises:
        ModelFileError: the path does not exist or is neither form; any loader error.
        ConfigError: metadata errors.
    """
    p = Path(path)
    if not p.exists():
        raise ModelFileError(f"{p}: no such file or folder")
    if p.is_dir():
        return load_hf(p)
    return load_gguf(p)
