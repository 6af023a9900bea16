"""Vision weights from an HF multimodal folder or an mmproj GGUF, under one set of names.

Canonical names and layouts are llama.cpp's mmproj ones (``v.blk.N.attn_q.weight``,
``v.patch_embd.weight`` as a conv kernel ``[H, 3, p, p]``, clip scalars as
1-element tensors), so the reference reads the same arrays whichever file it
was given. :data:`GLOBAL_HF_TO_GGUF` and :data:`LAYER_HF_TO_GGUF` are the one
name table; two HF tensors change layout on the way (see :func:`hf_to_canonical`):

* ``patch_embedder.input_proj.weight`` ``[H, p*p*3]`` (HWC) -> ``[H, 3, p, p]``
  (llama.cpp ``conversion/gemma.py`` ``Gemma4VisionAudioModel.modify_tensors``);
* ClippableLinear scalars ``[]`` -> ``[1]``.

Sources: llama.cpp ``gguf-py/gguf/tensor_mapping.py`` (the ``# gemma4`` entries),
``tools/mtmd/clip-impl.h`` (``TN_*``) and ``clip.cpp`` (``PROJECTOR_TYPE_GEMMA4V``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .errors import ModelFileError
from .gguf_check import check_gguf
from .lazy_tensors import LazyTensor, safetensors_folder
from .vision import CLIP_BOUND_SUFFIXES, VisionConfig
from .weights import Weights, _gguf_tensors, read_hf_config

# HF tensor name -> canonical (mmproj GGUF) name, outside the encoder layers.
GLOBAL_HF_TO_GGUF = {
    "model.vision_tower.patch_embedder.input_proj.weight": "v.patch_embd.weight",
    "model.vision_tower.patch_embedder.position_embedding_table": "v.position_embd.weight",
    "model.vision_tower.std_bias": "v.std_bias",
    "model.vision_tower.std_scale": "v.std_scale",
    "model.embed_vision.embedding_projection.weight": "mm.input_projection.weight",
}

# HF suffix after ``model.vision_tower.encoder.layers.{i}.`` -> GGUF suffix after ``v.blk.{i}.``.
# ClippableLinear scalars follow their linear: ``self_attn.q_proj.input_min`` -> ``attn_q.input_min``.
_LINEARS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_out", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
LAYER_HF_TO_GGUF = {
    "input_layernorm.weight": "ln1.weight",
    "post_attention_layernorm.weight": "attn_post_norm.weight",
    "pre_feedforward_layernorm.weight": "ln2.weight",
    "post_feedforward_layernorm.weight": "ffn_post_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    **{f"{hf}.linear.weight": f"{gg}.weight" for hf, gg in _LINEARS.items()},
    **{f"{hf}.{s}": f"{gg}.{s}" for hf, gg in _LINEARS.items() for s in CLIP_BOUND_SUFFIXES},
}

HF_VISION_PREFIXES = ("model.vision_tower.", "model.embed_vision.")
_HF_LAYER_RE = re.compile(r"^model\.vision_tower\.encoder\.layers\.(\d+)\.(.+)$")


def hf_to_canonical(name: str) -> str | None:
    """Canonical (mmproj GGUF) name of one HF vision tensor; None for a tensor outside the vision side.

    Args:
        name: an HF safetensors key such as
            ``model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight``.

    Returns:
        ``v.blk.0.attn_q.weight``; None for text/audio tensors.

    Raises:
        KeyError: a vision-side name this table does not know (so nothing is dropped silently).
    """
    if not name.startswith(HF_VISION_PREFIXES):
        return None
    if name in GLOBAL_HF_TO_GGUF:
        return GLOBAL_HF_TO_GGUF[name]
    m = _HF_LAYER_RE.match(name)
    if m and m.group(2) in LAYER_HF_TO_GGUF:
        return f"v.blk.{m.group(1)}.{LAYER_HF_TO_GGUF[m.group(2)]}"
    raise KeyError(name)


def expected_vision_tensors(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor the vision reference reads, with its numpy-order shape.

    ClippableLinear scalars are listed when ``use_clipped_linears`` (shape ``(1,)``).
    Source: llama.cpp ``clip.cpp`` (``PROJECTOR_TYPE_GEMMA4V`` tensors, ne reversed).
    """
    h, f, d, p = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.patch_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    t: dict[str, tuple[int, ...]] = {
        "v.patch_embd.weight": (h, 3, p, p),
        "v.position_embd.weight": (2, cfg.position_embedding_size, h),
        "mm.input_projection.weight": (cfg.text_hidden_size, h),
    }
    if cfg.standardize:
        t["v.std_bias"], t["v.std_scale"] = (h,), (h,)
    linears = {"attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_out": (h, q),
               "ffn_gate": (f, h), "ffn_up": (f, h), "ffn_down": (h, f)}
    for i in range(cfg.num_hidden_layers):
        b = f"v.blk.{i}."
        for name in ("ln1", "attn_post_norm", "ln2", "ffn_post_norm"):
            t[f"{b}{name}.weight"] = (h,)
        t[b + "attn_q_norm.weight"], t[b + "attn_k_norm.weight"] = (d,), (d,)
        for name, shape in linears.items():
            t[f"{b}{name}.weight"] = shape
            if cfg.use_clipped_linears:
                for s in CLIP_BOUND_SUFFIXES:
                    t[f"{b}{name}.{s}"] = (1,)
    return t


class VisionWeights(Weights):
    """Read-only mapping canonical vision name -> float64 ndarray, read on first access.

    As :class:`reference.weights.Weights`, except that ClippableLinear scalars
    may be ±inf (transformers' default, meaning no bound). ``config`` holds the
    :class:`VisionConfig`.

    Raises (on access):
        KeyError: unknown name.
        ModelFileError: NaN anywhere, or Inf in a tensor other than a clip scalar (named).
    """
    def __init__(self, source: str, tensors: dict[str, LazyTensor], config: VisionConfig):
        super().__init__(source, tensors)
        self.config = config

    def _check_before(self, name, lazy, stored, first_row=0) -> None:
        """Nothing before reading: the values are checked (clip scalars may be ±inf)."""

    def _check_after(self, name, lazy, arr, first_row=0) -> None:
        """NaN anywhere, or Inf outside a clip scalar."""
        bound = name.rsplit(".", 1)[-1] in CLIP_BOUND_SUFFIXES
        if np.isnan(arr).any() or (not bound and not np.all(np.isfinite(arr))):
            raise ModelFileError(f"{self.source}: tensor {name} contains NaN or Inf")


def _validate(cfg: VisionConfig, tensors: dict[str, LazyTensor], source: str, all_bounds: bool) -> None:
    expected = expected_vision_tensors(cfg)
    for name, shape in expected.items():
        if name not in tensors:
            if name.rsplit(".", 1)[-1] in CLIP_BOUND_SUFFIXES and not all_bounds:
                continue  # llama.cpp: a missing scalar is no bound
            raise ModelFileError(f"{source}: missing tensor {name} (expected shape {list(shape)})")
        if tuple(tensors[name].shape) != tuple(shape):
            raise ModelFileError(f"{source}: tensor {name} has shape {list(tensors[name].shape)}, "
                                 f"expected {list(shape)}")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise ModelFileError(f"{source}: tensor {extra[0]} is not part of this vision config "
                             f"(standardize={cfg.standardize}, use_clipped_linears={cfg.use_clipped_linears})")


# --------------------------------------------------------------------------- HF


def _patch_kernel_from_linear(w: np.ndarray, p: int) -> np.ndarray:
    """HF ``input_proj`` ``[H, p*p*3]`` (row, column, channel) -> conv kernel ``[H, 3, p, p]``."""
    return np.ascontiguousarray(w.reshape(w.shape[0], p, p, 3).transpose(0, 3, 1, 2))


def load_vision_hf(path: str | os.PathLike) -> tuple[VisionConfig, VisionWeights]:
    """Vision tower and projector of an HF ``Gemma4ForConditionalGeneration`` folder.

    Args:
        path: folder with ``config.json`` (``vision_config``, ``text_config``) and ``*.safetensors``.

    Returns:
        ``(config, weights)`` with canonical names and layouts.

    Raises:
        ModelFileError: no config.json or safetensors, an unreadable file, a
            missing, mis-shaped, duplicate or unknown vision tensor.
        ConfigError: no vision_config, bad fields (named).
    """
    path = Path(path)
    cfg = VisionConfig.from_hf(read_hf_config(path), str(path / "config.json"))
    p = cfg.patch_size
    tensors: dict[str, LazyTensor] = {}
    for key, t in safetensors_folder(path).items():
        try:
            canon = hf_to_canonical(key)
        except KeyError:
            raise ModelFileError(f"{t.source}: vision tensor {key} is not known to the Gemma 4 vision reference"
                                 ) from None
        if canon is None:
            continue
        if canon in tensors:
            raise ModelFileError(f"{t.source}: tensor {key} maps to {canon}, which another tensor already provides")
        shape = t.shape
        if canon == "v.patch_embd.weight" and len(shape) == 2 and shape[1] == 3 * p * p:
            shape = (shape[0], 3, p, p)
        elif shape == ():
            shape = (1,)

        def read(t=t, canon=canon):
            arr = t.read()
            if canon == "v.patch_embd.weight":
                arr = _patch_kernel_from_linear(arr, p)
            return np.asarray(arr).reshape(-1) if arr.ndim == 0 else arr

        tensors[canon] = LazyTensor(shape=shape, dtype=t.dtype, read=read, source=t.source, key=key)
    _validate(cfg, tensors, str(path), all_bounds=True)
    return cfg, VisionWeights(str(path), tensors, cfg)


# --------------------------------------------------------------------------- GGUF


def load_mmproj(path: str | os.PathLike) -> tuple[VisionConfig, VisionWeights]:
    """Vision tower and projector of an mmproj GGUF (``clip.vision.projector_type = gemma4v``).

    Audio tensors (``a.*``, ``mm.a.*``) are ignored. Quantized types are
    dequantized with ``gguf.quants`` as for the text model.

    Args:
        path: the ``.gguf`` file.

    Returns:
        ``(config, weights)``; ``weights.metadata`` holds the GGUF key/values.

    Raises:
        ModelFileError: not a GGUF, truncated, a missing, mis-shaped or unknown ``v.`` tensor.
        ConfigError: not a gemma4v mmproj, a missing or bad key (named).
    """
    path = Path(path)
    gf = check_gguf(path)  # structure checked before any tensor is trusted
    meta = gf.metadata
    every = _gguf_tensors(gf)
    tensors = {n: t for n, t in every.items() if n.startswith(("v.", "mm.input_projection."))}
    cfg = VisionConfig.from_mmproj(meta, {n: t.shape for n, t in tensors.items()}, str(path))
    _validate(cfg, tensors, str(path), all_bounds=False)
    weights = VisionWeights(str(path), tensors, cfg)
    weights.metadata = meta  # type: ignore[attr-defined]
    weights.reader = gf  # type: ignore[attr-defined]  # keeps the mmap alive
    return cfg, weights


def load_vision(path: str | os.PathLike) -> tuple[VisionConfig, VisionWeights]:
    """Vision weights from an HF folder or an mmproj ``.gguf``; the one entry point.

    Raises:
        ModelFileError: the path does not exist; any loader error.
        ConfigError: metadata errors.
    """
    p = Path(path)
    if not p.exists():
        raise ModelFileError(f"{p}: no such file or folder")
    return load_vision_hf(p) if p.is_dir() else load_mmproj(p)


def check_matches_text(vision: VisionConfig, text: ModelConfig) -> None:
    """The projector must emit the text model's hidden size.

    Raises:
        ModelFileError: one line naming both files and both widths.
    """
    if vision.text_hidden_size != text.hidden_size:
        raise ModelFileError(
            f"{vision.source}: projector output width {vision.text_hidden_size} (mm.input_projection.weight) "
            f"does not match the text model {text.source} (hidden size {text.hidden_size})")
