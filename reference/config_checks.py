"""The checks every config value goes through, from either source (:mod:`.config_gguf`, :mod:`.config_hf`): an integer
that must be positive, a positive finite float rounded through float32 (what both sources mean: :mod:`.config`), a
count under its bound, a per-layer array of the right length, and the per-layer facts that must fit together
(:func:`check_layers`). Each raises :class:`~.errors.ConfigError` naming the key.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .config import LayerSpec
from .errors import ConfigError


F32_MAX = float(np.finfo(np.float32).max)
"""The largest float32, as a Python float (a comparison with numpy's float32 scalar would run in float32: a larger
value overflows in the cast, with a warning)."""


def f32(x: float) -> float:
    """Round a Python float through float32 (see module docstring)."""
    return float(np.float32(x))


def positive_int(value: Any, key: str, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{key} = {value!r}: expected an integer")
    value = int(value)
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key} = {value}: expected a {'non-negative' if allow_zero else 'positive'} integer")
    return value


def positive_f32(value: Any, key: str) -> float:
    """A positive, finite number, rounded through float32 (see module docstring); stays positive and finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not 0 < float(value) <= F32_MAX or f32(value) == 0:  # compared in float64, not float32
        raise ConfigError(f"{key} = {value!r}: expected a positive finite number")
    return f32(value)


def at_most(value: int, limit: int, key: str, why: str) -> int:
    if value > limit:
        raise ConfigError(f"{key} = {value}: expected at most {limit} ({why})")
    return value


def per_layer(value: Any, n_layer: int, key: str, allow_zero: bool = False) -> list[int]:
    """A scalar broadcast to every layer, or a per-layer array of length n_layer."""
    if isinstance(value, (list, tuple, np.ndarray)):
        if len(value) != n_layer:
            raise ConfigError(f"{key}: per-layer array has {len(value)} entries, expected block count {n_layer}")
        return [positive_int(v, key, allow_zero) for v in value]
    return [positive_int(value, key, allow_zero)] * n_layer


def check_layers(layers: list[LayerSpec], hidden_size: int, where: str, names: Mapping[str, str] | None = None
                  ) -> None:
    names = names or {"head_count": "", "head_count_kv": "", "n_rot": "", "n_rot_swa": ""}
    for layer in layers:
        if layer.n_head % layer.n_kv_head:
            raise ConfigError(
                f"{where}: layer {layer.index}: head_count {layer.n_head}{names['head_count']} is not a multiple of "
                f"head_count_kv {layer.n_kv_head}{names['head_count_kv']}"
            )
        if layer.n_rot % 2 or layer.n_rot > layer.head_dim or layer.n_rot <= 0:
            raise ConfigError(
                f"{where}: layer {layer.index}: rope dimension count {layer.n_rot}"
                f"{names['n_rot_swa' if layer.is_sliding else 'n_rot']} must be even and <= head_dim {layer.head_dim}"
            )
        if layer.rope_freq_factors is not None and layer.rope_freq_factors.shape != (layer.n_rot // 2,):
            raise ConfigError(
                f"{where}: rope_freqs has shape {tuple(layer.rope_freq_factors.shape)}, "
                f"expected ({layer.n_rot // 2},) for layer {layer.index}"
            )
        if not layer.has_kv:
            donor = layers[layer.kv_donor]
            if (donor.head_dim, donor.n_kv_head) != (layer.head_dim, layer.n_kv_head):
                raise ConfigError(
                    f"{where}: shared layer {layer.index} (head_dim {layer.head_dim}, kv heads {layer.n_kv_head}) "
                    f"cannot read donor layer {donor.index} (head_dim {donor.head_dim}, kv heads {donor.n_kv_head})"
                )
