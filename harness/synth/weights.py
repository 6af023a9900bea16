"""The weights of a synthetic case: drawn deterministically from the spec, bf16-representable float32.

Every tensor is drawn from its own ``numpy.random.default_rng`` seeded by the spec seed and a hash of
the tensor name, so a tensor's values do not depend on which other tensors exist. The scales come
from the spec's ``[init]`` table (:mod:`harness.synth.spec`); parameters that transformers
initialises to 1 are drawn from ranges so that a missing multiply shows.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Mapping

import numpy as np

from gemma4_harness.reference.config import expected_tensors

from .spec import FULL, Spec, text_config

#: Order of a layer's tensors in the files this package writes (GGUF tensor order; HF sorts its own).
_LAYER_ORDER = ("attn_norm.weight", "attn_q.weight", "attn_q_norm.weight", "attn_k.weight", "attn_k_norm.weight",
                "attn_v.weight", "attn_output.weight", "post_attention_norm.weight", "ffn_norm.weight",
                "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "post_ffw_norm.weight",
                "ffn_gate_inp.weight", "ffn_gate_inp.scale", "ffn_down_exps.scale", "ffn_gate_up_exps.weight",
                "ffn_down_exps.weight", "pre_ffw_norm_2.weight", "post_ffw_norm_1.weight", "post_ffw_norm_2.weight",
                "inp_gate.weight", "proj.weight", "post_norm.weight", "layer_output_scale.weight")
_HEAD = ("token_embd.weight", "per_layer_token_embd.weight", "per_layer_model_proj.weight",
         "per_layer_proj_norm.weight")
_TAIL = ("output_norm.weight", "output.weight")


def _file_order(name: str) -> tuple[int, int, int]:
    if name.startswith("blk."):
        _, il, rest = name.split(".", 2)
        return 1, int(il), _LAYER_ORDER.index(rest)
    if name in _HEAD:
        return 0, 0, _HEAD.index(name)
    return 2, 0, _TAIL.index(name)


def tensor_shapes(spec: Spec) -> dict[str, tuple[int, ...]]:
    """Canonical GGUF tensor names and numpy shapes of a spec's text decoder.

    Args:
        spec: a :class:`~harness.synth.spec.Spec`.

    Returns:
        An ordered dict ``name -> shape`` (numpy orientation: linear ``[out, in]``, experts
        ``[n_expert, out, in]``): global tensors first, then ``blk.0`` .. ``blk.N-1``, then
        ``output_norm`` and (untied only) ``output``. The set is
        :func:`reference.config.expected_tensors` of :func:`~harness.synth.spec.text_config`, the
        tensors every engine reads (``layer_output_scale`` included), so it equals the state dict of
        transformers' ``Gemma4ForCausalLM`` mapped with :func:`reference.names.hf_to_gguf` (tied
        ``lm_head`` excluded). ``rope_freqs`` is not included: it is derived (:func:`rope_freqs`).
    """
    shapes = expected_tensors(text_config(spec))
    return {k: shapes[k] for k in sorted(shapes, key=_file_order)}


def _rng(seed: int, name: str) -> np.random.Generator:
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    key = tuple(int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4))
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=key))


def _init_kind(name: str) -> str:
    suffix = name.split(".", 2)[-1] if name.startswith("blk.") else name
    if name == "token_embd.weight":
        return "embed"
    if name == "output.weight":
        return "output"
    if name == "per_layer_token_embd.weight":
        return "ple_embed"
    if suffix == "layer_output_scale.weight":
        return "layer_scalar"
    if suffix == "ffn_gate_inp.scale":
        return "router_scale"
    if suffix == "ffn_down_exps.scale":
        return "per_expert_scale"
    if suffix == "ffn_gate_inp.weight":
        return "router"
    if suffix in ("attn_q_norm.weight", "attn_k_norm.weight"):
        return "qk_norm"
    if suffix in ("post_attention_norm.weight", "post_ffw_norm.weight", "post_norm.weight"):
        return "post_norm"
    if name == "output_norm.weight":
        return "output_norm"
    if "norm" in suffix:
        return "norm"
    return "linear"


def make_weights(spec: Spec) -> dict[str, np.ndarray]:
    """Draw every weight of the spec's text decoder, deterministically from ``spec.seed``.

    Args:
        spec: a :class:`Spec` from :func:`load_spec`.

    Returns:
        Ordered dict ``canonical GGUF name -> np.ndarray`` (float32, C-contiguous,
        shapes from :func:`tensor_shapes`). Normal weights use the ``[init]`` stds
        (module docstring); every tensor that transformers initialises to 1 (all
        RMSNorm weights, ``layer_output_scale``, router ``scale`` and
        ``per_expert_scale``) is drawn uniform from its ``[init]`` range, so none
        is constant. Same spec (same seed and config) -> bit-identical arrays.
    """
    init = spec.init
    out: dict[str, np.ndarray] = {}
    for name, shape in tensor_shapes(spec).items():
        rng = _rng(spec.seed, name)
        kind = _init_kind(name)
        if kind in ("embed", "output", "ple_embed", "router"):
            std = init[{"embed": "embed_std", "output": "output_std",
                        "ple_embed": "ple_embed_std", "router": "router_std"}[kind]]
            arr = rng.standard_normal(shape) * std
        elif kind == "linear":
            arr = rng.standard_normal(shape) * (init["linear_gain"] / math.sqrt(shape[-1]))
        else:
            lo, hi = init[f"{kind}_low"], init[f"{kind}_high"]
            arr = rng.uniform(lo, hi, size=shape)
        out[name] = _round_to_bf16(np.ascontiguousarray(arr, dtype=np.float32))
    return out


def _round_to_bf16(a: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest bfloat16 (ties to even), kept as float32. [...] -> [...].

    Real Gemma checkpoints ship in bfloat16, so a bf16 engine reads them without
    re-rounding. Synthetic weights are made bf16-representable for the same reason:
    a bf16 run is then judged on its arithmetic, not on rounding the weights
    (which alone moves these small, sensitive models by a KLD of ~1e-3).
    """
    bits = a.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return rounded.astype(np.uint32).view(np.float32)


def rope_freqs(config: Mapping[str, Any]) -> np.ndarray:
    """llama.cpp's ``rope_freqs.weight`` for proportional RoPE on full-attention layers.

    Args:
        config: a spec ``[config]`` table.

    Returns:
        float32 ``[global_head_dim // 2]``: 1.0 for the first
        ``int(global_head_dim * partial_rotary_factor / 2)`` frequency pairs and
        1e30 for the rest (a divisor that makes those pairs' rotation angle zero,
        as ``convert_hf_to_gguf.py`` encodes ``rope_type = "proportional"``).
    """
    gd = config["global_head_dim"]
    full_rope = config["rope_parameters"].get(FULL, {})
    factor = float(full_rope.get("partial_rotary_factor", 1.0))
    n_rot = int(gd * factor / 2)
    f = np.full(gd // 2, 1e30, dtype=np.float32)
    f[:n_rot] = 1.0
    return f
