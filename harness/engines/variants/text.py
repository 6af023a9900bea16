"""Spec variants of the text decoder: where transformers 5.23, llama.cpp and Google's JAX ``gemma`` 4.0.1 differ from
the reference, llama.cpp's numerical shortcut, and the faults engines are known to make (the self-test's mutant
families). Each override is one small function below; :data:`TEXT_VARIANTS` lists them with their sources.

Source files, read offline: transformers ``models/gemma4/modeling_gemma4.py`` and ``configuration_gemma4.py``,
``masking_utils.py``, ``modeling_rope_utils.py`` (5.23.0, installed); llama.cpp as vendored in the llama-cpp-python
0.3.36 sdist (``vendor/llama.cpp/src/models/gemma4.cpp``, ``src/llama-model.cpp``, ``src/llama-hparams.h``,
``src/llama-hparams.cpp``); Google's ``gemma`` 4.0.1 wheel (``gemma/gm/nn/gemma4/_modules.py``, ``_moe.py``,
``_config.py``, ``_transformer.py``, ``gemma/gm/math/_positional_embeddings.py``).
"""

from __future__ import annotations

import dataclasses
import importlib
import math

import numpy as np

import gemma4_harness.reference.model as rm
from gemma4_harness.reference.config import ModelConfig

from .core import FAST, FAST_MODEL, Patch, Source, Variant, config_variant, replace_layers

HF = "transformers 5.23"
LC = "llama.cpp"
JAX = "gemma 4.0.1"
OURS = "harness"
HF_MODEL = "models/gemma4/modeling_gemma4.py"
LC_MODEL = "src/models/gemma4.cpp"
JAX_MODULES = "gemma/gm/nn/gemma4/_modules.py"
SELFTEST = "harness/selftest/mutants.py"
NUMERICS = "gemma4_harness.harness.engines.llamacpp.numerics"
"""llama.cpp's approximations (imported when the GELU-table variant runs: the module imports torch)."""

# --------------------------------------------------------------------------- where a variant first shows


def _first(cfg, pred, point: str, why: str):
    """``(point, index)`` of the first layer with ``pred``, else ``why``."""
    return next(((point, L.index) for L in cfg.layers if pred(L)), why)


def _gemma4(cfg) -> bool:
    return cfg.arch == "gemma4"


def _proportional(L) -> bool:
    return L.rope_freq_factors is not None and bool(np.any(np.asarray(L.rope_freq_factors) != 1.0))


def _moe_point(cfg):
    return _first(cfg, lambda L: L.has_moe, "ffn_moe", "no MoE layer")


def _ffn_point(cfg):
    L0 = cfg.layers[0]
    return ("ffn_mlp" if L0.has_moe else "ffn_out", 0)


# --------------------------------------------------------------------------- config overrides


def position_donors(cfg: ModelConfig) -> list[int]:
    """KV donors by llama.cpp's and JAX's position rule: a shared layer reads layer ``n_kv - 1`` when full and
    ``n_kv - 2`` when sliding, ``n_kv`` the layers that own their K/V (llama.cpp ``src/llama-model.cpp``, the
    ``reuse`` callback of ``LLM_ARCH_GEMMA4``; gemma ``_config.py`` ``create_kv_cache_sharing_patterns``)."""
    n_kv = cfg.n_layer - cfg.n_kv_shared
    return [L.index if L.has_kv else n_kv - (2 if L.is_sliding else 1) for L in cfg.layers]


def first_same_type_donors(cfg: ModelConfig) -> list[int]:
    """KV donors by the self-test's wrong rule: the *first* non-shared layer of the shared layer's type."""
    n_kv = cfg.n_layer - cfg.n_kv_shared
    return [L.index if L.has_kv else next(j for j in range(n_kv) if cfg.layers[j].is_sliding == L.is_sliding)
            for L in cfg.layers]


def _donor_point(rule):
    def where(cfg):
        if not cfg.n_kv_shared:
            return "no KV-shared layer"
        if rule is position_donors and cfg.n_layer - cfg.n_kv_shared < 2:
            return "fewer than two layers own their K/V"
        donors = rule(cfg)
        changed = [L for L in cfg.layers if donors[L.index] != L.kv_donor]
        if not changed:
            return "the rule gives the same donors on this layout"
        for L in changed:
            D = cfg.layers[donors[L.index]]
            if (D.head_dim, D.n_kv_head) != (L.head_dim, L.n_kv_head):
                return (f"layer {L.index} would read layer {D.index}, another head_dim / KV-head count (llama.cpp "
                        "aborts: llama-kv-cache.cpp GGML_ASSERT)")
        return ("attn_out", changed[0].index)
    return where


def kv_donor_position(cfg: ModelConfig) -> ModelConfig:
    """Every KV-shared layer reads its donor by position (:func:`position_donors`)."""
    donors = position_donors(cfg)
    return replace_layers(cfg, lambda L: {} if L.has_kv else {"kv_donor": donors[L.index]})


def kv_donor_first(cfg: ModelConfig) -> ModelConfig:
    """Every KV-shared layer reads the first non-shared layer of its type (:func:`first_same_type_donors`)."""
    donors = first_same_type_donors(cfg)
    return replace_layers(cfg, lambda L: {} if L.has_kv else {"kv_donor": donors[L.index]})


def head_tied(cfg: ModelConfig) -> ModelConfig:
    """The logits read the token embedding table even where the model has its own ``output.weight``."""
    return dataclasses.replace(cfg, tie_word_embeddings=True)


def softcap_default_30(cfg: ModelConfig) -> ModelConfig:
    """A model that states no final softcap gets llama.cpp's default of 30."""
    return dataclasses.replace(cfg, final_logit_softcap=30.0 if cfg.final_logit_softcap is None else
                               cfg.final_logit_softcap)


def softcap_dropped(cfg: ModelConfig) -> ModelConfig:
    """No final logit softcap."""
    return dataclasses.replace(cfg, final_logit_softcap=None)


def v_norm_missing(cfg: ModelConfig) -> ModelConfig:
    """No weightless RMSNorm on V."""
    return dataclasses.replace(cfg, has_v_norm=False)


def window_inclusive(cfg: ModelConfig) -> ModelConfig:
    """Sliding layers see ``i - j <= W`` (W + 1 keys) instead of ``i - j < W``."""
    return dataclasses.replace(cfg, sliding_window=cfg.sliding_window + 1)


def _rotated_pairs(L) -> int:
    return int(np.sum(np.asarray(L.rope_freq_factors) == 1.0))


def rope_plain_partial(cfg: ModelConfig) -> ModelConfig:
    """Full layers rotate their first ``2k`` dims as plain partial RoPE: pairs ``j, j + k`` inside them, exponents
    ``base^(-2i / 2k)`` (k = the rotated pairs of the proportional table)."""
    return replace_layers(cfg, lambda L: {"n_rot": 2 * _rotated_pairs(L), "rope_freq_factors": None}
                          if _proportional(L) else {})


def rope_exponent_rotated(cfg: ModelConfig) -> ModelConfig:
    """Proportional pairs (``j, j + D/2``) but exponents over the rotated dims, ``base^(-2i / 2k)``."""
    def change(L):
        if not _proportional(L):
            return {}
        k, i = _rotated_pairs(L), np.arange(L.n_rot // 2, dtype=np.float64)
        f = np.where(i < k, L.rope_base ** (2 * i / (2 * k) - 2 * i / L.n_rot), 1e30)  # inv = base^(-2i/2k)
        return {"rope_freq_factors": f}
    return replace_layers(cfg, change)


def rope_freqs_ignored(cfg: ModelConfig) -> ModelConfig:
    """Full layers rotate every pair of the head (``rope_freqs`` factors ignored)."""
    return replace_layers(cfg, lambda L: {"rope_freq_factors": None} if _proportional(L) else {})


# --------------------------------------------------------------------------- function overrides


def gelu_table(orig):
    """:func:`reference.model.gelu_tanh` replaced by llama.cpp's fp16 table
    (:func:`harness.engines.llamacpp.numerics.gelu_fp16_table`)."""
    return importlib.import_module(NUMERICS).gelu_fp16_table  # that module imports torch: only when it runs


def _fast_gelu_table(orig):
    return importlib.import_module(NUMERICS).gelu_fp16_table_fast


def attn_scale_head_dim(orig):
    """:func:`reference.model.attention` with q.k scaled by ``1/sqrt(head_dim)`` (the scale argument ignored)."""
    def attention(q, k, v, q_pos, k_pos, window, scale, *a, **kw):
        return orig(q, k, v, q_pos, k_pos, window, q.shape[-1] ** -0.5, *a, **kw)
    return attention


def norm_plus_one(orig):
    """:func:`reference.model.rms_norm` multiplying by ``1 + w`` (Gemma 3's convention) where a weight is given."""
    def rms_norm(x, weight, eps):
        return orig(x, None if weight is None else 1.0 + np.asarray(weight), eps)
    return rms_norm


def _route_on(norm: str):
    """:func:`reference.model.moe_block` with the router fed ``rms_norm(attn_out, norm)``."""
    def wrap(orig):
        def moe_block(cfg, layer, W, attn_out):
            b, eps = f"blk.{layer.index}.", cfg.rms_eps
            idx, wgt = rm.moe_route(rm.rms_norm(attn_out, W[b + norm], eps), W[b + "ffn_gate_inp.weight"],
                                    W[b + "ffn_gate_inp.scale"], W[b + "ffn_down_exps.scale"], cfg.n_expert_used, eps)
            xe = rm.rms_norm(attn_out, W[b + "pre_ffw_norm_2.weight"], eps)
            moe = rm.moe_experts(xe, rm.expert_weights(W, b + "ffn_gate_up_exps.weight", idx),
                                 rm.expert_weights(W, b + "ffn_down_exps.weight", idx), idx, wgt)
            return rm.rms_norm(moe, W[b + "post_ffw_norm_2.weight"], eps)
        return moe_block
    return wrap


def router_expert_input(orig):
    """:func:`reference.model.moe_block` with the router fed the experts' own input ``rms_norm(a) * pre_ffw_norm_2``
    (then the router's RMSNorm, as in gemma 4.0.1)."""
    return _route_on("pre_ffw_norm_2.weight")(orig)


def router_dense_input(orig):
    """:func:`reference.model.moe_block` with the router fed the dense MLP's input ``rms_norm(a) * ffn_norm``."""
    return _route_on("ffn_norm.weight")(orig)


def _fast_route_on(norm: str):
    """``FastModel.moe_route`` fed ``rms_norm(x, norm)``."""
    def wrap(orig):
        rms_norm = importlib.import_module(FAST).rms_norm  # the fast twin (torch): only when it runs under it

        def moe_route(self, layer, x):
            return orig(self, layer, rms_norm(x, self.w[f"blk.{layer.index}.{norm}"], self.cfg.rms_eps))
        return moe_route
    return wrap


def experts_swiglu(orig):
    """:func:`reference.model.expert_ffn` gating with SiLU (SwiGLU) instead of GELU-tanh."""
    def expert_ffn(x, w_gate_up, w_down):  # [n, h] or [h], as the original
        F = w_down.shape[1]
        gu = x @ w_gate_up.T
        return (gu[..., :F] / (1.0 + np.exp(-gu[..., :F])) * gu[..., F:]) @ w_down.T
    return expert_ffn


def ple_token_unscaled(orig):
    """:func:`reference.model.ple_token` without the ``sqrt(P)`` factor."""
    def ple_token(cfg, W, ids):
        return orig(cfg, W, ids) / math.sqrt(cfg.ple_dim)
    return ple_token


def _fast_ple_token_unscaled(orig):
    def ple_token(self, ids, check=True):
        return orig(self, ids, check) / math.sqrt(self.cfg.ple_dim)
    return ple_token


_LAYER_INPUT: list = [None]  # the input of the layer being computed, for layer_scalar_branch's layer_scale


def keep_layer_input(orig):
    """:func:`reference.model.decoder_layer` noting its input ``x`` (for :func:`layer_scalar_branch`)."""
    def decoder_layer(cfg, layer, W, x, *a, **kw):
        _LAYER_INPUT[0] = x
        return orig(cfg, layer, W, x, *a, **kw)
    return decoder_layer


def layer_scalar_branch(orig):
    """:func:`reference.model.layer_scale` scaling the layer's branch only: ``x + s (y - x)`` instead of ``s y``."""
    def layer_scale(cfg, layer, W, y):
        name = f"blk.{layer.index}.layer_output_scale.weight"
        if not (cfg.has_layer_scalar and name in W):
            return y
        x = _LAYER_INPUT[0]
        return x + (y - x) * W[name][0]
    return layer_scale


# --------------------------------------------------------------------------- sources


S_ROUTER_HF = Source(HF, f"{HF_MODEL} Gemma4TextDecoderLayer.forward", "self.router(hidden_states_flat): the residual")
S_ROUTER_LC = Source(LC, f"{LC_MODEL} llama_model_gemma4::graph::graph",
                     "ggml_rms_norm(attn_out) into ffn_gate_inp: \"router operates on attn_out, not cur\"")
S_ROUTER_JAX = Source(JAX, f"{JAX_MODULES} Block._forward_moe; _moe.py MoERagged.__call__",
                      "moe_in = self.pre_ffw_norm(attn_output); router_input = self.router_norm(x) on moe_in")
S_DONOR_HF = Source(HF, "models/gemma4/configuration_gemma4.py Gemma4TextConfig.kv_sharing_modes",
                    "the last non-shared layer of each layer type stores, the shared layers of that type reuse it")
S_DONOR_LC = Source(LC, "src/llama-model.cpp create_memory (reuse callback, LLM_ARCH_GEMMA4)",
                    "n_layer_kv_from_start - (is_swa(il) ? 2 : 1)")
S_DONOR_JAX = Source(JAX, "gemma/gm/nn/gemma4/_config.py create_kv_cache_sharing_patterns",
                     "global -> num_unshared_layers - 1, local -> num_unshared_layers - 2")
S_HEAD_JAX = Source(JAX, "gemma/gm/nn/gemma4/_transformer.py Transformer.__call__; _modules.py Embedder.decode",
                    "logits = x @ input_embedding_table.T: always the embedding, no separate head")
S_HEAD_HF = Source(HF, f"{HF_MODEL} Gemma4ForCausalLM", "lm_head, tied to embed_tokens only with tie_word_embeddings")
S_HEAD_LC = Source(LC, f"{LC_MODEL} llama_model_gemma4::load_arch_tensors",
                   "output.weight when present, else token_embd")
S_CAP_LC = Source(LC, "src/llama-hparams.h llama_hparams; src/models/gemma4.cpp load_arch_hparams",
                  "f_final_logit_softcapping = 30.0f, the key read as optional")
S_CAP_HF = Source(HF, f"{HF_MODEL} Gemma4ForCausalLM.forward", "softcap only when final_logit_softcapping is set")
S_CAP_JAX = Source(JAX, "gemma/gm/nn/gemma4/_transformer.py Transformer.__call__",
                   "softcap only when config.final_logit_softcap is not None")
S_GELU_LC = Source(LC, "harness/engines/llamacpp/numerics.py gelu_fp16_table (ggml CPU GELU, GGML_GELU_FP16)",
                   "GELU read from an fp16 table")
S_GELU_HF = Source(HF, f"{HF_MODEL} Gemma4TextMLP", "ACT2FN['gelu_pytorch_tanh'] in the activation's dtype")
S_SCALE = (Source(HF, f"{HF_MODEL} Gemma4TextAttention.__init__", "self.scaling = 1.0"),
           Source(LC, f"{LC_MODEL} load_arch_hparams", "f_attention_scale = 1.0f"),
           Source(JAX, f"{JAX_MODULES} Attention.__call__", "logits = einsum(q, k): no scale"),
           Source(OURS, f"{SELFTEST} AttnScale", "the self-test's attn_scale mutant"))
S_VNORM = (Source(HF, f"{HF_MODEL} Gemma4TextAttention", "self.v_norm = Gemma4RMSNorm(..., with_scale=False)"),
           Source(LC, f"{LC_MODEL} llama_model_gemma4::graph::graph", "Vcur = ggml_rms_norm(ctx0, Vcur, ...)"),
           Source(JAX, f"{JAX_MODULES} Attention", "self.value_norm = RMSNorm(with_scale=False)"))
S_WINDOW = (Source(HF, "masking_utils.py sliding_window_overlay", "kv_idx > q_idx - sliding_window"),
            Source(LC, "src/llama-hparams.cpp is_masked_swa (LLAMA_SWA_TYPE_STANDARD)", "masked when p1 - p0 >= n_swa"),
            Source(JAX, f"{JAX_MODULES} _create_sliding_mask", "cache_positions > positions - sliding_window_size"),
            Source(OURS, f"{SELFTEST} _window_plus_one", "the self-test's window_off_by_one mutant"))
S_ROPE = (Source(HF, "modeling_rope_utils.py _compute_proportional_rope_parameters",
                 "exponents over the whole head_dim, the unrotated pairs at frequency 0"),
          Source(LC, f"{LC_MODEL} llama_model_gemma4::graph::graph", "ggml_rope_ext with the rope_freqs factors "
                 "(1 rotated, 1e30 not) on full layers; the tensor is required"),
          Source(JAX, "gemma/gm/math/_positional_embeddings.py apply_rope",
                 "rope_proportion: exponents 2i/head_dim, the rest at timescale inf; pairs j, j + head_dim/2"))
S_SOFTCAP = (S_CAP_HF, Source(LC, f"{LC_MODEL} llama_model_gemma4::graph::graph", "tanh softcap on the logits"),
             S_CAP_JAX, Source(OURS, f"{SELFTEST} MUTANTS softcap_dropped", "the self-test's softcap_dropped mutant"))
S_NORM = (Source(HF, f"{HF_MODEL} Gemma4RMSNorm", "multiplies by the weight itself (Gemma 3's Gemma3RMSNorm: 1 + w)"),
          Source(JAX, "gemma/gm/nn/gemma4/_layers.py RMSNorm", "scale used as it is"),
          Source(OURS, f"{SELFTEST} _norms_plus_one", "the self-test's norm_plus_one mutant"))
S_EXPERTS = (Source(HF, f"{HF_MODEL} Gemma4TextExperts", "act_fn = ACT2FN[hidden_activation] (gelu_pytorch_tanh)"),
             Source(LC, f"{LC_MODEL} llama_model_gemma4::graph::graph", "build_moe_ffn(..., LLM_FFN_GELU, ...)"),
             Source(JAX, "gemma/gm/nn/gemma4/_moe.py MoERagged._run_ffw_and_routing", "nn.gelu(x1) * x2"),
             Source(OURS, f"{SELFTEST} ExpertsSwiGLU", "the self-test's experts_swiglu mutant"))
S_PLE = (Source(HF, f"{HF_MODEL} Gemma4TextModel.__init__", "embed_tokens_per_layer embed_scale = sqrt(P)"),
         Source(LC, f"{LC_MODEL} build_inp_per_layer", "ggml_scale(..., sqrtf(n_embd_per_layer))"),
         Source(JAX, f"{JAX_MODULES} Embedder.encode_per_layer_input", "y *= sqrt(per_layer_input_dim)"),
         Source(OURS, f"{SELFTEST} PleTokenUnscaled", "the self-test's ple_token_unscaled mutant"))
S_SCALAR = (Source(HF, f"{HF_MODEL} Gemma4TextDecoderLayer.forward", "hidden_states *= self.layer_scalar"),
            Source(LC, f"{LC_MODEL} llama_model_gemma4::graph::graph", "ggml_mul(cur, out_scale) on the whole stream"),
            Source(JAX, f"{JAX_MODULES} Block.__call__", "outputs = outputs * self.skip_scale"),
            Source(OURS, f"{SELFTEST} LayerScalarBranch", "the self-test's layer_scalar_branch mutant"))

REF_ROUTER = "routes on the residual after attention (transformers, llama.cpp)"

# --------------------------------------------------------------------------- the catalogue

TEXT_VARIANTS: tuple[Variant, ...] = (
    Variant("router_expert_input", "text", "disagreement",
            "the MoE router reads the experts' pre-normed input rms_norm(a) * pre_ffw_norm_2 (then its own RMSNorm)",
            REF_ROUTER, (S_ROUTER_JAX, S_ROUTER_HF, S_ROUTER_LC), (f"{JAX} (JAX)",), "router_input",
            _moe_point, (Patch(rm, "moe_block", router_expert_input),),
            (Patch(FAST_MODEL, "moe_route", _fast_route_on("pre_ffw_norm_2.weight")),), router_expert_input),
    Variant("router_dense_input", "text", "fault",
            "the MoE router reads the dense MLP's pre-normed input rms_norm(a) * ffn_norm", REF_ROUTER,
            (S_ROUTER_HF, S_ROUTER_LC, Source(OURS, f"{SELFTEST} RouterPrenormed",
                                              "the self-test's router_prenormed mutant")), (), "router_input",
            _moe_point, (Patch(rm, "moe_block", router_dense_input),),
            (Patch(FAST_MODEL, "moe_route", _fast_route_on("ffn_norm.weight")),), router_dense_input),
    config_variant(kv_donor_position, name="kv_donor_position", family="text", kind="disagreement",
                   description="a KV-shared layer reads layer n_kv-1 (full) or n_kv-2 (sliding), by position",
                   reference="the last non-shared layer of the same type (transformers)",
                   sources=(S_DONOR_LC, S_DONOR_JAX, S_DONOR_HF), followed_by=(LC, f"{JAX} (JAX)"),
                   group="kv_donor", first_point=_donor_point(position_donors)),
    config_variant(kv_donor_first, name="kv_donor_first", family="text", kind="fault",
                   description="a KV-shared layer reads the first non-shared layer of its type",
                   reference="the last non-shared layer of the same type (transformers)",
                   sources=(S_DONOR_HF, Source(OURS, f"{SELFTEST} first_same_type_donors", "the self-test's "
                                               "kv_donor_first mutant")), followed_by=(), group="kv_donor",
                   first_point=_donor_point(first_same_type_donors)),
    config_variant(head_tied, name="head_tied", family="text", kind="disagreement",
                   description="the logits read the token embedding even where the model has its own output.weight",
                   reference="output.weight when the model has one (tie_word_embeddings false)",
                   sources=(S_HEAD_JAX, S_HEAD_HF, S_HEAD_LC), followed_by=(f"{JAX} (JAX)",), group="head",
                   first_point=lambda c: "the head is tied" if c.tie_word_embeddings else ("result_output", -1)),
    config_variant(softcap_default_30, name="softcap_default_30", family="text", kind="disagreement",
                   description="a model without final_logit_softcapping gets a final softcap of 30",
                   reference="no softcap when the model states none", sources=(S_CAP_LC, S_CAP_HF, S_CAP_JAX),
                   followed_by=(LC,), group="softcap",
                   first_point=lambda c: "the model states a softcap" if c.final_logit_softcap is not None
                   else ("result_output", -1)),
    Variant("gelu_fp16_table", "text", "approximation",
            "every GELU is read from an fp16 table (input and result rounded to fp16)", "GELU-tanh in float64",
            (S_GELU_LC, S_GELU_HF), (f"{LC} (CPU backend)",), "gelu", _ffn_point,
            (Patch(rm, "gelu_tanh", gelu_table),), (Patch(FAST, "gelu_tanh", _fast_gelu_table),), gelu_table),
    Variant("attn_scale_head_dim", "text", "fault", "attention scores scaled by 1/sqrt(head_dim), as in Gemma 3",
            "scale 1.0", S_SCALE, (), "attn_scale",
            lambda c: ("attn_out", 0) if c.attn_scale == 1.0 else "the model already scales by 1/sqrt(head_dim)",
            (Patch(rm, "attention", attn_scale_head_dim),), (Patch(FAST, "attention", attn_scale_head_dim),),
            attn_scale_head_dim),
    config_variant(v_norm_missing, name="v_norm_missing", family="text", kind="fault",
                   description="no weightless RMSNorm on V", reference="V RMS-normalised without weight",
                   sources=S_VNORM, followed_by=(), group="v_norm",
                   first_point=lambda c: ("attn_out", 0) if c.has_v_norm else "the model has no V norm"),
    config_variant(window_inclusive, name="window_inclusive", family="text", kind="fault",
                   description="sliding layers see i - j <= W (W + 1 keys)",
                   reference="i - j < W (W keys, the current one included): transformers, llama.cpp and JAX agree",
                   sources=S_WINDOW, followed_by=(), group="window",
                   first_point=lambda c: _first(c, lambda L: L.is_sliding, "attn_out", "no sliding layer")),
    config_variant(rope_plain_partial, name="rope_plain_partial", family="text", kind="fault",
                   description="full layers use plain partial RoPE: the first 2k dims, pairs (j, j+k), exponents "
                               "over 2k",
                   reference="proportional RoPE: pairs (j, j + D/2), exponents over head_dim, 2k dims rotated",
                   sources=S_ROPE, followed_by=(), group="rope_full",
                   first_point=lambda c: _first(c, _proportional, "attn_out", "no proportional-RoPE layer")),
    config_variant(rope_exponent_rotated, name="rope_exponent_rotated", family="text", kind="fault",
                   description="full layers: proportional pairs but exponents over the rotated dims, base^(-2i/2k)",
                   reference="proportional RoPE: exponents over head_dim",
                   sources=(*S_ROPE, Source(OURS, f"{SELFTEST} _rope_exponent_rotated",
                                            "the self-test's rope_exponent_rotated mutant")), followed_by=(),
                   group="rope_full",
                   first_point=lambda c: _first(c, _proportional, "attn_out", "no proportional-RoPE layer")),
    config_variant(rope_freqs_ignored, name="rope_freqs_ignored", family="text", kind="fault",
                   description="full layers rotate every pair of the head (rope_freqs factors ignored)",
                   reference="only the pairs whose rope_freqs factor is 1 rotate", sources=S_ROPE, followed_by=(),
                   group="rope_full",
                   first_point=lambda c: _first(c, _proportional, "attn_out", "no proportional-RoPE layer")),
    config_variant(softcap_dropped, name="softcap_dropped", family="text", kind="fault",
                   description="the final logit softcap is not applied", reference="cap * tanh(logits / cap)",
                   sources=S_SOFTCAP, followed_by=(), group="softcap",
                   first_point=lambda c: ("result_output", -1) if c.final_logit_softcap is not None
                   else "the model has no softcap"),
    Variant("norm_plus_one", "text", "fault", "every RMSNorm weight used as 1 + w (Gemma 3's convention)",
            "the weight itself", S_NORM, (), "norm",
            lambda c: (("inp_per_layer", -1) if c.ple_dim else ("attn_out", 0)) if _gemma4(c)
            else "a Gemma 3 file stores 1 + w already",
            (Patch(rm, "rms_norm", norm_plus_one),), (), norm_plus_one),
    Variant("experts_swiglu", "text", "fault", "the experts gate with SiLU (SwiGLU) instead of GELU-tanh",
            "GELU-tanh", S_EXPERTS, (), "experts_act", _moe_point, (Patch(rm, "expert_ffn", experts_swiglu),), (),
            experts_swiglu),
    Variant("ple_token_unscaled", "text", "fault", "the PLE token part is not scaled by sqrt(P)",
            "E_ple[ids] * sqrt(P)", S_PLE, (), "ple_scale",
            lambda c: ("inp_per_layer", -1) if c.ple_dim else "the model has no PLE",
            (Patch(rm, "ple_token", ple_token_unscaled),), (Patch(FAST_MODEL, "ple_token", _fast_ple_token_unscaled),),
            ple_token_unscaled),
    Variant("layer_scalar_branch", "text", "fault",
            "the layer scalar scales the layer's branch only, x + s (y - x), instead of the whole stream s y",
            "y * layer_output_scale", S_SCALAR, (), "layer_scalar",
            lambda c: ("l_out", 0) if c.has_layer_scalar else "the model has no layer scalar",
            (Patch(rm, "decoder_layer", keep_layer_input), Patch(rm, "layer_scale", layer_scalar_branch)), (),
            layer_scalar_branch),
)
"""The text decoder's variants, the disagreements between published implementations first."""
