"""The Gemma 4 audio encoder and ``embed_audio`` in float64 NumPy.

One small function per operation; :func:`encode_audio` is their composition.
Formulas follow transformers 5.23 ``models/gemma4/modeling_gemma4.py``
(``Gemma4AudioModel``, ``Gemma4AudioLayer``, ``Gemma4AudioAttention``,
``Gemma4MultimodalEmbedder``; the tie-breaker); llama.cpp
``tools/mtmd/models/gemma4a.cpp`` for the GGUF conventions. The defaults are ``Gemma4AudioConfig``'s
(``configuration_gemma4.py``); the steps below follow ``Gemma4AudioSubSampleConvProjection``,
``Gemma4AudioRelPositionalEncoding``, ``Gemma4AudioAttention`` (chunked local attention with its relative bias
and logit cap), ``Gemma4AudioLightConv1d`` and ``Gemma4AudioLayer``; llama.cpp hard-codes what transformers
reads from the config there (chunk 12, past context 12, softcap 50, residual 0.5: ``gemma4a.cpp``,
``clip.cpp``'s ``PROJECTOR_TYPE_GEMMA4A`` branch).

The encoder, for log-mel features [T, M] and their frame mask:

1. two blocks ``mask -> Conv2d(3x3, stride 2, pad 1, no bias) -> LayerNorm over
   channels (no bias) -> ReLU`` on the (time, mel) plane, then a linear input
   projection: [T, M] -> [T', H] with ``T' = ceil(T / 4)``;
2. per conformer layer: FFN half-step, chunked local self-attention with a
   Transformer-XL relative bias, a causal depthwise "light" convolution, a
   second FFN half-step, an output RMSNorm;
3. ``output_proj`` (with bias), then ``embed_audio`` = weightless RMSNorm +
   linear into the text width; only valid rows are kept.

**Attention as written here.** HF and llama.cpp compute the chunked attention
block by block (chunks of C = ``attention_chunk_size`` queries against windows
of C + P + R keys, relative logits rearranged by the Transformer-XL
"rel-shift"). This module writes the same thing as full attention with the
equivalent mask and an explicit bias: query t sees key s iff s is a valid frame
and ``0 <= t - s < P`` (or ``0 < s - t < R``), with ``P = attention_context_left - 1``
and ``R = attention_context_right``; the relative logit of a visible pair is
``q_t . rel_k[P - (t - s)]``. ``tests/test_audio_reference.py`` proves the two
forms equal. They differ only for a query with no visible key at all (a
padding frame 12 or more frames past the last valid one), whose row is then
uniform over different key sets; such rows never reach a valid output row
when padding is at the end, as the feature extractor produces.

The hyper-parameters are :class:`reference.audio_config.AudioConfig`; weights are the canonical arrays of
:mod:`reference.audio_weights` (llama.cpp's mmproj tensor names, ``a.*`` and ``mm.a.*``; numpy order ``[out, in]``).

Shapes: T = mel frames, M = mel bins, T' = encoder frames (T / 4), H = audio
hidden_size, nh = heads, D = H / nh, E = output_proj_dims, Ht = text hidden size,
F = relative positions (``(C + P + R) // 2 + 1``, 13).

Trace points (``trace(point, layer, array)``, arrays over all T' rows, valid or
not). llama.cpp's clip graph names only its inputs here (``inp_raw``,
``pos_emb``; ``gemma4a.cpp``), plus ``norm_w`` / ``ffn_up`` / ``ffn_silu`` /
``ffn_down`` inside each norm and FFN, repeated within a layer and so
ambiguous; the rest are ours, in the same style:

* layer -1: ``inp_raw`` [T, M] (masked features), ``sscp_conv_0`` [T/2, M/2, ch0]
  and ``sscp_conv_1`` [T', M/4, ch1] (after each ReLU, channels last),
  ``inp_proj`` [T', H], ``pos_emb`` [F, H];
* per layer: ``ffn_1_out``, ``attn_out``, ``conv_out``, ``ffn_2_out`` (the
  stream after each residual add) and ``layer_out`` (after ``norm_out``), all [T', H];
* layer -1: ``output_proj`` [T', E], ``projected`` [T', Ht] (``embed_audio``
  of every row; :func:`encode_audio` returns its valid rows).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from .audio_config import AudioConfig
from .errors import InputError, PromptError
from .model import linear, rms_norm, softcap, softmax

TraceFn = Callable[[str, int, np.ndarray], None]

#: eps of the FFN, attention and layer-output RMSNorms: transformers builds them with
#: ``Gemma4RMSNorm(hidden_size)`` (default 1e-6), not ``rms_norm_eps``.
FIXED_NORM_EPS = 1e-6
#: ``mm_token_type_ids`` value of audio soft tokens (0 text, 1 image, 2 video, 3 audio).
MM_TOKEN_TYPE_AUDIO = 3


# --------------------------------------------------------------------------- operations


def silu(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)``. [...] -> [...]."""
    return x / (1.0 + np.exp(-x))


def glu(x: np.ndarray) -> np.ndarray:
    """Gated linear unit on the last axis: first half times sigmoid(second half). [..., 2n] -> [..., n].

    Source: ``torch.nn.functional.glu``; llama.cpp ``gemma4a.cpp`` (view 0 * sigmoid(view d)).
    """
    a, b = np.split(x, 2, axis=-1)
    return a / (1.0 + np.exp(-b))


def layer_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm without bias, ``(x - mean) / sqrt(var + eps) * weight``. [..., n] -> [..., n].

    Source: ``nn.LayerNorm(bias=False)``; llama.cpp ``ggml_norm`` x weight.
    """
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * weight


def clip_stream(x: np.ndarray, cfg: AudioConfig) -> np.ndarray:
    """``clamp(x, -gradient_clipping, +gradient_clipping)``. [...] -> [...]. Source: ``Gemma4AudioLayer``."""
    return np.clip(x, -cfg.gradient_clipping, cfg.gradient_clipping)


def clippable_linear(x: np.ndarray, W: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    """``clamp(W clamp(x, in_min, in_max), out_min, out_max)``; bounds that are absent do not clamp.

    ``name`` is the tensor base (``a.blk.0.attn_q``); the bounds are the 1-element
    tensors ``{name}.input_min`` etc. [T, in] -> [T, out]. Source: ``Gemma4ClippableLinear``;
    llama.cpp ``clip_graph_gemma4a::build_mm`` (absent bounds = +-FLT_MAX).
    """

    def bound(suffix: str, default: float) -> float:
        key = f"{name}.{suffix}"
        return float(W[key][0]) if key in W else default

    x = np.clip(x, bound("input_min", -np.inf), bound("input_max", np.inf))
    y = linear(x, W[f"{name}.weight"])
    return np.clip(y, bound("output_min", -np.inf), bound("output_max", np.inf))


def conv2d_stride2(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """3x3 convolution, stride 2, zero padding 1, no bias (cross-correlation, as torch).

    ``y[o, i, j] = sum_{c, a, b} w[o, c, a, b] x_pad[c, 2i + a, 2j + b]``.
    [C_in, T, F], [C_out, C_in, 3, 3] -> [C_out, ceil(T/2), ceil(F/2)]. Source: ``nn.Conv2d``.
    """
    _, t, f = x.shape
    to, fo = (t + 1) // 2, (f + 1) // 2
    xp = np.pad(x, ((0, 0), (1, 1), (1, 1)))
    y = np.zeros((w.shape[0], to, fo))
    for a in range(3):
        for b in range(3):
            patch = xp[:, a:a + 2 * to - 1:2, b:b + 2 * fo - 1:2]  # [C_in, T/2, F/2]
            y += np.tensordot(w[:, :, a, b], patch, axes=([1], [0]))
    return y


def subsample_block(x: np.ndarray, mask: np.ndarray, w_conv: np.ndarray, w_norm: np.ndarray,
                    eps: float) -> tuple[np.ndarray, np.ndarray]:
    """One subsampling block: zero invalid frames, conv, LayerNorm over channels, ReLU; mask ``[::2]``.

    [C_in, T, F], [T] -> ([C_out, T/2, F/2], [T/2]). Source:
    ``Gemma4AudioSubSampleConvProjectionLayer``.
    """
    y = conv2d_stride2(x * mask[None, :, None], w_conv)
    y = layer_norm(np.moveaxis(y, 0, -1), w_norm, eps)  # [T/2, F/2, C_out]
    return np.moveaxis(np.maximum(y, 0.0), -1, 0), mask[::2]


def subsample(cfg: AudioConfig, W, features: np.ndarray, mask: np.ndarray,
              trace: TraceFn | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Two subsampling blocks, then the input projection of the ``[F/4 * ch1]`` features of each frame.

    The flattened feature index is ``f * ch1 + c`` (mel-major, channel-minor).
    [T, M], [T] -> ([T', H], [T'] bool). Source: ``Gemma4AudioSubSampleConvProjection``.
    """
    x, m = features[None].astype(np.float64), mask.astype(bool)
    for i in range(2):
        x, m = subsample_block(x, m, W[f"a.conv1d.{i}.weight"], W[f"a.conv1d.{i}.norm.weight"], cfg.rms_norm_eps)
        if trace:
            trace(f"sscp_conv_{i}", -1, np.moveaxis(x, 0, -1))
    x = np.moveaxis(x, 0, -1)  # [T', F', ch1]
    x = linear(x.reshape(x.shape[0], -1), W["a.input_projection.weight"])
    return x, m


def rel_pos_table(cfg: AudioConfig) -> np.ndarray:
    """Sinusoidal table of the F relative positions ``K, K-1, ..., 0`` with ``K = F - 1``.

    Row r is ``[sin((K - r) inv), cos((K - r) inv)]`` with
    ``inv_i = exp(-i ln(1e4) / max(H/2 - 1, 1))``, i < H/2.
    [] -> [F, H]. Source: ``Gemma4AudioRelPositionalEncoding``; llama.cpp ``pos_emb``.
    """
    half = cfg.hidden_size // 2
    inv = np.exp(-np.arange(half) * math.log(1e4) / max(half - 1, 1))  # [H/2]
    pos = np.arange(cfg.n_rel_pos - 1, -1, -1, dtype=np.float64)  # [F]
    ang = pos[:, None] * inv[None, :]
    return np.concatenate([np.sin(ang), np.cos(ang)], axis=-1)


def attention_mask(cfg: AudioConfig, valid: np.ndarray) -> np.ndarray:
    """Which keys each query sees: valid frames at distance ``0 <= t - s < P`` (or ``0 < s - t < R``).

    [T'] bool -> [T', T'] bool (query, key). Source: ``Gemma4AudioModel.forward``
    (``create_bidirectional_mask`` AND ``sliding_window_mask_function((P, R))``).
    """
    t = np.arange(valid.shape[0])
    d = t[:, None] - t[None, :]  # [T', T'] query minus key
    near = ((d >= 0) & (d < cfg.max_past)) | ((d < 0) & (-d < cfg.attention_context_right))
    return near & valid[None, :]


def relative_bias(cfg: AudioConfig, q: np.ndarray, rel_k: np.ndarray) -> np.ndarray:
    """Transformer-XL position logits: ``bias[h, t, s] = q[t, h] . rel_k[P - (t - s), h]``, 0 where that row does not exist.

    This is what the blocked rel-shift of HF / llama.cpp computes for every
    visible pair (row index = P - distance, 0 <= index < F).
    [T', nh, D], [F, nh, D] -> [nh, T', T']. Source: ``Gemma4AudioAttention._rel_shift``.
    """
    T = q.shape[0]
    qr = np.einsum("thd,rhd->htr", q, rel_k)  # [nh, T', F]
    t = np.arange(T)
    r = cfg.max_past - (t[:, None] - t[None, :])  # [T', T'] row of the table
    ok = (r >= 0) & (r < rel_k.shape[0])
    gathered = np.take_along_axis(qr, np.clip(r, 0, rel_k.shape[0] - 1)[None].repeat(qr.shape[0], 0), axis=2)
    return np.where(ok[None], gathered, 0.0)


def audio_attention(cfg: AudioConfig, W, il: int, x: np.ndarray, valid: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Chunked local self-attention of layer ``il`` as full attention with the equivalent mask.

    ``q = Wq x * (D^-0.5 / ln 2) * softplus(per_dim_scale)`` (the canonical
    ``per_dim_scale.weight`` holds the softplus already, as llama.cpp's GGUF does);
    ``k = Wk x * ln(1 + e) / ln 2``; ``logits = 50 tanh((q.k + bias) / 50)``;
    invalid pairs get ``attention_invalid_logits_value``; softmax; ``post``.
    [T', H], [T'], [F, H] -> [T', H]. Source: ``Gemma4AudioAttention.forward``.
    """
    b = f"a.blk.{il}."
    T, nh, D = x.shape[0], cfg.num_attention_heads, cfg.head_dim
    q = clippable_linear(x, W, b + "attn_q").reshape(T, nh, D)
    q = q * (D**-0.5 / math.log(2.0)) * W[b + "per_dim_scale.weight"]
    k = clippable_linear(x, W, b + "attn_k").reshape(T, nh, D) * (math.log(1.0 + math.e) / math.log(2.0))
    v = clippable_linear(x, W, b + "attn_v").reshape(T, nh, D)
    rel_k = linear(pos, W[b + "attn_k_rel.weight"]).reshape(-1, nh, D)  # [F, nh, D]
    logits = np.einsum("thd,shd->hts", q, k) + relative_bias(cfg, q, rel_k)  # [nh, T', T']
    logits = softcap(logits, cfg.attention_logit_cap)
    logits = np.where(attention_mask(cfg, valid)[None], logits, cfg.attention_invalid_logits_value)
    out = np.einsum("hts,shd->thd", softmax(logits), v).reshape(T, nh * D)
    return clippable_linear(out, W, b + "attn_out")


def ffn_half_step(cfg: AudioConfig, W, il: int, x: np.ndarray, second: bool) -> np.ndarray:
    """Macaron FFN half-step: ``x + 0.5 * N_post(clamp(down(silu(up(N_pre(clamp x))))))``.

    ``second`` selects FFN 2 (tensors ``ffn_*_1``). [T', H] -> [T', H].
    Source: ``Gemma4AudioFeedForward``.
    """
    s = "_1" if second else ""
    b = f"a.blk.{il}."
    h = rms_norm(clip_stream(x, cfg), W[f"{b}ffn_norm{s}.weight"], FIXED_NORM_EPS)
    h = clippable_linear(silu(clippable_linear(h, W, f"{b}ffn_up{s}")), W, f"{b}ffn_down{s}")
    h = rms_norm(clip_stream(h, cfg), W[f"{b}ffn_post_norm{s}.weight"], FIXED_NORM_EPS)
    return x + cfg.residual_weight * h


def causal_depthwise_conv(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per-channel causal convolution, left zero padding k - 1: ``y[t, c] = sum_j w[c, j] x[t - k + 1 + j, c]``.

    [T', H], [H, k] -> [T', H]. Source: ``Gemma4AudioCausalConv1d`` (groups = H);
    llama.cpp ``ggml_ssm_conv`` after ``ggml_pad_ext(4, 0)``.
    """
    k = w.shape[1]
    xp = np.concatenate([np.zeros((k - 1, x.shape[1])), x], axis=0)
    return sum(xp[j:j + x.shape[0]] * w[:, j] for j in range(k))


def light_conv(cfg: AudioConfig, W, il: int, x: np.ndarray) -> np.ndarray:
    """Light convolution module: ``x + pw2(silu(N_conv(clamp(dw(glu(pw1(N_pre x)))))))``.

    ``conv_norm`` is the pre-norm and ``norm_conv`` the post-conv norm (the GGUF
    names are swapped relative to HF, as llama.cpp notes). [T', H] -> [T', H].
    Source: ``Gemma4AudioLightConv1d``.
    """
    b, eps = f"a.blk.{il}.", cfg.rms_norm_eps
    h = glu(clippable_linear(rms_norm(x, W[b + "conv_norm.weight"], eps), W, b + "conv_pw1"))
    h = clip_stream(causal_depthwise_conv(h, W[b + "conv_dw.weight"]), cfg)
    h = silu(rms_norm(h, W[b + "norm_conv.weight"], eps))
    return x + clippable_linear(h, W, b + "conv_pw2")


def conformer_layer(cfg: AudioConfig, W, il: int, x: np.ndarray, valid: np.ndarray, pos: np.ndarray,
                    trace: TraceFn | None = None) -> np.ndarray:
    """One conformer layer: FFN half-step, attention, light conv, FFN half-step, ``norm_out``.

    [T', H] -> [T', H]. Source: ``Gemma4AudioLayer.forward``.
    """
    b = f"a.blk.{il}."
    x = ffn_half_step(cfg, W, il, x, second=False)
    if trace:
        trace("ffn_1_out", il, x)
    a = rms_norm(clip_stream(x, cfg), W[b + "attn_pre_norm.weight"], FIXED_NORM_EPS)
    a = audio_attention(cfg, W, il, a, valid, pos)
    x = x + rms_norm(clip_stream(a, cfg), W[b + "attn_post_norm.weight"], FIXED_NORM_EPS)
    if trace:
        trace("attn_out", il, x)
    x = light_conv(cfg, W, il, x)
    if trace:
        trace("conv_out", il, x)
    x = ffn_half_step(cfg, W, il, x, second=True)
    if trace:
        trace("ffn_2_out", il, x)
    x = rms_norm(clip_stream(x, cfg), W[b + "ln2.weight"], FIXED_NORM_EPS)
    if trace:
        trace("layer_out", il, x)
    return x


def output_proj(W, x: np.ndarray) -> np.ndarray:
    """``output_proj``: linear with bias. [T', H] -> [T', E]. Source: ``Gemma4AudioModel.output_proj``."""
    return linear(x, W["a.pre_encode.out.weight"]) + W["a.pre_encode.out.bias"]


def embed_audio(cfg: AudioConfig, W, x: np.ndarray) -> np.ndarray:
    """``embed_audio``: RMSNorm without weight, then a linear into the text width (no sqrt(Ht) scale).

    [n, E] -> [n, Ht]. Source: ``Gemma4MultimodalEmbedder``; llama.cpp
    ``mm.a.input_projection``.
    """
    return linear(rms_norm(x, None, cfg.rms_norm_eps), W["mm.a.input_projection.weight"])


def encode_audio(cfg: AudioConfig, W, features: np.ndarray, mask: np.ndarray,
                 trace: TraceFn | None = None) -> np.ndarray:
    """Audio soft tokens of one clip, ready to replace its ``<|audio|>`` placeholders.

    Args:
        cfg: audio config.
        W: canonical audio weights (see :mod:`reference.audio_weights`).
        features: [T, M] log-mel features (:func:`reference.audio_features.extract_features`).
        mask: [T] frame validity.
        trace: optional callback ``(point, layer, array)`` (module docstring).

    Returns:
        float64 [n_soft, Ht]: the rows whose subsampled mask is valid
        (``ceil(valid frames / 4)`` for a mask that is a prefix; 25 per second).

    Raises:
        InputError: features or mask of the wrong shape.

    Source: transformers ``Gemma4Model.get_audio_features`` and the valid-row
    selection in ``Gemma4Model.forward``.
    """
    features = np.asarray(features, dtype=np.float64)
    mask = np.asarray(mask, dtype=bool)
    if features.ndim != 2 or features.shape[1] != cfg.n_mels or mask.shape != (features.shape[0],):
        raise InputError(f"audio features: shape {list(features.shape)} / mask {list(mask.shape)}, expected "
                         f"[T, {cfg.n_mels}] / [T]")
    if trace:
        trace("inp_raw", -1, features * mask[:, None])
    x, valid = subsample(cfg, W, features, mask, trace)
    if trace:
        trace("inp_proj", -1, x)
    pos = rel_pos_table(cfg)
    if trace:
        trace("pos_emb", -1, pos)
    for il in range(cfg.num_hidden_layers):
        x = conformer_layer(cfg, W, il, x, valid, pos, trace)
    x = output_proj(W, x)
    if trace:
        trace("output_proj", -1, x)
    y = embed_audio(cfg, W, x)
    if trace:
        trace("projected", -1, y)
    return y[valid]


# --------------------------------------------------------------------------- prompt


def expand_audio_placeholder(cfg: AudioConfig, n_soft: int) -> tuple[list[int], list[int]]:
    """Token ids and ``mm_token_type_ids`` of one audio clip in a prompt.

    ``boa, audio_token x n_soft, eoa`` with types ``0, 3 x n_soft, 0`` (boa/eoa
    are text tokens). [] -> ([n_soft + 2], [n_soft + 2]). Source: transformers
    ``Gemma4Processor`` (``boa_token + audio_token * n + eoa_token``) and
    ``Gemma4Model`` token types; llama.cpp ``mtmd.cpp`` inserts the same markers.

    Raises:
        PromptError: negative ``n_soft``.
    """
    if n_soft < 0:
        raise PromptError(f"audio clip with {n_soft} soft tokens")
    ids = [cfg.boa_token_id] + [cfg.audio_token_id] * n_soft + [cfg.eoa_token_index]
    types = [0] + [MM_TOKEN_TYPE_AUDIO] * n_soft + [0]
    return ids, types


def expand_audio_prompt(cfg: AudioConfig, ids: Sequence[int], n_soft: Sequence[int]) -> tuple[list[int], list[int]]:
    """Replace each single ``audio_token_id`` of a prompt by its clip's :func:`expand_audio_placeholder`.

    Args:
        ids: prompt token ids with one ``audio_token_id`` per clip.
        n_soft: soft-token count of each clip, in order.

    Returns:
        ``(ids, mm_token_type_ids)`` of the expanded prompt.

    Raises:
        PromptError: the number of placeholders differs from ``len(n_soft)``.
    """
    n_ph = sum(1 for t in ids if t == cfg.audio_token_id)
    if n_ph != len(n_soft):
        raise PromptError(f"prompt has {n_ph} audio placeholders (id {cfg.audio_token_id}) for {len(n_soft)} clips")
    out_ids: list[int] = []
    out_types: list[int] = []
    clips = iter(n_soft)
    for t in ids:
        if t == cfg.audio_token_id:
            e_ids, e_types = expand_audio_placeholder(cfg, next(clips))
            out_ids += e_ids
            out_types += e_types
        else:
            out_ids.append(int(t))
            out_types.append(0)
    return out_ids, out_types
