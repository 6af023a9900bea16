"""Loading a Gemma 4 assistant (MTP drafter) from HF safetensors or from a ``gemma4-assistant`` GGUF.

Both forms map onto canonical GGUF names (llama.cpp's): the decoder's tensors keep the ``gemma4`` names of
:mod:`reference.names` (``token_embd`` is the drafter's own tied head; there is no ``attn_k``, ``attn_v`` or
``attn_k_norm``), plus

============================================  =====================================
HF (``Gemma4AssistantForCausalLM``)            canonical (GGUF)
============================================  =====================================
``pre_projection.weight``                      ``nextn.pre_projection.weight``
``post_projection.weight``                     ``nextn.post_projection.weight``
``masked_embedding.centroids.weight``          ``masked_embd_centroids.weight``
``masked_embedding.token_ordering``            ``masked_embd_ordering``
============================================  =====================================

The centroid head's tensors exist only in the HF form: llama.cpp's converter skips ``masked_embedding.*``
(``conversion/gemma.py`` ``Gemma4AssistantModel.filter_tensors``). Tensors are read lazily through
:class:`reference.weights.Weights`, as for a target.

Sources: transformers ``modeling_gemma4_assistant.py``; llama.cpp ``gguf-py/gguf/constants.py``
(``MODEL_TENSOR.NEXTN_PROJ_PRE/POST``, ``MASKED_EMBD_*``) and ``src/models/gemma4-assistant.cpp``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .drafter import DrafterConfig, drafter_config_from_gguf, drafter_config_from_hf, drafter_expected_tensors
from .errors import ConfigError, ModelFileError
from .files import read_json
from .gguf_check import check_gguf
from .lazy_tensors import LazyTensor, safetensors_folder
from .names import gguf_to_hf, hf_to_gguf
from .weights import Weights, _gguf_tensors

DRAFTER_HF_TO_GGUF = {
    "pre_projection.weight": "nextn.pre_projection.weight",
    "post_projection.weight": "nextn.post_projection.weight",
    "masked_embedding.centroids.weight": "masked_embd_centroids.weight",
    "masked_embedding.token_ordering": "masked_embd_ordering",
}
"""The assistant's own HF tensors -> canonical names (the decoder's go through :func:`reference.names.hf_to_gguf`)."""


def drafter_hf_to_gguf(name: str) -> str | None:
    """Canonical name of one HF assistant tensor; None for the tied ``lm_head`` (it is ``token_embd``)."""
    if name in DRAFTER_HF_TO_GGUF:
        return DRAFTER_HF_TO_GGUF[name]
    if name == "lm_head.weight":
        return None
    canon = hf_to_gguf(name)
    return canon if canon != "output.weight" else None


def gguf_to_drafter_hf(name: str) -> str:
    """Inverse of :func:`drafter_hf_to_gguf` (for writers).

    Raises:
        KeyError: not a drafter tensor.
    """
    for hf, gg in DRAFTER_HF_TO_GGUF.items():
        if gg == name:
            return hf
    return gguf_to_hf(name)


def _validate(d: DrafterConfig, weights: Weights) -> None:
    """Every expected tensor present with its shape; no K/V projection (a drafter has none)."""
    for name, shape in drafter_expected_tensors(d).items():
        if name not in weights:
            if name.endswith("layer_output_scale.weight"):
                continue
            raise ModelFileError(f"{weights.source}: missing drafter tensor {name} (expected shape {list(shape)})")
        if tuple(weights.shape(name)) != tuple(shape):
            raise ModelFileError(f"{weights.source}: drafter tensor {name} has shape {list(weights.shape(name))}, "
                                 f"expected {list(shape)}")
    for name in weights:
        if name.endswith(("attn_k.weight", "attn_v.weight", "attn_k_norm.weight")):
            raise ModelFileError(f"{weights.source}: unexpected tensor {name}: a Gemma 4 assistant reads K and V from "
                                 "its target and has no K/V projection")
    if d.use_ordered_embeddings:
        order = np.asarray(weights["masked_embd_ordering"]).astype(np.int64)
        if not np.array_equal(np.sort(order), np.arange(d.text.vocab_size)):
            raise ModelFileError(f"{weights.source}: masked_embd_ordering is not a permutation of the "
                                 f"{d.text.vocab_size} token ids")


def load_drafter_hf(path: str | os.PathLike) -> tuple[DrafterConfig, Weights]:
    """Open an HF assistant folder (``config.json`` with ``model_type`` ``gemma4_assistant``, safetensors).

    Returns:
        ``(config, weights)`` with canonical names; the config is not yet bound to a target
        (:func:`reference.drafter.bind`).

    Raises:
        ModelFileError: no config.json or safetensors; a missing or mis-shaped drafter tensor; a K/V projection;
            an ordering that is not a permutation.
        ConfigError: bad config fields (named).
    """
    path = Path(path)
    cfg_path = path / "config.json"
    if not os.path.lexists(cfg_path):
        raise ModelFileError(f"{cfg_path}: missing (an HF assistant folder needs config.json)")
    raw = read_json(cfg_path, streams=False, error=ModelFileError)
    if not isinstance(raw, dict):
        raise ConfigError(f"{cfg_path}: expected a JSON object")
    d = drafter_config_from_hf(raw, str(cfg_path))
    tensors: dict[str, LazyTensor] = {}
    for key, t in safetensors_folder(path).items():  # mapped; each tensor read when asked for (BF16 widened)
        canon = drafter_hf_to_gguf(key)
        if canon is not None:
            tensors[canon] = t
    weights = Weights(str(path), tensors)
    _validate(d, weights)
    return d, weights


def load_drafter_gguf(path: str | os.PathLike) -> tuple[DrafterConfig, Weights]:
    """Open a ``gemma4-assistant`` GGUF (any file type ``gguf.quants`` dequantizes).

    Returns:
        ``(config, weights)``; a GGUF drafter always has the full head (no centroid tensors are written).

    Raises:
        ModelFileError: not a GGUF, truncated, a missing or mis-shaped tensor, a K/V projection.
        ConfigError: bad metadata (the key is named).
    """
    path = Path(path)
    gf = check_gguf(path)  # structure checked before any tensor is trusted (reference.gguf_check)
    meta = gf.metadata
    tensors = _gguf_tensors(gf)
    for name in ("masked_embd_centroids.weight", "masked_embd_ordering"):
        tensors.pop(name, None)  # no hyper-parameters for them in a GGUF: the full head, as llama.cpp
    weights = Weights(str(path), tensors)
    weights.metadata = meta  # type: ignore[attr-defined]
    weights.gguf = gf  # type: ignore[attr-defined]  # keeps the map alive
    rope = np.asarray(weights.raw("rope_freqs.weight"), dtype=np.float32) if "rope_freqs.weight" in tensors else None
    d = drafter_config_from_gguf(meta, {k: v.shape for k, v in tensors.items()}, str(path), rope)
    _validate(d, weights)
    return d, weights


def load_drafter(path: str | os.PathLike) -> tuple[DrafterConfig, Weights]:
    """A drafter from a ``.gguf`` file or an HF folder (not yet bound to a target).

    Raises:
        ModelFileError: the path does not exist; any loader error.
        ConfigError: metadata errors.
    """
    p = Path(path)
    if not p.exists():
        raise ModelFileError(f"{p}: no such file or folder")
    return load_drafter_hf(p) if p.is_dir() else load_drafter_gguf(p)
