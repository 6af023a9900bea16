"""Tiny synthetic Gemma 4 audio encoders: an HF checkpoint with bug-revealing weights, and its mmproj GGUF.

(Temporary flat location; moves into ``harness/synth/``.)

:func:`make_tiny_audio_hf` builds a small ``Gemma4ForConditionalGeneration``
(a 2-layer text decoder plus an audio tower, no vision) with transformers,
replaces the parameters whose initial values hide bugs, and saves it with
``save_pretrained``. :func:`write_audio_mmproj` writes canonical audio weights
(:mod:`reference.audio_weights`) as an F32 mmproj GGUF with llama.cpp's keys
and tensor names, so that both files load to identical arrays.

Randomised on purpose (transformers' initial value in brackets):

* every linear and conv weight: normal, std ``gain / sqrt(fan_in)`` [std 0.02],
  so activations are O(1); q/k projections get a larger gain so that the
  attention logits reach the softcap (50) region;
* RMSNorm / LayerNorm weights: uniform [0.5, 1.5] [1];
* ``per_dim_scale``: normal(1, 1) [0: softplus gives a uniform 0.693];
* ClippableLinear bounds: uniform in [-2.5, -1.5] / [1.5, 2.5], times the gain
  for the q/k outputs [+-inf: nothing is ever clipped]; with O(1) activations
  they clip some per cent of the values of most linears;
* ``output_proj`` bias: normal(0, 0.5) [0].

Kept at llama.cpp's hard-coded values: chunk 12, context_left 13,
context_right 0, logit cap 50, residual 0.5, eps 1e-6, conv kernel 5,
``subsampling_conv_channels[0] = 128`` (the mel bins).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGUFValueType as VT
from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig

from gemma4_harness.reference.audio_config import AudioConfig
from gemma4_harness.reference.audio_weights import expected_audio_tensors

#: Tiny audio encoder used by the tests (Gemma4AudioConfig fields).
TINY_AUDIO = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "subsampling_conv_channels": [128, 8],
    "output_proj_dims": 24,
    "use_clipped_linears": True,
    "attention_chunk_size": 12,
    "attention_context_left": 13,
    "attention_context_right": 0,
    "conv_kernel_size": 5,
}

#: Tiny text decoder beside it (only its width matters to the audio path).
TINY_TEXT = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
    "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
    "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
}

#: Token ids below the tiny vocabulary.
TINY_IDS = {"audio_token_id": 501, "boa_token_id": 505, "eoa_token_index": 506,
            "image_token_id": 500, "video_token_id": 502, "boi_token_id": 503, "eoi_token_id": 504}

QK_GAIN = 2.0  # q/k projection gain: attention logits up to a few tens, where the cap of 50 bends them


def _rng(seed: int, name: str) -> np.random.Generator:
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    key = tuple(int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4))
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=key))


def randomise_audio_tower(model: Any, seed: int) -> None:
    """Overwrite the audio tower's and ``embed_audio``'s parameters and buffers in place (see module docstring).

    Args:
        model: a transformers ``Gemma4ForConditionalGeneration`` (or ``Gemma4Model``) with an audio tower.
        seed: numpy seed; each tensor draws from its own stream keyed by its name.
    """
    state = model.state_dict()
    new: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if "audio_tower" not in name and "embed_audio" not in name:
            continue
        rng = _rng(seed, name)
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("input_min", "input_max", "output_min", "output_max"):
            gain = QK_GAIN if leaf.startswith("output") and (".q_proj." in name or ".k_proj." in name) else 1.0
            v = rng.uniform(1.5, 2.5) * gain * (-1.0 if leaf.endswith("min") else 1.0)
            new[name] = torch.tensor(v, dtype=t.dtype)
        elif leaf == "per_dim_scale":
            new[name] = torch.tensor(rng.normal(1.0, 1.0, t.shape), dtype=t.dtype)
        elif t.ndim == 1 and leaf == "bias":
            new[name] = torch.tensor(rng.normal(0.0, 0.5, t.shape), dtype=t.dtype)
        elif t.ndim == 1:  # RMSNorm / LayerNorm weights
            new[name] = torch.tensor(rng.uniform(0.5, 1.5, t.shape), dtype=t.dtype)
        else:  # linear [out, in] or conv [out, in/groups, *k]
            fan_in = int(np.prod(t.shape[1:]))
            gain = QK_GAIN if (".q_proj." in name or ".k_proj." in name) else 1.0
            new[name] = torch.tensor(rng.normal(0.0, gain / np.sqrt(fan_in), t.shape), dtype=t.dtype)
    _, unexpected = model.load_state_dict(new, strict=False)
    if unexpected:
        raise RuntimeError(f"unexpected tensors {unexpected[:3]}")


def make_tiny_audio_hf(out_dir: str | os.PathLike, seed: int = 0, audio: Mapping[str, Any] | None = None) -> Path:
    """Build, randomise and save a tiny ``Gemma4ForConditionalGeneration`` with an audio tower (fp32, eager).

    Args:
        out_dir: folder to write (``save_pretrained``: config.json + model.safetensors).
        seed: weight seed.
        audio: overrides of :data:`TINY_AUDIO`.

    Returns:
        ``Path(out_dir)``.
    """
    torch.manual_seed(seed)
    cfg = Gemma4Config(text_config=Gemma4TextConfig(**TINY_TEXT), vision_config=None,
                       audio_config=Gemma4AudioConfig(**{**TINY_AUDIO, **(audio or {})}), **TINY_IDS)
    cfg._attn_implementation = "eager"
    model = Gemma4ForConditionalGeneration(cfg).eval()
    randomise_audio_tower(model, seed)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


def audio_mmproj_metadata(cfg: AudioConfig) -> dict[str, tuple[Any, str]]:
    """The keys of an audio-only Gemma 4 mmproj: ``key -> (value, GGUFValueType name)``.

    Source: llama.cpp ``conversion/base.py`` ``MmprojModel.set_gguf_parameters``
    (``clip.has_audio_encoder``, ``clip.audio.projection_dim`` = text width,
    ``embedding_length``, ``feed_forward_length`` = 4 H, ``block_count``,
    ``attention.head_count``) and ``conversion/gemma.py``
    ``Gemma4VisionAudioModel.set_gguf_parameters`` (``clip.audio.projector_type
    = gemma4a``, ``num_mel_bins``, ``attention.layer_norm_epsilon``).
    """
    return {
        "general.type": ("mmproj", "STRING"),
        "general.file_type": (0, "UINT32"),  # ALL_F32
        "clip.has_vision_encoder": (False, "BOOL"),
        "clip.has_audio_encoder": (True, "BOOL"),
        "clip.audio.projector_type": ("gemma4a", "STRING"),
        "clip.audio.projection_dim": (cfg.text_hidden_size, "UINT32"),
        "clip.audio.embedding_length": (cfg.hidden_size, "UINT32"),
        "clip.audio.feed_forward_length": (4 * cfg.hidden_size, "UINT32"),
        "clip.audio.block_count": (cfg.num_hidden_layers, "UINT32"),
        "clip.audio.attention.head_count": (cfg.num_attention_heads, "UINT32"),
        "clip.audio.num_mel_bins": (cfg.n_mels, "UINT32"),
        "clip.audio.attention.layer_norm_epsilon": (float(cfg.rms_norm_eps), "FLOAT32"),
    }


def write_audio_mmproj(path: str | os.PathLike, cfg: AudioConfig, weights: Mapping[str, np.ndarray]) -> Path:
    """Write canonical audio weights as an F32 mmproj GGUF (``general.architecture = clip``).

    Args:
        path: output file.
        cfg: the encoder's config (keys from :func:`audio_mmproj_metadata`).
        weights: canonical name -> array for every tensor of
            :func:`reference.audio_weights.expected_audio_tensors` (e.g. an
            ``AudioWeights`` from an HF folder); written as float32, in that order.

    Returns:
        ``Path(path)``.

    Raises:
        KeyError: a tensor is missing from ``weights``.
        ValueError: a tensor has the wrong shape.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "clip")
    try:
        for key, (val, vtype) in audio_mmproj_metadata(cfg).items():
            w.add_key_value(key, val, VT[vtype])
        for name, shape in expected_audio_tensors(cfg).items():
            arr = np.ascontiguousarray(np.asarray(weights[name]), dtype=np.float32)
            if arr.shape != shape:
                raise ValueError(f"{name}: shape {arr.shape}, expected {shape}")
            w.add_tensor(name, arr)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    return path
