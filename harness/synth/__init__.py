"""Deterministic tiny synthetic Gemma 4 checkpoints, as HF safetensors and GGUF, from the same weights.

A *spec* (``cases/models/*.toml``, format in :mod:`.spec`) names a tiny Gemma 4 text decoder and a
seed. :func:`~.weights.make_weights` turns it into one set of float32 arrays under the canonical GGUF
tensor names of :mod:`reference.names`; :func:`~.hf.write_hf` writes those arrays through
transformers' own ``Gemma4TextConfig`` / ``Gemma4ForCausalLM`` and :func:`~.gguf.write_gguf` through
``gguf.GGUFWriter`` with llama.cpp's ``gemma4`` keys. :func:`~.cache.ensure_built` caches the result
per spec file and builder version. The per-layer table comes from one place,
:func:`reference.config_hf.config_from_hf` (:func:`~.spec.text_config`).

Modules: :mod:`.spec` (format and parser), :mod:`.weights`, :mod:`.hf`, :mod:`.gguf`, :mod:`.cache`,
:mod:`.prompts` (how ``cases/prompts/synthetic.jsonl`` was made).
"""

from __future__ import annotations

from .cache import BUILDER_VERSION, BuiltCase, build_case, case_key, ensure_built
from .gguf import BOS_ID, BYTE_BASE, EOS_ID, PAD_ID, UNK_ID, gguf_metadata, gguf_tensor_type, write_gguf
from .hf import logit_stats, write_hf
from .prompts import PROMPT_LAYOUT, PROMPT_SEED, make_prompts
from .spec import (
                   CONFIG_KEYS,
                   FULL,
                   INIT_DEFAULTS,
                   QTYPES,
                   REQUIRED_CONFIG_KEYS,
                   SLIDING,
                   Spec,
                   SpecError,
                   load_spec,
                   text_config,
)
from .weights import make_weights, rope_freqs, tensor_shapes

__all__ = [
    "BOS_ID", "BUILDER_VERSION", "BYTE_BASE", "BuiltCase", "CONFIG_KEYS", "EOS_ID", "FULL", "INIT_DEFAULTS",
    "PAD_ID", "PROMPT_LAYOUT", "PROMPT_SEED", "QTYPES", "REQUIRED_CONFIG_KEYS", "SLIDING", "Spec", "SpecError",
    "UNK_ID", "build_case", "case_key", "ensure_built", "gguf_metadata", "gguf_tensor_type", "load_spec",
    "logit_stats", "make_prompts", "make_weights", "rope_freqs", "tensor_shapes", "text_config", "write_gguf",
    "write_hf",
]
