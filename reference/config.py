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

Here: the config (:class:`LayerSpec`, :class:`ModelConfig`) and what is derived from it (the KV donors, the RoPE factor
table, a cut to the first N layers, the tensors it reads). Reading it is :mod:`.config_gguf`
(:func:`~.config_gguf.config_from_gguf`) and :mod:`.config_hf` (:func:`~.config_hf.config_from_hf`); the checks each
value goes through, :mod:`.config_checks`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import ConfigError


# llama.cpp convert_hf_to_gguf.py Gemma4Model.generate_extra_tensors: factor for unrotated pairs.
UNROTATED_FREQ_FACTOR = 1e30


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
