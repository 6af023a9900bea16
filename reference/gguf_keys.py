"""The GGUF types of the keys this harness reads, as llama.cpp reads them (:mod:`.gguf_check`): a known key of
another type, or an unknown key one character from an ``<arch>.*`` key the model reads that the file does not hold,
is one :class:`~.errors.ConfigError` line (:func:`key_type_error`, :func:`check_key_types`).
"""

from __future__ import annotations

from typing import Any

from .config import one_edit_apart
from .errors import ConfigError
from .gguf_read import ARRAY, BOOL, F32, I32, STRING, U32, type_name


# Types of the keys the harness reads, as llama.cpp reads them (get_key<uint32_t>
# wants UINT32, get_key<float> FLOAT32; per-layer values are UINT32 or an
# INT32/UINT32 array; the sliding-window pattern a BOOL/INT32/UINT32 array).
_UINT = {(U32, None)}
_FLOAT = {(F32, None)}
_STR = {(STRING, None)}
_PER_LAYER = {(U32, None), (ARRAY, U32), (ARRAY, I32)}
_ARCH_KEYS: dict[str, set] = {
    **{k: _UINT for k in (
        "context_length", "embedding_length", "block_count", "attention.key_length", "attention.value_length",
        "attention.key_length_swa", "attention.value_length_swa", "attention.sliding_window",
        "attention.shared_kv_layers", "embedding_length_per_layer_input", "rope.dimension_count",
        "rope.dimension_count_swa", "expert_count")},
    **{k: _PER_LAYER for k in (
        "feed_forward_length", "attention.head_count", "attention.head_count_kv", "expert_used_count",
        "expert_feed_forward_length")},
    **{k: _FLOAT for k in (
        "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.freq_base_swa", "rope.scaling.factor",
        "final_logit_softcapping", "attn_logit_softcapping")},
    "rope.scaling.type": _STR,
    "attention.sliding_window_pattern": {(ARRAY, BOOL), (ARRAY, I32), (ARRAY, U32), (U32, None)},
}
_GENERAL_KEYS: dict[str, set] = {
    "general.architecture": _STR,
    "general.alignment": _UINT,
    "tokenizer.ggml.tokens": {(ARRAY, STRING)},
    "tokenizer.ggml.scores": {(ARRAY, F32)},
    "tokenizer.ggml.token_type": {(ARRAY, I32)},
    **{f"tokenizer.ggml.{k}_token_id": _UINT for k in ("bos", "eos", "padding", "unknown")},
}


def key_type_error(path: str, key: str, got: tuple[int, int | None], arch: Any) -> ConfigError | None:
    """The error for a known key of the wrong GGUF type (unknown keys: :func:`_near_miss_error`, once every key is
    read)."""
    prefix = f"{arch}." if isinstance(arch, str) else None
    allowed = _GENERAL_KEYS.get(key)
    if allowed is None and prefix and key.startswith(prefix):
        allowed = _ARCH_KEYS.get(key[len(prefix):])
    if allowed is None or got in allowed or (got[0] == ARRAY and got[1] is None
                                             and any(t[0] == ARRAY for t in allowed)):
        return None

    def show(t):
        return type_name(t[0]) if t[1] is None else f"ARRAY of {type_name(t[1])}"
    want = " or ".join(sorted(show(t) for t in allowed))
    return ConfigError(f"{path}: key {key} has GGUF type {show(got)}, expected {want} "
                       "(llama.cpp reads it as that type and refuses any other)")


def check_key_types(path: str, types: dict[str, tuple[int, int | None]], meta: dict[str, Any]) -> None:
    """Keys read before ``general.architecture`` was known are checked here, after the whole section; then the
    unknown keys (:func:`_near_miss_error`)."""
    arch = meta.get("general.architecture")
    for key, got in types.items():
        err = key_type_error(path, key, got, arch) or _near_miss_error(path, key, meta, arch)
        if err:
            raise err


def _near_miss_error(path: str, key: str, meta: dict[str, Any], arch: Any) -> ConfigError | None:
    """An unknown key one character from an ``<arch>.*`` key the model reads that the file does not hold: a
    misspelt or damaged name, which would read as absent (another model, silently). Any other unknown key is
    allowed: ``gemma3.context_length`` beside ``gemma4.context_length`` in a gemma4 file is not a misspelling."""
    prefix = f"{arch}." if isinstance(arch, str) else None
    if prefix is None or key in _GENERAL_KEYS or (key.startswith(prefix) and key[len(prefix):] in _ARCH_KEYS):
        return None
    near = [prefix + k for k in _ARCH_KEYS if one_edit_apart(key, prefix + k) and prefix + k not in meta]
    if not near:
        return None
    return ConfigError(f"{path}: key {key} is unknown, one character from {near[0]}, which the file does not hold "
                       "(a misspelt or damaged name; the model would read that key as absent)")
