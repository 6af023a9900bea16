"""The model config from an HF ``config.json`` (:func:`config_from_hf`): every ``Gemma4TextConfig`` /
``Gemma3TextConfig`` field read, checked and mapped onto :class:`~.config.ModelConfig`, with the defaults and the
tie-breaking transformers' code applies (:mod:`.config` says how the two sources agree).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from .config import LayerSpec, ModelConfig, kv_donors, proportional_freq_factors
from .config_checks import check_layers, f32, positive_f32, positive_int
from .errors import ConfigError


def _hf_text_config(raw: Mapping[str, Any], source: str) -> Mapping[str, Any]:
    mt = raw.get("model_type")
    if mt == "gemma4":
        tc = raw.get("text_config")
        if not isinstance(tc, Mapping):
            raise ConfigError(f"{source}: model_type 'gemma4' without a text_config object")
        tc = dict(tc)
        tc.setdefault("model_type", "gemma4_text")
        if "tie_word_embeddings" in raw and "tie_word_embeddings" not in tc:
            tc["tie_word_embeddings"] = raw["tie_word_embeddings"]
        return tc
    if mt == "gemma4_text":
        return raw
    raise ConfigError(f"{source}: model_type = {mt!r}: expected 'gemma4_text' or 'gemma4' (with text_config)")


def _hf_number(v: Any, key: str, lo: float | None = None, hi: float | None = None, hi_closed: bool = False) -> float:
    """A config.json number as transformers computes with it: an int or float (not a bool, not a string: the model
    adds and multiplies it), finite, in ``(lo, hi)`` (``hi_closed``: ``(lo, hi]``).

    Raises:
        ConfigError: ``<key> = <value>: expected ...`` (``key`` carries the file).
    """
    rng = "" if lo is None and hi is None else f" in ({lo:g}, {hi:g}{']' if hi_closed else ')'}" if hi is not None \
        else f" > {lo:g}"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or \
            (lo is not None and not v > lo) or (hi is not None and not (v <= hi if hi_closed else v < hi)):
        raise ConfigError(f"{key} = {v!r:.40}: expected a finite number{rng}")
    return float(v)


def config_from_hf(raw: Mapping[str, Any], source: str) -> ModelConfig:
    """Build the config from an HF ``config.json`` (text-only or multimodal).

    Defaults and derivations follow transformers 5.23 ``Gemma4TextConfig``:
    missing ``layer_types`` -> every 6th layer full; the last layer is forced to
    full; missing ``rope_parameters`` -> sliding theta 1e4 / full proportional
    (0.25, theta 1e6); ``per_layer_config`` (as saved by transformers) or else
    ``global_head_dim`` (default 512) and ``num_global_key_value_heads`` (only
    with ``attention_k_eq_v``) for full layers.

    Args:
        raw: the parsed JSON object.
        source: path, for messages.

    Returns:
        :class:`ModelConfig` (arch ``gemma4``).

    Raises:
        ConfigError: wrong model_type, unsupported options (``use_bidirectional_attention``
            other than ``"vision"``, attention bias, another activation), bad or contradictory
            values. The message names the field.
    """
    c = _hf_text_config(raw, source)

    def get(key: str, default: Any = None) -> Any:
        v = c.get(key, default)
        return default if v is None else v

    def req(key: str) -> Any:
        if c.get(key) is None:
            raise ConfigError(f"{source}: missing field {key}")
        return c[key]

    n_layer = positive_int(req("num_hidden_layers"), f"{source}: num_hidden_layers")
    hidden = positive_int(req("hidden_size"), f"{source}: hidden_size")
    vocab = positive_int(req("vocab_size"), f"{source}: vocab_size")
    n_head = positive_int(req("num_attention_heads"), f"{source}: num_attention_heads")
    n_kv = positive_int(get("num_key_value_heads", n_head), f"{source}: num_key_value_heads")
    head_dim = positive_int(get("head_dim", 256), f"{source}: head_dim")
    n_ff = positive_int(req("intermediate_size"), f"{source}: intermediate_size")
    eps = _hf_number(get("rms_norm_eps", 1e-6), f"{source}: rms_norm_eps", lo=0.0, hi=1.0)
    bidir = get("use_bidirectional_attention")
    if bidir not in (None, "vision"):
        raise ConfigError(f"{source}: use_bidirectional_attention = {bidir!r}: expected null or 'vision' "
                          "(bidirectional attention over all tokens is not supported)")
    if get("attention_bias", False):
        raise ConfigError(f"{source}: attention_bias = true is not supported (Gemma 4 has no attention bias)")
    act = get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"{source}: hidden_activation = {act!r}: expected 'gelu_pytorch_tanh'")

    types = get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layer)]
    if not isinstance(types, (list, tuple)):
        raise ConfigError(f"{source}: layer_types = {types!r:.40}: expected a list of 'sliding_attention' / "
                          "'full_attention'")
    types = list(types)
    if len(types) != n_layer:
        raise ConfigError(f"{source}: layer_types has {len(types)} entries, expected num_hidden_layers {n_layer}")
    bad = [t for t in types if not isinstance(t, str) or t not in ("sliding_attention", "full_attention")]
    if bad:
        raise ConfigError(f"{source}: layer_types contains {bad[0]!r}")
    types[-1] = "full_attention"  # Gemma4TextConfig.__post_init__ forces this
    is_sliding = [t == "sliding_attention" for t in types]

    rope = get("rope_parameters") or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    }
    if not isinstance(rope, Mapping):
        raise ConfigError(f"{source}: rope_parameters = {rope!r:.40}: expected an object keyed by layer type")

    k_eq_v = bool(get("attention_k_eq_v", False))
    per_layer = c.get("per_layer_config")
    overrides: dict[int, dict[str, Any]] = {}
    if per_layer is not None:
        if not isinstance(per_layer, Mapping):
            raise ConfigError(f"{source}: per_layer_config: expected an object keyed by layer index")
        for k, v in per_layer.items():
            try:
                idx = int(k)
            except (TypeError, ValueError):
                raise ConfigError(f"{source}: per_layer_config key {k!r}: expected a layer index") from None
            if not 0 <= idx < n_layer:
                raise ConfigError(f"{source}: per_layer_config key {k!r}: layer out of range")
            if not isinstance(v, Mapping):
                raise ConfigError(f"{source}: per_layer_config[{k!r}]: expected an object of layer fields, "
                                  f"got {type(v).__name__}")
            overrides[idx] = dict(v)
    else:
        glob = {"head_dim": get("global_head_dim", 512)}
        gkv = c.get("num_global_key_value_heads")
        if k_eq_v and gkv is not None:
            glob["num_key_value_heads"] = gkv
        overrides = {i: dict(glob) for i in range(n_layer) if not is_sliding[i]}

    n_shared = positive_int(get("num_kv_shared_layers", 0), f"{source}: num_kv_shared_layers", allow_zero=True)
    donors = kv_donors(is_sliding, n_shared, f"{source}: num_kv_shared_layers")
    double = bool(get("use_double_wide_mlp", False))
    ple_dim = positive_int(get("hidden_size_per_layer_input", 0) or 0, f"{source}: hidden_size_per_layer_input",
                            allow_zero=True)
    moe = bool(get("enable_moe_block", False))
    n_expert = n_used = n_ff_exp = 0
    if moe:
        n_expert = positive_int(req("num_experts"), f"{source}: num_experts")
        n_used = positive_int(req("top_k_experts"), f"{source}: top_k_experts")
        n_ff_exp = positive_int(req("moe_intermediate_size"), f"{source}: moe_intermediate_size")
        if n_used > n_expert:
            raise ConfigError(f"{source}: top_k_experts = {n_used} exceeds num_experts {n_expert}")

    layers = []
    for i in range(n_layer):
        sl = is_sliding[i]
        ov = overrides.get(i, {})
        hd = positive_int(ov.get("head_dim", head_dim), f"{source}: per_layer_config[{i}].head_dim")
        kvh = positive_int(ov.get("num_key_value_heads", n_kv), f"{source}: per_layer_config[{i}].num_key_value_heads")
        tname = types[i]
        rp = rope.get(tname)
        if not isinstance(rp, Mapping):
            raise ConfigError(f"{source}: rope_parameters.{tname}: missing")
        rtype = rp.get("rope_type", "default")
        theta = rp.get("rope_theta")
        theta = positive_f32(theta, f"{source}: rope_parameters.{tname}.rope_theta")
        factor = _hf_number(rp.get("factor", 1.0), f"{source}: rope_parameters.{tname}.factor", lo=0.0)
        prf = _hf_number(rp.get("partial_rotary_factor", 1.0),
                         f"{source}: rope_parameters.{tname}.partial_rotary_factor", lo=0.0, hi=1.0, hi_closed=True)
        ff = None
        if rtype == "proportional":
            n_rot = hd
            ff = proportional_freq_factors(hd, prf)
        elif rtype == "default":
            n_rot = int(hd * rp.get("partial_rotary_factor", 1.0))
        elif rtype == "linear":
            n_rot = hd
        else:
            raise ConfigError(f"{source}: rope_parameters.{tname}.rope_type = {rtype!r}: expected default, "
                              "proportional or linear")
        has_kv = donors[i] == i
        layers.append(LayerSpec(
            index=i, is_sliding=sl, n_head=n_head, n_kv_head=kvh, head_dim=hd,
            has_kv=has_kv, kv_donor=donors[i], has_v_proj=has_kv and not (k_eq_v and not sl),
            n_ff=n_ff * (2 if double and not has_kv else 1), has_moe=moe,
            rope_base=theta, n_rot=n_rot, rope_freq_factors=ff,
            rope_scale=positive_f32(1.0 / factor, f"{source}: 1 / rope_parameters.{tname}.factor"),
        ))
    check_layers(layers, hidden, source)
    softcap = c.get("final_logit_softcapping")
    if softcap is not None:
        softcap = positive_f32(softcap, f"{source}: final_logit_softcapping")
    eos = c.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    for key, tid in (("bos_token_id", c.get("bos_token_id")), ("eos_token_id", eos),
                     ("pad_token_id", c.get("pad_token_id"))):
        if tid is not None and (isinstance(tid, bool) or not isinstance(tid, int) or tid < 0):
            raise ConfigError(f"{source}: {key} = {tid!r:.40}: expected a token id (an integer >= 0), a list of them "
                              "(eos) or null")
    return ModelConfig(
        arch="gemma4", source=source, vocab_size=vocab, hidden_size=hidden, n_layer=n_layer, rms_eps=f32(eps),
        sliding_window=positive_int(get("sliding_window", 512), f"{source}: sliding_window") if any(is_sliding) else 0,
        context_length=positive_int(get("max_position_embeddings", 131072), f"{source}: max_position_embeddings"),
        final_logit_softcap=None if softcap is None else f32(softcap), attn_scale=1.0,
        ple_dim=ple_dim, vocab_size_per_layer=positive_int(get("vocab_size_per_layer_input", vocab),
                                                           f"{source}: vocab_size_per_layer_input") if ple_dim else 0,
        n_kv_shared=n_shared, n_expert=n_expert, n_expert_used=n_used, n_ff_exp=n_ff_exp,
        has_v_norm=True, has_layer_scalar=True, tie_word_embeddings=bool(get("tie_word_embeddings", True)),
        bos_token_id=c.get("bos_token_id"), eos_token_id=eos, pad_token_id=c.get("pad_token_id"),
        layers=tuple(layers), use_bidirectional_attention=bidir,
    )
