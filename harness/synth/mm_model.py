"""A tiny synthetic Gemma 4 with a text decoder, a vision tower and an audio tower, saved as an HF folder.

:func:`build_tiny_mm_hf` writes ``Gemma4ForConditionalGeneration`` (fp32) whose three parts all carry
bug-revealing weights:

* the text decoder's weights come from :func:`harness.synth.make_weights` of a spec built from
  :data:`TINY_MM_TEXT` and :data:`TINY_MM_INIT` (bf16-representable, every norm and layer scalar
  randomised, small q/k norms so that fp32 noise stays far below the gates);
* the vision tower and ``embed_vision`` are randomised by
  :func:`harness.synth.mm_vision.randomise_vision_tower` (position table, norms, ``std_*``, clip bounds);
* the audio tower and ``embed_audio`` by :func:`harness.synth.mm_audio.randomise_audio_tower`.

The text side is made for the multimodal merge: ``use_bidirectional_attention = "vision"``, a
sliding window of 8 (a 60-token image is much longer), layer 0 full and layer 1 sliding (so one
forward shows the causal full layer and the bidirectional sliding layer at the first image token),
PLE, a KV-shared tail (a sliding and a full layer read donors) and a final softcap.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import (
    Gemma4AudioConfig,
    Gemma4Config,
    Gemma4ForConditionalGeneration,
    Gemma4ImageProcessorPil,
    Gemma4TextConfig,
    Gemma4VisionConfig,
)

from gemma4_harness.reference.names import gguf_to_hf

from .mm_audio import TINY_AUDIO, TINY_IDS, randomise_audio_tower
from .mm_vision import TINY_VISION, randomise_vision_tower
from .spec import INIT_DEFAULTS, Spec
from .weights import make_weights

_S, _F = "sliding_attention", "full_attention"

#: The text decoder (``Gemma4TextConfig`` fields): a six-layer decoder with every text feature the multimodal
#: merge touches (PLE, KV sharing, ``use_bidirectional_attention = "vision"``, softcap), layer 0 full.
TINY_MM_TEXT: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
    "layer_types": [_F, _S, _S, _F, _S, _F], "sliding_window": 8, "max_position_embeddings": 4096,
    "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 512, "num_kv_shared_layers": 2,
    "final_logit_softcapping": 30.0, "use_bidirectional_attention": "vision", "pad_token_id": 0,
    "bos_token_id": 2, "eos_token_id": 1, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
    "rope_parameters": {_S: {"rope_type": "default", "rope_theta": 10000.0},
                        _F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}},
}

#: Weight scales of the text decoder (the ``[init]`` of ``cases/models/e2b.toml``, whose comments give
#: the reasons: logits reach the softcap, median top-1 margin ~1, q/k norms small for scale-1 attention).
TINY_MM_INIT: dict[str, float] = {
    **INIT_DEFAULTS, "embed_std": 0.2, "output_std": 0.2, "ple_embed_std": 1.0, "linear_gain": 1.0,
    "norm_low": 0.6, "norm_high": 1.4, "qk_norm_low": 0.25, "qk_norm_high": 0.5, "post_norm_low": 1.0,
    "post_norm_high": 2.0, "output_norm_low": 1.5, "output_norm_high": 3.0, "layer_scalar_low": 0.5,
    "layer_scalar_high": 1.5,
}

MAX_SOFT_TOKENS = 70
"""The image processor's budget (a 50 x 80 image becomes 60 soft tokens)."""


def text_spec(seed: int, text: Mapping[str, Any] | None = None) -> Spec:
    """The text decoder as a :class:`~harness.synth.spec.Spec` (not read from a file: path and hash are
    placeholders), so that :func:`~harness.synth.make_weights` draws its weights."""
    cfg = {**copy.deepcopy(TINY_MM_TEXT), **copy.deepcopy(dict(text or {}))}
    return Spec(name="tiny-mm", description="tiny multimodal text decoder", seed=seed, config=cfg,
                init=dict(TINY_MM_INIT), path=Path("tiny-mm.toml"), sha256="")


def build_tiny_mm_hf(out_dir: str | os.PathLike, *, seed: int = 0, text: Mapping[str, Any] | None = None,
                     vision: Mapping[str, Any] | None = None, audio: Mapping[str, Any] | None = None,
                     clipped_vision: bool = True) -> Path:
    """Save a tiny random ``Gemma4ForConditionalGeneration`` (fp32, eager) with text, vision and audio.

    Args:
        out_dir: folder to write (``config.json``, ``model.safetensors``, ``preprocessor_config.json``).
        seed: weight seed (text, vision and audio draw from it).
        text, vision, audio: overrides of :data:`TINY_MM_TEXT`,
            :data:`harness.synth.mm_vision.TINY_VISION`, :data:`harness.synth.mm_audio.TINY_AUDIO`.
        clipped_vision: the vision tower's ``use_clipped_linears`` (bounds calibrated to bite).

    Returns:
        ``Path(out_dir)``.

    Raises:
        RuntimeError: the text weights do not match the model's language-model state dict.
    """
    spec = text_spec(seed, text)
    tcfg = Gemma4TextConfig(**copy.deepcopy(spec.config))
    vcfg = Gemma4VisionConfig(**{**TINY_VISION, **(vision or {}), "use_clipped_linears": clipped_vision})
    acfg = Gemma4AudioConfig(**{**TINY_AUDIO, **(audio or {})})
    cfg = Gemma4Config(text_config=tcfg, vision_config=vcfg, audio_config=acfg, **TINY_IDS)
    with torch.random.fork_rng(devices=[]):  # transformers' random init must not move the caller's RNG
        torch.manual_seed(seed)
        model = Gemma4ForConditionalGeneration(cfg).eval()
        load_text_weights(model, make_weights(spec))
        randomise_vision_tower(model, seed, clipped_vision)
        randomise_audio_tower(model, seed)
    out = Path(out_dir)
    model.save_pretrained(out)
    cfg_path = out / "config.json"  # as hf.write_hf: the two keys Google's checkpoints state
    raw = json.loads(cfg_path.read_text())
    raw["text_config"]["global_head_dim"] = spec.config["global_head_dim"]
    cfg_path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    Gemma4ImageProcessorPil(patch_size=vcfg.patch_size, pooling_kernel_size=vcfg.pooling_kernel_size,
                            max_soft_tokens=MAX_SOFT_TOKENS).save_pretrained(out)
    return out


def load_text_weights(model, weights: Mapping[str, np.ndarray]) -> None:
    """Copy the canonical text weights into ``model.language_model`` (names through
    :func:`reference.names.gguf_to_hf`); every language-model tensor must be covered."""
    state = model.state_dict()
    prefix = "model.language_model."
    expected = {gguf_to_hf(k, prefix=prefix): v for k, v in weights.items()}
    lm_keys = {k for k in state if k.startswith(prefix)}
    if set(expected) != lm_keys:
        raise RuntimeError(f"text weights do not match the language model: missing {sorted(lm_keys - set(expected))[:3]}, "
                           f"unexpected {sorted(set(expected) - lm_keys)[:3]}")
    new = {}
    for k, arr in expected.items():
        if tuple(state[k].shape) != arr.shape:
            raise RuntimeError(f"{k}: shape {arr.shape}, the model expects {tuple(state[k].shape)}")
        new[k] = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))
    model.load_state_dict(new, strict=False)
