"""Canonical tensor names: the GGUF names that llama.cpp uses for ``gemma4``.

Every loader maps its file onto these names, so the reference and the fast path
see one set of arrays whatever the file format. Arrays keep the numpy
orientation that both formats share: a linear weight is ``[out_features,
in_features]`` (GGUF ``ne`` reversed), a stacked expert weight is
``[n_expert, out, in]``.

Sources: llama.cpp ``gguf-py/gguf/constants.py`` (``MODEL_TENSORS[GEMMA4]``)
and ``convert_hf_to_gguf.py`` (``Gemma4Model.modify_tensors``), transformers
``models/gemma4/modeling_gemma4.py`` for the HF module names.
"""

from __future__ import annotations

import re

# Model-level tensors: HF name (after the ``model.`` prefix is removed) -> GGUF name.
GLOBAL_HF_TO_GGUF = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}

# Per-layer tensors: HF suffix after ``layers.{i}.`` -> GGUF suffix after ``blk.{i}.``.
LAYER_HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
    "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
    "layer_scalar": "layer_output_scale.weight",
    "per_layer_input_gate.weight": "inp_gate.weight",
    "per_layer_projection.weight": "proj.weight",
    "post_per_layer_input_norm.weight": "post_norm.weight",
}

# HF prefixes that hold the text decoder, longest first.
HF_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.")

_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")


def hf_to_gguf(name: str) -> str | None:
    """Map one HF safetensors tensor name onto its canonical GGUF name.

    Args:
        name: a key of an HF ``*.safetensors`` file, e.g.
            ``model.layers.3.self_attn.q_proj.weight`` or, in a multimodal
            checkpoint, ``model.language_model.layers.3.self_attn.q_proj.weight``.

    Returns:
        The GGUF name (``blk.3.attn_q.weight``), ``output.weight`` for
        ``lm_head.weight``, or ``None`` for a tensor outside the text decoder
        (vision tower, audio tower, multimodal embedders) or one the text model
        never reads (``v_norm`` has no weight).

    Source: llama.cpp ``gguf-py/gguf/tensor_mapping.py`` and
    ``convert_hf_to_gguf.py`` ``Gemma4Model.modify_tensors``.
    """
    if name == "lm_head.weight" or name.endswith(".lm_head.weight") and "language_model" in name:
        return "output.weight"
    for prefix in HF_TEXT_PREFIXES:
        if name.startswith(prefix):
            rest = name[len(prefix):]
            break
    else:
        return None
    if rest in GLOBAL_HF_TO_GGUF:
        return GLOBAL_HF_TO_GGUF[rest]
    m = _LAYER_RE.match(rest)
    if m is None:
        return None
    suffix = LAYER_HF_TO_GGUF.get(m.group(2))
    if suffix is None:
        return None
    return f"blk.{m.group(1)}.{suffix}"


def gguf_to_hf(name: str, prefix: str = "model.") -> str:
    """Inverse of :func:`hf_to_gguf` for the text decoder.

    Args:
        name: a canonical GGUF tensor name such as ``blk.0.attn_q.weight``.
        prefix: the HF prefix to put in front (``model.`` for a text-only
            checkpoint, ``model.language_model.`` for a multimodal one).

    Returns:
        The HF tensor name.

    Raises:
        KeyError: ``name`` is not a known Gemma 4 text tensor (``rope_freqs``
            has no HF counterpart; it is derived from ``rope_parameters``).
    """
    if name == "output.weight":
        return "lm_head.weight"
    for hf, gg in GLOBAL_HF_TO_GGUF.items():
        if gg == name:
            return prefix + hf
    m = re.match(r"^blk\.(\d+)\.(.+)$", name)
    if m:
        for hf, gg in LAYER_HF_TO_GGUF.items():
            if gg == m.group(2):
                return f"{prefix}layers.{m.group(1)}.{hf}"
    raise KeyError(name)
