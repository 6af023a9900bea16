"""One model config for Gemma 4 (and Gemma 3), from GGUF metadata or an HF config.json.

The per-layer tables are derived once, here, in the style of llama.cpp's
``llama_hparams`` accessors (``is_swa(il)``, ``n_embd_head_k(il)``,
``n_head_kv(il)``, ``n_ff(il)``, ``n_rot(il)``, ``has_kv(il)``): every engine
reads them from :class:`LayerSpec` instead of re-deriving them.

Where the two sources disagree, transformers' Gemma 4 code is the tie-breaker
(``docs/design.md``). In particular:

* the KV donor of a shared layer is the *last non-shared layer of the same
  type* (``Gemma4TextConfig.kv_sharing_modes``);
* ``num_global_key_value_heads`` only applies when ``attention_k_eq_v`` is set
  (``Gemma4TextConfig.__post_init__``);
* proportional RoPE on full layers rotates ``partial_rotary_factor * head_dim``
  dims with exponents over the *full* head_dim. GGUF encodes this as
  ``rope.dimension_count = head_dim`` plus a ``rope_freqs`` tensor of factors
  (1 for rotated pairs, 1e30 for the rest); an HF config gets the identical
  factor table here, so both formats yield the same config bit for bit.

Floating-point fields (eps, RoPE bases, softcap) are rounded through float32:
GGUF stores them as float32, and transformers adds them to float32 tensors, so
float32 is what both sources mean.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from .errors import ConfigError

SUPPORTED_ARCHS = ("gemma4", "gemma3")

# Upper bounds of GGUF counts: llama.cpp llama-hparams.h LLAMA_MAX_LAYERS and LLAMA_MAX_EXPERTS; the
# context bound is a sanity limit (64 x the 262144 tokens of Gemma 4's longest), past which a value is corruption.
MAX_BLOCK_COUNT = 512
MAX_EXPERTS = 1024
MAX_CONTEXT_LENGTH = 1 << 24

# llama.cpp convert_hf_to_gguf.py Gemma4Model.generate_extra_tensors: factor for unrotated pairs.
UNROTATED_FREQ_FACTOR = 1e30


F32_MAX = float(np.finfo(np.float32).max)
"""The largest float32, as a Python float (a comparison with numpy's float32 scalar would run in float32: a larger
value overflows in the cast, with a warning)."""


def _f32(x: float) -> float:
    """Round a Python float through float32 (see module docstring)."""
    return float(np.float32(x))


@dataclass(frozen=True)
class LayerSpec:
    """Per-layer facts, derived once from the metadata.

    Attributes:
        index: layer number, 0-based.
        is_sliding: sliding-window (local) attention; else full causal (global).
        n_head: query heads.
        n_kv_head: key/value heads (GQA groups = n_head // n_kv_head).
        head_dim: per-head width for q, k and v, in elements.
        has_kv: computes its own K/V; False on a KV-shared layer.
        kv_donor: layer whose K/V this layer reads (itself when ``has_kv``).
        has_v_proj: has a V projection; False on a k_eq_v layer (V = K projection
            output, before k_norm and RoPE).
        n_ff: dense FFN width.
        has_moe: runs the router + experts branch beside the dense FFN.
        rope_base: RoPE theta.
        n_rot: rotated dims (llama.cpp ``n_rot``), even, <= head_dim.
        rope_freq_factors: float32 ``[n_rot // 2]`` divisors of the inverse
            frequencies (llama.cpp ``rope_freqs``) or None.
        rope_scale: linear RoPE position scale (1 / rope scaling factor).
    """

    index: int
    is_sliding: bool
    n_head: int
    n_kv_head: int
    head_dim: int
    has_kv: bool
    kv_donor: int
    has_v_proj: bool
    n_ff: int
    has_moe: bool
    rope_base: float
    n_rot: int
    rope_freq_factors: np.ndarray | None = field(default=None, compare=False)
    rope_scale: float = 1.0

    @property
    def type_name(self) -> str:
        """``sliding_attention`` or ``full_attention`` (HF ``layer_types`` names)."""
        return "sliding_attention" if self.is_sliding else "full_attention"


@dataclass(frozen=True)
class ModelConfig:
    """Model-wide hyper-parameters plus the per-layer table ``layers``.

    Attributes:
        arch: ``gemma4`` or ``gemma3``.
        source: the file the config came from (for messages).
        vocab_size, hidden_size, n_layer: sizes.
        rms_eps: RMSNorm epsilon (float32-rounded).
        sliding_window: tokens a sliding layer sees, the current one included
            (query i attends key j iff 0 <= i - j < sliding_window).
        context_length: trained context (prompts longer than this are refused).
        final_logit_softcap: ``c`` in ``c * tanh(logits / c)``; None = off.
        attn_scale: factor on q.k (1.0 for Gemma 4; 1/sqrt(head_dim) for Gemma 3).
        ple_dim: per-layer-embedding width (0 = no PLE).
        vocab_size_per_layer: rows of the PLE table.
        n_kv_shared: number of trailing layers that reuse a donor's K/V.
        n_expert, n_expert_used, n_ff_exp: MoE sizes (0 when no MoE).
        has_v_norm: RMSNorm without weight on V (Gemma 4).
        has_layer_scalar: ``layer_output_scale`` multiplies the whole stream (Gemma 4).
        tie_word_embeddings: output head is ``token_embd`` (no ``output.weight``).
        bos_token_id, eos_token_id, pad_token_id: special ids when known.
        layers: one :class:`LayerSpec` per layer.
        use_bidirectional_attention: ``"vision"``: on sliding layers an image or video soft token also
            sees the later tokens of its own image when ``mm_token_type_ids`` are given
            (:func:`reference.multimodal.block_ids`); None: causal everywhere. HF
            ``Gemma4TextConfig.use_bidirectional_attention``; a GGUF has no key for it (llama.cpp's mtmd
            decides by the hidden size), so a GGUF config holds None.
    """

    arch: str
    source: str
    vocab_size: int
    hidden_size: int
    n_layer: int
    rms_eps: float
    sliding_window: int
    context_length: int
    final_logit_softcap: float | None
    attn_scale: float
    ple_dim: int
    vocab_size_per_layer: int
    n_kv_shared: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    has_v_norm: bool
    has_layer_scalar: bool
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    layers: tuple[LayerSpec, ...]
    use_bidirectional_attention: str | None = None

    def layer_types(self) -> list[str]:
        """HF-style ``layer_types`` list."""
        return [layer.type_name for layer in self.layers]

    def summary(self) -> dict[str, Any]:
        """A JSON-able description (for reports); rope factors are summarised."""
        return {
            "arch": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "n_layer": self.n_layer,
            "sliding_window": self.sliding_window,
            "final_logit_softcap": self.final_logit_softcap,
            "ple_dim": self.ple_dim,
            "n_kv_shared": self.n_kv_shared,
            "n_expert": self.n_expert,
            "layer_types": ["S" if l.is_sliding else "F" for l in self.layers],
            "kv_donor": [l.kv_donor for l in self.layers],
            "head_dim": [l.head_dim for l in self.layers],
            "n_kv_head": [l.n_kv_head for l in self.layers],
            "n_ff": [l.n_ff for l in self.layers],
            "has_v_proj": [l.has_v_proj for l in self.layers],
        }


# --------------------------------------------------------------------------- helpers


def kv_donors(is_sliding: list[bool], n_kv_shared: int, key: str) -> list[int]:
    """KV donor of every layer by transformers' rule.

    Layers ``[n_layer - n_kv_shared, n_layer)`` are shared; each reads the last
    non-shared layer of its own type. Others donate to themselves.

    Args:
        is_sliding: per-layer type flags, length n_layer.
        n_kv_shared: number of trailing shared layers.
        key: the metadata key to name in errors.

    Returns:
        list of donor indices, length n_layer.

    Raises:
        ConfigError: n_kv_shared out of range, or a shared layer whose type has no
            non-shared layer to read from.

    Source: transformers ``Gemma4TextConfig.kv_sharing_modes``.
    """
    n_layer = len(is_sliding)
    if not 0 <= n_kv_shared < n_layer or (n_kv_shared and n_kv_shared >= n_layer):
        raise ConfigError(f"{key} = {n_kv_shared}: expected 0 <= value < block count {n_layer}")
    first_shared = n_layer - n_kv_shared
    donors = list(range(n_layer))
    for i in range(first_shared, n_layer):
        same = [j for j in range(first_shared) if is_sliding[j] == is_sliding[i]]
        if not same:
            kind = "sliding" if is_sliding[i] else "full"
            raise ConfigError(
                f"{key} = {n_kv_shared}: shared layer {i} is {kind} but no non-shared {kind} layer precedes it"
            )
        donors[i] = same[-1]
    return donors


def proportional_freq_factors(head_dim: int, partial_rotary_factor: float) -> np.ndarray:
    """RoPE frequency factors that express proportional RoPE in llama.cpp's terms.

    Args:
        head_dim: full head width of the layer.
        partial_rotary_factor: fraction of dims that rotate.

    Returns:
        float32 ``[head_dim // 2]``: 1.0 for the first ``int(head_dim * p / 2)``
        pairs, 1e30 (no rotation) for the rest.

    Source: llama.cpp ``convert_hf_to_gguf.py`` ``Gemma4Model.generate_extra_tensors``;
    transformers ``_compute_proportional_rope_parameters`` (exponents over head_dim).
    """
    n_rot_pairs = int(head_dim * partial_rotary_factor / 2)
    values = [1.0] * n_rot_pairs + [UNROTATED_FREQ_FACTOR] * (head_dim // 2 - n_rot_pairs)
    return np.asarray(values, dtype=np.float32)


def _positive_int(value: Any, key: str, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{key} = {value!r}: expected an integer")
    value = int(value)
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key} = {value}: expected a {'non-negative' if allow_zero else 'positive'} integer")
    return value


def _positive_f32(value: Any, key: str) -> float:
    """A positive, finite number, rounded through float32 (see module docstring); stays positive and finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not 0 < float(value) <= F32_MAX or _f32(value) == 0:  # compared in float64, not float32
        raise ConfigError(f"{key} = {value!r}: expected a positive finite number")
    return _f32(value)


def _at_most(value: int, limit: int, key: str, why: str) -> int:
    if value > limit:
        raise ConfigError(f"{key} = {value}: expected at most {limit} ({why})")
    return value


def _per_layer(value: Any, n_layer: int, key: str, allow_zero: bool = False) -> list[int]:
    """A scalar broadcast to every layer, or a per-layer array of length n_layer."""
    if isinstance(value, (list, tuple, np.ndarray)):
        if len(value) != n_layer:
            raise ConfigError(f"{key}: per-layer array has {len(value)} entries, expected block count {n_layer}")
        return [_positive_int(v, key, allow_zero) for v in value]
    return [_positive_int(value, key, allow_zero)] * n_layer


def _gguf_key_names(arch: str) -> dict[str, str]:
    """The GGUF keys behind the per-layer facts :func:`_check_layers` checks, as message suffixes."""
    return {"head_count": f" ({arch}.attention.head_count)", "head_count_kv": f" ({arch}.attention.head_count_kv)",
            "n_rot": f" ({arch}.rope.dimension_count)", "n_rot_swa": f" ({arch}.rope.dimension_count_swa)"}


def _check_layers(layers: list[LayerSpec], hidden_size: int, where: str, names: Mapping[str, str] | None = None
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


# --------------------------------------------------------------------------- GGUF


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

    n_layer = _at_most(_positive_int(req("block_count"), f"{source}: {a}.block_count"), MAX_BLOCK_COUNT,
                       f"{source}: {a}.block_count", "llama.cpp LLAMA_MAX_LAYERS")
    for name in tensors:  # a tensor of a layer beyond block_count: the count or the tensor is wrong
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit() and int(parts[1]) >= n_layer:
            raise ConfigError(f"{source}: tensor {name} belongs to layer {parts[1]}, but {a}.block_count = {n_layer}")
    hidden = _positive_int(req("embedding_length"), f"{source}: {a}.embedding_length")
    n_head = _per_layer(req("attention.head_count"), n_layer, f"{source}: {a}.attention.head_count")
    n_kv = _per_layer(opt("attention.head_count_kv", n_head), n_layer, f"{source}: {a}.attention.head_count_kv")
    n_ff = _per_layer(req("feed_forward_length"), n_layer, f"{source}: {a}.feed_forward_length")
    eps = req("attention.layer_norm_rms_epsilon")
    if not isinstance(eps, (float, int)) or not 0 < eps < 1 or _f32(eps) == 0:
        raise ConfigError(f"{source}: {a}.attention.layer_norm_rms_epsilon = {eps!r}: expected 0 < eps < 1")

    head_dim = _positive_int(opt("attention.key_length", hidden // n_head[0]), f"{source}: {a}.attention.key_length")
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
        n = _positive_int(pattern, f"{source}: {pattern_key}")
        # llama_hparams::set_swa_pattern: layer il is SWA iff il % n < n - 1.
        is_sliding = [(il % n) < (n - 1) for il in range(n_layer)]

    window = 0
    if any(is_sliding):
        window = _positive_int(req("attention.sliding_window"), f"{source}: {a}.attention.sliding_window")

    head_dim_swa = head_dim
    if a == "gemma4" and any(is_sliding):
        head_dim_swa = _positive_int(req("attention.key_length_swa"), f"{source}: {a}.attention.key_length_swa")
        v_swa = opt("attention.value_length_swa", head_dim_swa)
        if v_swa != head_dim_swa:
            raise ConfigError(
                f"{source}: {a}.attention.value_length_swa = {v_swa} differs from key_length_swa {head_dim_swa}"
            )

    # RoPE.
    base = _positive_f32(opt("rope.freq_base", 10000.0), f"{source}: {a}.rope.freq_base")
    if a == "gemma3":
        base_swa = 10000.0  # llama.cpp gemma3: rope_freq_base_train_swa = 10000
    else:
        base_swa = _positive_f32(opt("rope.freq_base_swa", base), f"{source}: {a}.rope.freq_base_swa")
    n_rot = _positive_int(opt("rope.dimension_count", head_dim), f"{source}: {a}.rope.dimension_count")
    n_rot_swa = _positive_int(opt("rope.dimension_count_swa", min(n_rot, head_dim_swa)),
                              f"{source}: {a}.rope.dimension_count_swa")
    scale = 1.0
    scaling_type = opt("rope.scaling.type")
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise ConfigError(f"{source}: {a}.rope.scaling.type = {scaling_type!r}: only 'linear' is supported")
        factor = _positive_f32(opt("rope.scaling.factor"), f"{source}: {a}.rope.scaling.factor")
        scale = _f32(1.0 / factor)
    # Sharing, PLE, MoE.
    n_shared = _positive_int(opt("attention.shared_kv_layers", 0), f"{source}: {a}.attention.shared_kv_layers",
                             allow_zero=True)
    donors = kv_donors(is_sliding, n_shared, f"{source}: {a}.attention.shared_kv_layers")
    ple_dim = _positive_int(opt("embedding_length_per_layer_input", 0),
                            f"{source}: {a}.embedding_length_per_layer_input", allow_zero=True)
    ple_vocab = tensors["per_layer_token_embd.weight"][0] if ple_dim and "per_layer_token_embd.weight" in tensors else 0
    if bool(ple_dim) != ("per_layer_token_embd.weight" in tensors):
        raise ConfigError(f"{source}: {a}.embedding_length_per_layer_input = {ple_dim} but tensor "
                          f"per_layer_token_embd.weight is {'missing' if ple_dim else 'present'}")
    has_moe = [f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(n_layer)]
    n_expert = n_used = n_ff_exp = 0
    if any(has_moe):
        n_expert = _at_most(_positive_int(req("expert_count"), f"{source}: {a}.expert_count"), MAX_EXPERTS,
                            f"{source}: {a}.expert_count", "llama.cpp LLAMA_MAX_EXPERTS")
        n_used = _positive_int(req("expert_used_count"), f"{source}: {a}.expert_used_count")
        n_ff_exp = _positive_int(req("expert_feed_forward_length"), f"{source}: {a}.expert_feed_forward_length")
        if n_used > n_expert:
            raise ConfigError(f"{source}: {a}.expert_used_count = {n_used} exceeds expert_count {n_expert}")

    softcap = opt("final_logit_softcapping")
    if softcap is not None:
        softcap = _positive_f32(softcap, f"{source}: {a}.final_logit_softcapping")
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
        arch=a, source=source, vocab_size=vocab, hidden_size=hidden, n_layer=n_layer, rms_eps=_f32(eps),
        sliding_window=window, context_length=_at_most(
            _positive_int(opt("context_length", 131072), f"{source}: {a}.context_length"), MAX_CONTEXT_LENGTH,
            f"{source}: {a}.context_length", "64 x Gemma 4's longest context"),
        final_logit_softcap=softcap, attn_scale=attn_scale, ple_dim=ple_dim, vocab_size_per_layer=ple_vocab,
        n_kv_shared=n_shared, n_expert=n_expert, n_expert_used=n_used, n_ff_exp=n_ff_exp,
        has_v_norm=a == "gemma4", has_layer_scalar=a == "gemma4",
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        layers=tuple(layers),
    )
    _check_layers(list(cfg.layers), hidden, source, _gguf_key_names(a))
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
            layer = _replace(layer, rope_freq_factors=np.asarray(rope_freqs, dtype=np.float32).copy())
        layers.append(layer)
    out = _replace(cfg, layers=tuple(layers))
    _check_layers(list(out.layers), out.hidden_size, out.source, _gguf_key_names(out.arch))
    return out


def cut_layers(cfg: ModelConfig, n: int) -> ModelConfig:
    """The first ``n`` layers of a model file as a model of its own (``--layers N`` on a GGUF or HF folder).

    Every kept layer stays exactly as the file has it (type, head_dim, KV heads, FFN width, RoPE,
    KV donor), so the file's tensors fit it. The KV-shared tail keeps what of it lies among the
    first ``n`` layers: ``max(0, n - (n_layer - n_kv_shared))`` layers. A shared layer reads the last
    non-shared layer of its type before the tail, which is kept too, so the layout stays valid
    (transformers' rule, :func:`kv_donors`). Unlike ``fast.shapes.truncate_layers`` (which makes
    layers for a shape with no file) the last kept layer is not made full: that would change its
    tensors' shapes.

    Args:
        cfg: the file's config.
        n: layers to keep, ``1 <= n <= cfg.n_layer``.

    Returns:
        A new config (``cfg`` itself when ``n == cfg.n_layer``); ``source`` gets `` (first N layers)``.

    Raises:
        ConfigError: ``n`` is not an integer in ``[1, n_layer]`` (one line naming the file).
    """
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= cfg.n_layer:
        raise ConfigError(f"{cfg.source}: --layers {n!r}: expected an integer in [1, {cfg.n_layer}] "
                          f"(the model has {cfg.n_layer} layers)")
    if n == cfg.n_layer:
        return cfg
    n_shared = max(0, n - (cfg.n_layer - cfg.n_kv_shared))
    return _replace(cfg, n_layer=n, n_kv_shared=n_shared, layers=cfg.layers[:n],
                    source=f"{cfg.source} (first {n} layers)")


def _replace(obj, **kw):
    return dataclasses.replace(obj, **kw)


# --------------------------------------------------------------------------- HF


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

    n_layer = _positive_int(req("num_hidden_layers"), f"{source}: num_hidden_layers")
    hidden = _positive_int(req("hidden_size"), f"{source}: hidden_size")
    vocab = _positive_int(req("vocab_size"), f"{source}: vocab_size")
    n_head = _positive_int(req("num_attention_heads"), f"{source}: num_attention_heads")
    n_kv = _positive_int(get("num_key_value_heads", n_head), f"{source}: num_key_value_heads")
    head_dim = _positive_int(get("head_dim", 256), f"{source}: head_dim")
    n_ff = _positive_int(req("intermediate_size"), f"{source}: intermediate_size")
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

    n_shared = _positive_int(get("num_kv_shared_layers", 0), f"{source}: num_kv_shared_layers", allow_zero=True)
    donors = kv_donors(is_sliding, n_shared, f"{source}: num_kv_shared_layers")
    double = bool(get("use_double_wide_mlp", False))
    ple_dim = _positive_int(get("hidden_size_per_layer_input", 0) or 0, f"{source}: hidden_size_per_layer_input",
                            allow_zero=True)
    moe = bool(get("enable_moe_block", False))
    n_expert = n_used = n_ff_exp = 0
    if moe:
        n_expert = _positive_int(req("num_experts"), f"{source}: num_experts")
        n_used = _positive_int(req("top_k_experts"), f"{source}: top_k_experts")
        n_ff_exp = _positive_int(req("moe_intermediate_size"), f"{source}: moe_intermediate_size")
        if n_used > n_expert:
            raise ConfigError(f"{source}: top_k_experts = {n_used} exceeds num_experts {n_expert}")

    layers = []
    for i in range(n_layer):
        sl = is_sliding[i]
        ov = overrides.get(i, {})
        hd = _positive_int(ov.get("head_dim", head_dim), f"{source}: per_layer_config[{i}].head_dim")
        kvh = _positive_int(ov.get("num_key_value_heads", n_kv), f"{source}: per_layer_config[{i}].num_key_value_heads")
        tname = types[i]
        rp = rope.get(tname)
        if not isinstance(rp, Mapping):
            raise ConfigError(f"{source}: rope_parameters.{tname}: missing")
        rtype = rp.get("rope_type", "default")
        theta = rp.get("rope_theta")
        theta = _positive_f32(theta, f"{source}: rope_parameters.{tname}.rope_theta")
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
            rope_scale=_positive_f32(1.0 / factor, f"{source}: 1 / rope_parameters.{tname}.factor"),
        ))
    _check_layers(layers, hidden, source)
    softcap = c.get("final_logit_softcapping")
    if softcap is not None:
        softcap = _positive_f32(softcap, f"{source}: final_logit_softcapping")
    eos = c.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    for key, tid in (("bos_token_id", c.get("bos_token_id")), ("eos_token_id", eos),
                     ("pad_token_id", c.get("pad_token_id"))):
        if tid is not None and (isinstance(tid, bool) or not isinstance(tid, int) or tid < 0):
            raise ConfigError(f"{source}: {key} = {tid!r:.40}: expected a token id (an integer >= 0), a list of them "
                              "(eos) or null")
    return ModelConfig(
        arch="gemma4", source=source, vocab_size=vocab, hidden_size=hidden, n_layer=n_layer, rms_eps=_f32(eps),
        sliding_window=_positive_int(get("sliding_window", 512), f"{source}: sliding_window") if any(is_sliding) else 0,
        context_length=_positive_int(get("max_position_embeddings", 131072), f"{source}: max_position_embeddings"),
        final_logit_softcap=None if softcap is None else _f32(softcap), attn_scale=1.0,
        ple_dim=ple_dim, vocab_size_per_layer=_positive_int(get("vocab_size_per_layer_input", vocab),
                                                           f"{source}: vocab_size_per_layer_input") if ple_dim else 0,
        n_kv_shared=n_shared, n_expert=n_expert, n_expert_used=n_used, n_ff_exp=n_ff_exp,
        has_v_norm=True, has_layer_scalar=True, tie_word_embeddings=bool(get("tie_word_embeddings", True)),
        bos_token_id=c.get("bos_token_id"), eos_token_id=eos, pad_token_id=c.get("pad_token_id"),
        layers=tuple(layers), use_bidirectional_attention=bidir,
    )


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the text decoder reads, with its numpy-order shape.

    Args:
        cfg: the model config.

    Returns:
        canonical name -> shape. Linear weights are ``[out, in]``; expert stacks
        ``[n_expert, out, in]``.

    Source: llama.cpp ``llama_model_gemma4::load_arch_tensors`` (ne reversed).
    """
    h, v = cfg.hidden_size, cfg.vocab_size
    t: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, h), "output_norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        t["output.weight"] = (v, h)
    if cfg.ple_dim:
        p, n = cfg.ple_dim, cfg.n_layer
        t["per_layer_token_embd.weight"] = (cfg.vocab_size_per_layer, n * p)
        t["per_layer_model_proj.weight"] = (n * p, h)
        t["per_layer_proj_norm.weight"] = (p,)
    for L in cfg.layers:
        b = f"blk.{L.index}."
        t[b + "attn_norm.weight"] = (h,)
        t[b + "attn_q.weight"] = (L.n_head * L.head_dim, h)
        t[b + "attn_q_norm.weight"] = (L.head_dim,)
        t[b + "attn_output.weight"] = (h, L.n_head * L.head_dim)
        t[b + "post_attention_norm.weight"] = (h,)
        if L.has_kv:
            t[b + "attn_k.weight"] = (L.n_kv_head * L.head_dim, h)
            t[b + "attn_k_norm.weight"] = (L.head_dim,)
            if L.has_v_proj:
                t[b + "attn_v.weight"] = (L.n_kv_head * L.head_dim, h)
        t[b + "ffn_norm.weight"] = (h,)
        t[b + "ffn_gate.weight"] = (L.n_ff, h)
        t[b + "ffn_up.weight"] = (L.n_ff, h)
        t[b + "ffn_down.weight"] = (h, L.n_ff)
        t[b + "post_ffw_norm.weight"] = (h,)
        if L.has_moe:
            e, f = cfg.n_expert, cfg.n_ff_exp
            t[b + "ffn_gate_inp.weight"] = (e, h)
            t[b + "ffn_gate_inp.scale"] = (h,)
            t[b + "ffn_down_exps.scale"] = (e,)
            t[b + "ffn_gate_up_exps.weight"] = (e, 2 * f, h)
            t[b + "ffn_down_exps.weight"] = (e, h, f)
            t[b + "pre_ffw_norm_2.weight"] = (h,)
            t[b + "post_ffw_norm_1.weight"] = (h,)
            t[b + "post_ffw_norm_2.weight"] = (h,)
        if cfg.has_layer_scalar:
            t[b + "layer_output_scale.weight"] = (1,)
        if cfg.ple_dim:
            t[b + "inp_gate.weight"] = (cfg.ple_dim, h)
            t[b + "proj.weight"] = (h, cfg.ple_dim)
            t[b + "post_norm.weight"] = (h,)
    return t


def optional_tensors(cfg: ModelConfig) -> set[str]:
    """Tensors that may be absent with a defined meaning (layer_output_scale -> 1)."""
    return {f"blk.{i}.layer_output_scale.weight" for i in range(cfg.n_layer)}


def one_edit_apart(a: str, b: str) -> bool:
    """True when ``b`` is ``a`` with one character replaced, inserted or deleted (a flipped bit, a typo)."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return a[i + (len(a) >= len(b)):] == b[i + (len(b) >= len(a)):]


def unread_tensors(cfg: ModelConfig, names) -> list[str]:
    """Tensors the text decoder would silently ignore although they belong to it.

    A ``blk.N.*`` tensor that the config does not read, except those llama.cpp
    also accepts and ignores (``attn_k``, ``attn_k_norm``, ``attn_v`` of a
    KV-shared layer); any other name one character from a decoder tensor
    (``rope_freqt.weight``, ``clk.1.attn_v.weight``). Either means a damaged or misspelt name, or a config
    that does not match the file: an ignored ``layer_output_scale`` or
    ``attn_v`` (V = K) or ``rope_freqs`` changes the model without an error.
    Other top-level tensors (vision/audio towers) are not the decoder's.

    Args:
        cfg: the config.
        names: the tensor names of the file (canonical).

    Returns:
        the offending names, sorted.

    Source: llama.cpp ``llama_model_loader::done_getting_tensors`` refuses any
    tensor it did not create; ``gemma4.cpp`` ``load_arch_tensors`` (kv_flags).
    """
    # Names whose absence means something (no V projection, scale 1, no freq factors) count as read too.
    read = set(expected_tensors(cfg)) | optional_tensors(cfg) | {"rope_freqs.weight"}
    read |= {f"blk.{i}.attn_v.weight" for i in range(cfg.n_layer)}
    for L in cfg.layers:
        if not L.has_kv:
            read |= {f"blk.{L.index}.{t}.weight" for t in ("attn_k", "attn_k_norm", "attn_v")}
    return sorted(n for n in names if n not in read and (
        n.startswith("blk.") or any(one_edit_apart(n, t) for t in read)))
