"""The model config from GGUF metadata (:func:`config_from_gguf`) and its full layers' RoPE factor table from the
``rope_freqs`` tensor (:func:`attach_rope_freqs`): every ``gemma4.*`` / ``gemma3.*`` key read, checked and mapped
onto :class:`~.config.ModelConfig` (:mod:`.config` says how the two sources agree).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

from .config import LayerSpec, ModelConfig, kv_donors
from .config_checks import at_most, check_layers, f32, per_layer, positive_f32, positive_int
from .errors import ConfigError


SUPPORTED_ARCHS = ("gemma4", "gemma3")

# Upper bounds of GGUF counts: llama.cpp llama-hparams.h LLAMA_MAX_LAYERS and LLAMA_MAX_EXPERTS; the
# context bound is a sanity limit (64 x the 262144 tokens of Gemma 4's longest), past which a value is corruption.
MAX_BLOCK_COUNT = 512
MAX_EXPERTS = 1024
MAX_CONTEXT_LENGTH = 1 << 24


def gguf_key_names(arch: str) -> dict[str, str]:
    """The GGUF keys behind the per-layer facts :func:`check_layers` checks, as message suffixes."""
    return {"head_count": f" ({arch}.attention.head_count)", "head_count_kv": f" ({arch}.attention.head_count_kv)",
            "n_rot": f" ({arch}.rope.dimension_count)", "n_rot_swa": f" ({arch}.rope.dimension_count_swa)"}


def config_from_gguf(meta: Mapping[str, Any], tensors: Mapping[str, tuple[int, ...]], source: str) -> ModelConfig:
    """Build the config from GGUF key/values and the tensor table.

    Args:
        meta: GGUF metadata, key -> Python value (arrays as lists).
        tensors: canonical tensor name -> numpy-order shape. Needed because some
            facts live only in the tensor list (k_eq_v = no ``attn_v``; MoE =
            ``ffn_gate_inp`` present; proportional RoPE = ``rope_freqs``; tied head).
        source: file path, for messages.

    Returns:
        :class:`ModelConfig`.

    Raises:
        ConfigError: unsupported architecture; a required key missing; a value of
            the wrong type or range; contradictory keys. The message names the key.

    Sources: llama.cpp ``src/models/gemma4.cpp`` / ``gemma3.cpp``
    ``load_arch_hparams`` and ``llama-model.cpp``; keys from gguf-py ``constants.py``.
    """
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ConfigError(
            f"{source}: general.architecture = {arch!r}: expected one of {', '.join(SUPPORTED_ARCHS)}"
        )
    a = arch

    def req(key: str) -> Any:
        full = f"{a}.{key}"
        if full not in meta:
            raise ConfigError(f"{source}: missing key {full}")
        return meta[full]

    def opt(key: str, default: Any = None) -> Any:
        return meta.get(f"{a}.{key}", default)

    n_layer = at_most(positive_int(req("block_count"), f"{source}: {a}.block_count"), MAX_BLOCK_COUNT,
                       f"{source}: {a}.block_count", "llama.cpp LLAMA_MAX_LAYERS")
    for name in tensors:  # a tensor of a layer beyond block_count: the count or the tensor is wrong
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit() and int(parts[1]) >= n_layer:
            raise ConfigError(f"{source}: tensor {name} belongs to layer {parts[1]}, but {a}.block_count = {n_layer}")
    hidden = positive_int(req("embedding_length"), f"{source}: {a}.embedding_length")
    n_head = per_layer(req("attention.head_count"), n_layer, f"{source}: {a}.attention.head_count")
    n_kv = per_layer(opt("attention.head_count_kv", n_head), n_layer, f"{source}: {a}.attention.head_count_kv")
    n_ff = per_layer(req("feed_forward_length"), n_layer, f"{source}: {a}.feed_forward_length")
    eps = req("attention.layer_norm_rms_epsilon")
    if not isinstance(eps, (float, int)) or not 0 < eps < 1 or f32(eps) == 0:
        raise ConfigError(f"{source}: {a}.attention.layer_norm_rms_epsilon = {eps!r}: expected 0 < eps < 1")

    head_dim = positive_int(opt("attention.key_length", hidden // n_head[0]), f"{source}: {a}.attention.key_length")
    v_len = opt("attention.value_length", head_dim)
    if v_len != head_dim:
        raise ConfigError(f"{source}: {a}.attention.value_length = {v_len} differs from key_length {head_dim}")

    if "token_embd.weight" not in tensors:
        raise ConfigError(f"{source}: missing tensor token_embd.weight")
    vocab = tensors["token_embd.weight"][0]
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) != vocab:
        raise ConfigError(
            f"{source}: tokenizer.ggml.tokens has {len(tokens)} entries but token_embd.weight has {vocab} rows"
        )

    # Layer types.
    pattern_key = f"{a}.attention.sliding_window_pattern"
    pattern = meta.get(pattern_key)
    if pattern is None:
        if a == "gemma4":
            raise ConfigError(f"{source}: missing key {pattern_key}")
        pattern = 6  # llama.cpp gemma3: hparams.set_swa_pattern(6)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != n_layer or not all(isinstance(p, (bool, np.bool_, int)) for p in pattern):
            raise ConfigError(f"{source}: {pattern_key}: expected {n_layer} booleans, got {pattern!r:.80}")
        is_sliding = [bool(p) for p in pattern]
    else:
        n = positive_int(pattern, f"{source}: {pattern_key}")
        # llama_hparams::set_swa_pattern: layer il is SWA iff il % n < n - 1.
        is_sliding = [(il % n) < (n - 1) for il in range(n_layer)]

    window = 0
    if any(is_sliding):
        window = positive_int(req("attention.sliding_window"), f"{source}: {a}.attention.sliding_window")

    head_dim_swa = head_dim
    if a == "gemma4" and any(is_sliding):
        head_dim_swa = positive_int(req("attention.key_length_swa"), f"{source}: {a}.attention.key_length_swa")
        v_swa = opt("attention.value_length_swa", head_dim_swa)
        if v_swa != head_dim_swa:
            raise ConfigError(
                f"{source}: {a}.attention.value_length_swa = {v_swa} differs from key_length_swa {head_dim_swa}"
            )

    # RoPE.
    base = positive_f32(opt("rope.freq_base", 10000.0), f"{source}: {a}.rope.freq_base")
    if a == "gemma3":
        base_swa = 10000.0  # llama.cpp gemma3: rope_freq_base_train_swa = 10000
    else:
        base_swa = positive_f32(opt("rope.freq_base_swa", base), f"{source}: {a}.rope.freq_base_swa")
    n_rot = positive_int(opt("rope.dimension_count", head_dim), f"{source}: {a}.rope.dimension_count")
    n_rot_swa = positive_int(opt("rope.dimension_count_swa", min(n_rot, head_dim_swa)),
                              f"{source}: {a}.rope.dimension_count_swa")
    scale = 1.0
    scaling_type = opt("rope.scaling.type")
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise ConfigError(f"{source}: {a}.rope.scaling.type = {scaling_type!r}: only 'linear' is supported")
        factor = positive_f32(opt("rope.scaling.factor"), f"{source}: {a}.rope.scaling.factor")
        scale = f32(1.0 / factor)
    # Sharing, PLE, MoE.
    n_shared = positive_int(opt("attention.shared_kv_layers", 0), f"{source}: {a}.attention.shared_kv_layers",
                             allow_zero=True)
    donors = kv_donors(is_sliding, n_shared, f"{source}: {a}.attention.shared_kv_layers")
    ple_dim = positive_int(opt("embedding_length_per_layer_input", 0),
                            f"{source}: {a}.embedding_length_per_layer_input", allow_zero=True)
    ple_vocab = tensors["per_layer_token_embd.weight"][0] if ple_dim and "per_layer_token_embd.weight" in tensors else 0
    if bool(ple_dim) != ("per_layer_token_embd.weight" in tensors):
        raise ConfigError(f"{source}: {a}.embedding_length_per_layer_input = {ple_dim} but tensor "
                          f"per_layer_token_embd.weight is {'missing' if ple_dim else 'present'}")
    has_moe = [f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(n_layer)]
    n_expert = n_used = n_ff_exp = 0
    if any(has_moe):
        n_expert = at_most(positive_int(req("expert_count"), f"{source}: {a}.expert_count"), MAX_EXPERTS,
                            f"{source}: {a}.expert_count", "llama.cpp LLAMA_MAX_EXPERTS")
        n_used = positive_int(req("expert_used_count"), f"{source}: {a}.expert_used_count")
        n_ff_exp = positive_int(req("expert_feed_forward_length"), f"{source}: {a}.expert_feed_forward_length")
        if n_used > n_expert:
            raise ConfigError(f"{source}: {a}.expert_used_count = {n_used} exceeds expert_count {n_expert}")

    softcap = opt("final_logit_softcapping")
    if softcap is not None:
        softcap = positive_f32(softcap, f"{source}: {a}.final_logit_softcapping")
    if a == "gemma3" and opt("attn_logit_softcapping") is not None:
        raise ConfigError(f"{source}: {a}.attn_logit_softcapping is set; Gemma 3 has no attention softcap")

    layers = []
    for i in range(n_layer):
        sl = is_sliding[i]
        hd = head_dim_swa if sl else head_dim
        has_kv = donors[i] == i
        has_v = has_kv and f"blk.{i}.attn_v.weight" in tensors
        if a == "gemma3" and not has_v:
            raise ConfigError(f"{source}: missing tensor blk.{i}.attn_v.weight")
        layers.append(LayerSpec(
            index=i, is_sliding=sl, n_head=n_head[i], n_kv_head=n_kv[i], head_dim=hd,
            has_kv=has_kv, kv_donor=donors[i], has_v_proj=has_v if has_kv else False,
            n_ff=n_ff[i], has_moe=has_moe[i],
            rope_base=base_swa if sl else base, n_rot=n_rot_swa if sl else n_rot,
            rope_freq_factors=None,
            rope_scale=1.0 if sl else scale,
        ))
    # Gemma4TextConfig: only full layers use K as V, and then all of them. A layer without attn_k has no K to
    # use as V: a target's missing attn_k is the loader's missing-tensor error; an MTP drafter has neither.
    own = [L for L in layers if L.has_kv and f"blk.{L.index}.attn_k.weight" in tensors]
    no_v = [L for L in own if not L.has_v_proj and (L.is_sliding or any(F.has_v_proj for F in own if not F.is_sliding))]
    if no_v:
        raise ConfigError(f"{source}: missing tensor blk.{no_v[0].index}.attn_v.weight (only full-attention layers may "
                          "use K as V, and then every one of them)")
    attn_scale = 1.0 if a == "gemma4" else 1.0 / math.sqrt(head_dim)
    cfg = ModelConfig(
        arch=a, source=source, vocab_size=vocab, hidden_size=hidden, n_layer=n_layer, rms_eps=f32(eps),
        sliding_window=window, context_length=at_most(
            positive_int(opt("context_length", 131072), f"{source}: {a}.context_length"), MAX_CONTEXT_LENGTH,
            f"{source}: {a}.context_length", "64 x Gemma 4's longest context"),
        final_logit_softcap=softcap, attn_scale=attn_scale, ple_dim=ple_dim, vocab_size_per_layer=ple_vocab,
        n_kv_shared=n_shared, n_expert=n_expert, n_expert_used=n_used, n_ff_exp=n_ff_exp,
        has_v_norm=a == "gemma4", has_layer_scalar=a == "gemma4",
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        layers=tuple(layers),
    )
    check_layers(list(cfg.layers), hidden, source, gguf_key_names(a))
    return cfg


def attach_rope_freqs(cfg: ModelConfig, rope_freqs: np.ndarray | None) -> ModelConfig:
    """Return ``cfg`` with the ``rope_freqs`` factor table set on every full layer.

    Args:
        cfg: config from :func:`config_from_gguf` or :func:`config_from_hf`.
        rope_freqs: float32 ``[n_rot // 2]`` factors (the GGUF ``rope_freqs.weight``
            tensor, kept exact), or None.

    Raises:
        ConfigError: the table's length does not match a full layer's ``n_rot // 2``.

    Source: llama.cpp ``gemma4.cpp``: full layers pass ``rope_freqs`` to
    ``ggml_rope_ext``; sliding layers pass none.
    """
    layers = []
    for layer in cfg.layers:
        if rope_freqs is not None and not layer.is_sliding:
            layer = dataclasses.replace(layer, rope_freq_factors=np.asarray(rope_freqs, dtype=np.float32).copy())
        layers.append(layer)
    out = dataclasses.replace(cfg, layers=tuple(layers))
    check_layers(list(out.layers), out.hidden_size, out.source, gguf_key_names(out.arch))
    return out
