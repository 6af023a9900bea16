"""Audio encoder weights from an HF multimodal folder or an mmproj GGUF, under llama.cpp's mmproj names.

Canonical names are the tensor names llama.cpp's converter writes into an
mmproj GGUF (``Gemma4VisionAudioModel.modify_tensors`` in
``conversion/gemma.py``, mapped by ``gguf-py/gguf/tensor_mapping.py``; read by
``tools/mtmd/clip.cpp``): ``a.conv1d.{0,1}.weight``, ``a.blk.N.attn_q.weight``,
``a.pre_encode.out.weight``, ``mm.a.input_projection.weight`` and so on; see
:data:`AUDIO_LAYER_HF_TO_GGUF` and :data:`AUDIO_GLOBAL_HF_TO_GGUF`, the one name
table. Canonical arrays follow the GGUF conventions, so both formats load to
identical arrays:

* ``per_dim_scale.weight`` holds ``softplus(per_dim_scale)``: llama.cpp's
  converter applies the softplus when writing the GGUF. From HF it is computed
  here in float64 and rounded to float32 (what an F32 GGUF stores);
* the depthwise conv ``conv_dw.weight`` is ``[H, k]`` (HF ``[H, 1, k]``);
* the ClippableLinear bounds (HF 0-d buffers ``input_min`` ...) are 1-element
  tensors ``{base}.input_min`` etc. (``.linear.`` dropped from the weight name).
  They may be +-inf (transformers' initial values); every other tensor must be finite.

Sources: llama.cpp ``conversion/gemma.py`` (``Gemma4VisionAudioModel``),
``conversion/base.py`` (``MmprojModel.set_gguf_parameters``),
``tools/mtmd/clip.cpp`` (``PROJECTOR_TYPE_GEMMA4A`` loading).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from .audio_config import AudioConfig
from .errors import ConfigError, ModelFileError
from .gguf_check import check_gguf
from .lazy_tensors import LazyTensor, safetensors_folder
from .weights import Weights, _gguf_tensors, read_hf_config

HF_AUDIO_PREFIX = "model.audio_tower."
CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")

#: Model-level tensors: HF name -> canonical (mmproj GGUF) name.
AUDIO_GLOBAL_HF_TO_GGUF = {
    "model.audio_tower.subsample_conv_projection.layer0.conv.weight": "a.conv1d.0.weight",
    "model.audio_tower.subsample_conv_projection.layer0.norm.weight": "a.conv1d.0.norm.weight",
    "model.audio_tower.subsample_conv_projection.layer1.conv.weight": "a.conv1d.1.weight",
    "model.audio_tower.subsample_conv_projection.layer1.norm.weight": "a.conv1d.1.norm.weight",
    "model.audio_tower.subsample_conv_projection.input_proj_linear.weight": "a.input_projection.weight",
    "model.audio_tower.output_proj.weight": "a.pre_encode.out.weight",
    "model.audio_tower.output_proj.bias": "a.pre_encode.out.bias",
    "model.embed_audio.embedding_projection.weight": "mm.a.input_projection.weight",
}

#: Per-layer modules: HF path after ``model.audio_tower.layers.N.`` -> GGUF base after ``a.blk.N.``.
#: ClippableLinear modules (marked True) carry ``.linear.weight`` and the four bounds in HF.
AUDIO_LAYER_HF_TO_GGUF: dict[str, tuple[str, bool]] = {
    "feed_forward1.pre_layer_norm": ("ffn_norm", False),
    "feed_forward1.ffw_layer_1": ("ffn_up", True),
    "feed_forward1.ffw_layer_2": ("ffn_down", True),
    "feed_forward1.post_layer_norm": ("ffn_post_norm", False),
    "norm_pre_attn": ("attn_pre_norm", False),
    "self_attn.q_proj": ("attn_q", True),
    "self_attn.k_proj": ("attn_k", True),
    "self_attn.v_proj": ("attn_v", True),
    "self_attn.post": ("attn_out", True),
    "self_attn.relative_k_proj": ("attn_k_rel", False),
    "self_attn.per_dim_scale": ("per_dim_scale", False),  # HF parameter without .weight; GGUF softplus'd
    "norm_post_attn": ("attn_post_norm", False),
    "lconv1d.pre_layer_norm": ("conv_norm", False),  # pre-norm; the GGUF names are swapped vs HF
    "lconv1d.linear_start": ("conv_pw1", True),
    "lconv1d.depthwise_conv1d": ("conv_dw", False),
    "lconv1d.conv_norm": ("norm_conv", False),
    "lconv1d.linear_end": ("conv_pw2", True),
    "feed_forward2.pre_layer_norm": ("ffn_norm_1", False),
    "feed_forward2.ffw_layer_1": ("ffn_up_1", True),
    "feed_forward2.ffw_layer_2": ("ffn_down_1", True),
    "feed_forward2.post_layer_norm": ("ffn_post_norm_1", False),
    "norm_out": ("ln2", False),
}

_LAYER_RE = re.compile(r"^model\.audio_tower\.layers\.(\d+)\.(.+)$")


def hf_to_gguf_audio(name: str) -> str | None:
    """Canonical name of one HF audio tensor, or None for a tensor outside the audio encoder.

    ``model.audio_tower.layers.3.self_attn.q_proj.linear.weight`` -> ``a.blk.3.attn_q.weight``;
    ``...q_proj.input_min`` -> ``a.blk.3.attn_q.input_min``; ``...self_attn.per_dim_scale`` ->
    ``a.blk.3.per_dim_scale.weight``.

    Raises:
        ModelFileError: an ``audio_tower`` / ``embed_audio`` tensor the table does not know.
    """
    if name in AUDIO_GLOBAL_HF_TO_GGUF:
        return AUDIO_GLOBAL_HF_TO_GGUF[name]
    if not name.startswith((HF_AUDIO_PREFIX, "model.embed_audio.")):
        return None
    m = _LAYER_RE.match(name)
    if m:
        il, rest = m.group(1), m.group(2)
        for hf, (gg, clippable) in AUDIO_LAYER_HF_TO_GGUF.items():
            if rest == hf:  # per_dim_scale
                return f"a.blk.{il}.{gg}.weight"
            if not rest.startswith(hf + "."):
                continue
            leaf = rest[len(hf) + 1:]
            if leaf == ("linear.weight" if clippable else "weight") or (clippable and leaf in CLIP_BOUNDS):
                return f"a.blk.{il}.{gg}.{'weight' if leaf.endswith('weight') else leaf}"
    raise ModelFileError(f"unknown audio tensor {name}")


def gguf_to_hf_audio(name: str) -> str:
    """Inverse of :func:`hf_to_gguf_audio`.

    Raises:
        KeyError: not a canonical audio tensor name.
    """
    for hf, gg in AUDIO_GLOBAL_HF_TO_GGUF.items():
        if gg == name:
            return hf
    m = re.match(r"^a\.blk\.(\d+)\.([a-z_0-9]+)\.(\w+)$", name)
    if m:
        for hf, (gg, clippable) in AUDIO_LAYER_HF_TO_GGUF.items():
            if gg != m.group(2):
                continue
            leaf = m.group(3)
            if gg == "per_dim_scale" and leaf == "weight":
                return f"{HF_AUDIO_PREFIX}layers.{m.group(1)}.{hf}"
            if leaf == "weight":
                return f"{HF_AUDIO_PREFIX}layers.{m.group(1)}.{hf}.{'linear.weight' if clippable else 'weight'}"
            if clippable and leaf in CLIP_BOUNDS:
                return f"{HF_AUDIO_PREFIX}layers.{m.group(1)}.{hf}.{leaf}"
    raise KeyError(name)


def expected_audio_tensors(cfg: AudioConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor the encoder reads, with its numpy shape (clip bounds included when used).

    Raises: nothing.
    """
    H, E, ch0, ch1 = cfg.hidden_size, cfg.output_proj_dims, *cfg.subsampling_conv_channels
    t: dict[str, tuple[int, ...]] = {
        "a.conv1d.0.weight": (ch0, 1, 3, 3),
        "a.conv1d.0.norm.weight": (ch0,),
        "a.conv1d.1.weight": (ch1, ch0, 3, 3),
        "a.conv1d.1.norm.weight": (ch1,),
        "a.input_projection.weight": (H, (ch0 // 4) * ch1),
        "a.pre_encode.out.weight": (E, H),
        "a.pre_encode.out.bias": (E,),
        "mm.a.input_projection.weight": (cfg.text_hidden_size, E),
    }
    linears = {"ffn_up": (4 * H, H), "ffn_down": (H, 4 * H), "ffn_up_1": (4 * H, H), "ffn_down_1": (H, 4 * H),
               "attn_q": (H, H), "attn_k": (H, H), "attn_v": (H, H), "attn_out": (H, H),
               "conv_pw1": (2 * H, H), "conv_pw2": (H, H)}
    for il in range(cfg.num_hidden_layers):
        b = f"a.blk.{il}."
        for norm in ("ffn_norm", "ffn_post_norm", "ffn_norm_1", "ffn_post_norm_1", "attn_pre_norm",
                     "attn_post_norm", "conv_norm", "norm_conv", "ln2"):
            t[f"{b}{norm}.weight"] = (H,)
        for base, shape in linears.items():
            t[f"{b}{base}.weight"] = shape
            if cfg.use_clipped_linears:
                for bound in CLIP_BOUNDS:
                    t[f"{b}{base}.{bound}"] = (1,)
        t[b + "attn_k_rel.weight"] = (H, H)
        t[b + "per_dim_scale.weight"] = (cfg.head_dim,)
        t[b + "conv_dw.weight"] = (H, cfg.conv_kernel_size)
    return t


class AudioWeights(Weights):
    """:class:`reference.weights.Weights` for the audio encoder: clip bounds may be +-inf (never NaN).

    Raises (on access):
        KeyError: unknown name.
        ModelFileError: NaN anywhere, or +-inf outside a clip bound (named).
    """
    def _check_before(self, name, lazy, stored, first_row=0) -> None:
        """Nothing before reading: the values are checked (clip bounds may be ±inf)."""

    def _check_after(self, name, lazy, arr, first_row=0) -> None:
        """NaN anywhere, or ±inf outside a clip bound."""
        bad = np.isnan(arr) if name.rsplit(".", 1)[-1] in CLIP_BOUNDS else ~np.isfinite(arr)
        if np.any(bad):
            raise ModelFileError(f"{self.source}: tensor {name} contains NaN or Inf")


def softplus_f32(x: np.ndarray) -> np.ndarray:
    """``log(1 + e^x)`` in float64, rounded to float32 (what llama.cpp's converter stores). [n] -> [n]."""
    return np.logaddexp(0.0, np.asarray(x, dtype=np.float64)).astype(np.float32)


def _softplus_after(read):
    return lambda: softplus_f32(read())


def _validate(cfg: AudioConfig, weights: AudioWeights) -> None:
    for name, shape in expected_audio_tensors(cfg).items():
        if name not in weights:
            raise ModelFileError(f"{weights.source}: missing tensor {name} (expected shape {list(shape)})")
        if tuple(weights.shape(name)) != shape:
            raise ModelFileError(f"{weights.source}: tensor {name} has shape {list(weights.shape(name))}, "
                                 f"expected {list(shape)}")


def check_text_width(cfg: AudioConfig, text_hidden_size: int, text_source: str = "the text model") -> None:
    """The projector must output the text model's hidden size.

    Raises:
        ConfigError: ``embed_audio`` projects to a different width (one line naming both files).
    """
    if cfg.text_hidden_size != text_hidden_size:
        raise ConfigError(f"{cfg.source}: audio projector outputs width {cfg.text_hidden_size} but {text_source} "
                          f"has hidden size {text_hidden_size} (mmproj and text model do not belong together)")


def load_audio_hf(path: str | os.PathLike) -> tuple[AudioConfig, AudioWeights]:
    """Audio encoder of an HF ``Gemma4ForConditionalGeneration`` folder (``config.json`` + safetensors).

    Returns:
        ``(config, weights)`` with canonical names (module docstring).

    Raises:
        ModelFileError: no config.json / safetensors, unreadable file, a missing,
            duplicate, unknown or mis-shaped audio tensor.
        ConfigError: no ``audio_config`` or bad fields (named).
    """
    path = Path(path)
    cfg = AudioConfig.from_hf(read_hf_config(path), str(path / "config.json"))
    tensors: dict[str, LazyTensor] = {}
    for key, t in safetensors_folder(path).items():
        try:
            canon = hf_to_gguf_audio(key)
        except ModelFileError:
            raise ModelFileError(f"{t.source}: unknown audio tensor {key}") from None
        if canon is None or (not cfg.use_clipped_linears and canon.rsplit(".", 1)[-1] in CLIP_BOUNDS):
            continue  # transformers creates no bound buffers without use_clipped_linears
        if canon in tensors:
            raise ModelFileError(f"{t.source}: tensor {key} maps to {canon}, which another tensor already provides")
        shape, read = t.shape, t.read
        if canon.endswith("per_dim_scale.weight"):
            read = _softplus_after(read)
        if canon.endswith("conv_dw.weight") and len(shape) == 3 and shape[1] == 1:
            shape = (shape[0], shape[2])
        if len(shape) == 0:
            shape = (1,)
        tensors[canon] = LazyTensor(shape=shape, dtype=t.dtype, read=read, source=t.source, key=key)
    weights = AudioWeights(str(path), tensors)
    _validate(cfg, weights)
    return cfg, weights


def load_audio_mmproj(path: str | os.PathLike, text_hidden_size: int | None = None,
                      text_source: str = "the text model") -> tuple[AudioConfig, AudioWeights]:
    """Audio encoder of an mmproj GGUF (``clip.audio.projector_type = gemma4a``).

    Args:
        path: the mmproj file.
        text_hidden_size: the text model's hidden size (``gemma4.embedding_length``
            of the text GGUF); checked against the projector when given.
        text_source: the text model's file, for the message.

    Returns:
        ``(config, weights)``; the tensors are read lazily from the mapped file.

    Raises:
        ModelFileError: not a GGUF file, truncated, a missing or mis-shaped tensor.
        ConfigError: not an audio ``gemma4a`` projector, bad keys, or a projector
            width that differs from ``text_hidden_size``.
    """
    path = Path(path)
    gf = check_gguf(path)  # structure checked before any tensor is trusted
    meta = gf.metadata
    if meta.get("general.architecture") != "clip":
        raise ConfigError(f"{path}: general.architecture = {meta.get('general.architecture')!r}, expected 'clip' "
                          f"(an mmproj file)")
    if not meta.get("clip.has_audio_encoder", False):
        raise ConfigError(f"{path}: clip.has_audio_encoder is not true (no audio encoder in this mmproj)")
    tensors = {k: v for k, v in _gguf_tensors(gf).items() if k.startswith(("a.", "mm.a."))}
    cfg = AudioConfig.from_mmproj(meta, {k: v.shape for k, v in tensors.items()}, str(path))
    weights = AudioWeights(str(path), tensors)
    weights.metadata = meta  # type: ignore[attr-defined]
    weights.reader = gf  # type: ignore[attr-defined]  # keeps the mmap alive
    _validate(cfg, weights)
    if text_hidden_size is not None:
        check_text_width(cfg, text_hidden_size, text_source)
    return cfg, weights


def load_audio_encoder(path: str | os.PathLike, text_hidden_size: int | None = None) -> tuple[AudioConfig, Any]:
    """Audio encoder from an HF folder or an mmproj ``.gguf``; the one entry point.

    Raises:
        ModelFileError: the path does not exist; any loader error.
        ConfigError: metadata errors; projector width differs from ``text_hidden_size``.
    """
    p = Path(path)
    if not p.exists():
        raise ModelFileError(f"{p}: no such file or folder")
    if p.is_dir():
        cfg, w = load_audio_hf(p)
        if text_hidden_size is not None:
            check_text_width(cfg, text_hidden_size)
        return cfg, w
    return load_audio_mmproj(p, text_hidden_size)
