"""The specification: a float64 NumPy forward of the Gemma 4 (and Gemma 3) text decoder.

One small function per operation, each with its shapes in a trailing comment;
the model is their composition. Slow on purpose: it is what the other engines
are measured against. Formulas follow transformers 5.23
``models/gemma4/modeling_gemma4.py`` (the tie-breaker); llama.cpp
``src/models/gemma4.cpp`` / ``gemma3.cpp`` for the GGUF conventions and the
trace-point names.

Shapes: T = new tokens, S = cached + new tokens, h = hidden_size, H / Hkv =
query / KV heads, D = head_dim, L = layers, P = PLE width, V = vocab,
E = experts, K = experts per token, F = FFN width.

Trace points (llama.cpp graph-callback names): ``inp_scaled``, ``inp_per_layer``
(layer -1); per layer ``attn_out``, ``ffn_out`` (MoE layers also ``ffn_mlp``,
``ffn_moe``), ``per_layer_embd_out``, ``l_out``; ``result_norm``,
``result_output`` (layer -1). A trace callback (:data:`TraceFn`) gets ``(point, layer, array)``
with ``array`` of shape ``[T, ...]`` for the new tokens; the calls are unconditional, and the default
callback (:func:`no_trace`) records nothing.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Mapping, Sequence

import numpy as np

from .config import LayerSpec, ModelConfig
from .errors import PromptError
from .multimodal import Injection, check_injection, llm_input_ids, merge_embeddings, pad_id, vision_blocks

TraceFn = Callable[[str, int, np.ndarray], None]
"""A trace callback: ``(point, layer, array [T, ...])``; every engine of the harness takes one."""


def no_trace(point: str, layer: int, array: np.ndarray) -> None:
    """The default :data:`TraceFn`: records nothing (trace calls are unconditional, llama.cpp ``cb()`` style)."""


# --------------------------------------------------------------------------- operations


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm, ``x / sqrt(mean(x^2) + eps) * weight``; no weight = scale 1.

    [..., n], [n] -> [..., n]. Gemma 4 multiplies by the weight directly (no
    ``1 + w``); Gemma 3 GGUFs store ``1 + w`` already. Source: transformers
    ``Gemma4RMSNorm``.
    """
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if weight is None else y * weight


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (``gelu_pytorch_tanh``). [...] -> [...]. Source: Hendrycks & Gimpel 2016.

    One of the two ops of this specification an emulation may replace (with :func:`attention`): every caller
    looks the name up in this module at call time, so :func:`harness.engines.llamacpp.numerics.llamacpp_numerics`
    can swap in llama.cpp's fp16 GELU table while an engine that makes it is compared.
    """
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """``cap * tanh(x / cap)``. [...] -> [...]. Source: transformers ``Gemma4ForCausalLM.forward``."""
    return cap * np.tanh(x / cap)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax along ``axis``; rows of all -inf are not expected. [...] -> [...]."""
    z = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(z)
    return e / np.sum(e, axis=axis, keepdims=True)


def linear_input(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The input of a matrix product with ``w`` as the product takes it: ``x`` itself. [..., in] -> [..., in].

    One of the ops an emulation may replace (as :func:`gelu_tanh`): llama.cpp rounds the activation row to the
    dot-product type of ``w``'s stored GGML type first (``quantized_activations``;
    :func:`harness.engines.llamacpp.numerics.quantized_activations_numerics`, which reads the type a GGUF's weight
    carries: :class:`reference.weights.GGMLArray`). Every product of this module takes its input through it.
    """
    return x


def linear_offset(x: np.ndarray, w: np.ndarray) -> np.ndarray | None:
    """What a matrix product with ``w`` adds to its rounded input's product beyond the input itself: nothing (None).
    [..., in], [out, in] -> [..., out] or None.

    The other op an emulation may replace: llama.cpp's Q4_1 / Q5_1 products multiply each weight block's minimum by
    an fp16 rounding of the activation block's sum, which no rounding of the input row carries
    (:func:`harness.engines.llamacpp.numerics.linear_offset_quantized`). Every product of this module adds it.
    """
    return None


def linear_output(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The output of a matrix product with ``w`` as the product leaves it: ``y`` itself. [..., out] -> [..., out].

    The third op an emulation may replace: the null of the re-seeded per-layer comparison moves every product's
    output in its last fp32 bits, as an engine that sums in another order would
    (:func:`harness.engines.llamacpp.numerics.jitter_sums_numerics`). :func:`linear` passes its output through it
    (the experts' :func:`expert_linear` does not).
    """
    return y


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T`` (``x`` through :func:`linear_input`, plus :func:`linear_offset` where one is given, the sum through
    :func:`linear_output`). [T, in], [out, in] -> [T, out]."""
    y = linear_input(x, w) @ w.T
    extra = linear_offset(x, w)
    return linear_output(y if extra is None else y + extra, w)


def rope_inv_freq(layer: LayerSpec) -> np.ndarray:
    """Inverse frequencies of one layer's RoPE.

    ``inv_freq[i] = rope_scale * base^(-2i / n_rot) / factor[i]`` for i < n_rot/2.
    [] -> [n_rot/2]. Source: llama.cpp ``ggml_rope_ext`` (theta_scale,
    freq_factors, freq_scale); equals transformers' proportional RoPE when
    n_rot = head_dim and the factors are 1 / 1e30.
    """
    i = np.arange(0, layer.n_rot, 2, dtype=np.float64)
    inv = layer.rope_base ** (-i / layer.n_rot) * layer.rope_scale
    if layer.rope_freq_factors is not None:
        inv = inv / layer.rope_freq_factors.astype(np.float64)
    return inv


def rope_angles(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of the rotation angles ``pos * inv_freq``. [T], [n_rot/2] -> ([T, n_rot/2], [T, n_rot/2]).

    Source: transformers ``Gemma4RotaryEmbedding.forward``.
    """
    ang = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # [T, n_rot/2]
    return np.cos(ang), np.sin(ang)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_rot: int) -> np.ndarray:
    """NeoX-style rotary embedding on the first ``n_rot`` dims; dim j pairs with j + n_rot/2.

    [T, H, D], [T, n_rot/2], [T, n_rot/2] -> [T, H, D]. Source: transformers ``apply_rotary_pos_emb``
    (``rotate_half``), llama.cpp ``LLAMA_ROPE_TYPE_NEOX``.
    """
    half = n_rot // 2
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, n_rot/2]
    x1, x2, rest = x[..., :half], x[..., half:n_rot], x[..., n_rot:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1)


ATTENTION_BLOCK = 256
"""Queries per block in :func:`attention`: the score matrix of a block is ``[H, block, keys in reach]``."""


def attention_mask(q_pos: np.ndarray, k_pos: np.ndarray, window: int | None,
                   q_block: np.ndarray | None = None, k_block: np.ndarray | None = None) -> np.ndarray:
    """Which keys each query sees: ``(pos_j <= pos_i or same block) and pos_i - pos_j < window``.

    Without blocks: causal, and with a window ``pos_i - pos_j < window``. With blocks (bidirectional
    vision attention on a sliding layer): a query in block b >= 0 also sees every later key of block
    b, however far ahead; the window bounds only the past. [T], [S], window, [T], [S] -> bool [T, S].
    Source: transformers ``sliding_window_mask_function`` and ``create_masks_for_vision_model``
    (``AND(sliding_window_overlay, OR(causal, blockwise_overlay))``); llama.cpp ``LLAMA_SWA_TYPE_STANDARD``.
    """
    dist = q_pos[:, None] - k_pos[None, :]
    allowed = dist >= 0
    if q_block is not None:
        allowed |= (q_block[:, None] == k_block[None, :]) & (q_block[:, None] >= 0)
    if window is not None:
        allowed &= dist < window
    return allowed


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray,
              window: int | None, scale: float, q_block: np.ndarray | None = None,
              k_block: np.ndarray | None = None) -> np.ndarray:
    """Grouped-query attention under :func:`attention_mask`: causal, optionally a sliding window and blocks.

    ``softmax(q k^T * scale + mask) v`` per head. Queries go in blocks of :data:`ATTENTION_BLOCK`, and
    each block reads only the keys it can see: from its first query's window start (a sliding layer)
    to its last query, or to the end of the furthest image block one of its queries is in. Memory is
    bounded by the block times (window + block + longest image), not by T x S.
    [T, H, D], [S, Hkv, D], [S, Hkv, D], [T], [S], window, scale, [T], [S] -> [T, H*D].
    Source: transformers ``eager_attention_forward``.

    With :func:`gelu_tanh`, the ops an emulation may replace (callers look the name up at call time):
    :func:`harness.engines.llamacpp.numerics.attention_numerics` swaps in a KV cache stored in 16 bits and
    llama.cpp's attention numerics while an engine that declares them is compared.
    """
    T, H, D = q.shape
    group = H // k.shape[1]
    out = np.empty((T, H, D))
    for lo in range(0, T, ATTENTION_BLOCK):
        qp = q_pos[lo:lo + ATTENTION_BLOCK]
        qb = None if q_block is None else q_block[lo:lo + ATTENTION_BLOCK]
        last = qp.max()
        if qb is not None and (qb >= 0).any():
            last = max(last, k_pos[np.isin(k_block, qb[qb >= 0])].max())  # later keys of the queries' blocks
        reach = k_pos <= last
        if window is not None:
            reach &= k_pos > qp.min() - window
        kh = np.repeat(k[reach], group, axis=1)  # [S', H, D]
        vh = np.repeat(v[reach], group, axis=1)  # [S', H, D]
        scores = np.einsum("thd,shd->hts", q[lo:lo + ATTENTION_BLOCK], kh) * scale  # [H, t, S']
        kb = None if qb is None else k_block[reach]
        scores = np.where(attention_mask(qp, k_pos[reach], window, qb, kb)[None], scores, -np.inf)
        out[lo:lo + ATTENTION_BLOCK] = np.einsum("hts,shd->thd", softmax(scores), vh)
    return out.reshape(T, H * D)


def gelu_ffn(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """Gated GELU MLP, ``down(gelu(gate x) * up x)``. [T, h] -> [T, h]. Source: transformers ``Gemma4TextMLP``.

    :func:`ffn_block` computes exactly these operations, reading each matrix only when its product runs.
    """
    return linear(gelu_tanh(linear(x, w_gate)) * linear(x, w_up), w_down)


def moe_route(x: np.ndarray, w_router: np.ndarray, router_scale: np.ndarray, per_expert_scale: np.ndarray,
              k: int, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """Router: top-k experts per token and their weights.

    ``p = softmax(W (rmsnorm(x) * scale / sqrt(h)))``; keep the k largest,
    renormalise them to sum 1, multiply by ``per_expert_scale``. The input is the
    residual stream after attention (not the pre-FFN-normed one).
    [T, h] -> ([T, K] indices, [T, K] weights). Source: transformers ``Gemma4TextRouter``.
    """
    h = x.shape[-1]
    z = rms_norm(x, None, eps) * router_scale * h**-0.5
    probs = softmax(linear(z, w_router))  # [T, E]
    idx = np.argsort(-probs, axis=-1, kind="stable")[:, :k]  # [T, K]
    top = np.take_along_axis(probs, idx, axis=-1)
    top = top / top.sum(axis=-1, keepdims=True)
    return idx, top * per_expert_scale[idx]


#: Rows of one expert product (:func:`expert_product`): a multiple of 4, OpenBLAS's double GEMM row unroll on x86.
EXPERT_TILE = 8

_tiles_exact: dict[tuple, bool] = {}


def tiles_exact(w: np.ndarray, rows: int) -> bool:
    """Whether ``x @ w.T`` for ``x`` of ``rows`` rows (a multiple of :data:`EXPERT_TILE`) gives every row the bits of
    the same row moved to another place in products of :data:`EXPERT_TILE` rows each: checked once per shape, row
    count and BLAS thread count, with ``w`` itself and a random ``x`` rolled by one row (each row lands at another
    place in another tile). Which kernels a BLAS runs depends on the shapes and its thread count, not on the values,
    so one comparison settles it (measured here: OpenBLAS Haswell, 1 and 2 threads, the 26B-A4B expert shapes and
    small ones, at 8 to 256 rows, it holds; at row counts that are not a multiple of 4 it does not).
    """
    key = (w.shape, rows, _blas_threads())
    if key not in _tiles_exact:
        x = np.random.default_rng(2).standard_normal((rows, w.shape[1]))
        moved = np.roll(x, 1, axis=0)
        tiled = np.concatenate([moved[a:a + EXPERT_TILE] @ w.T for a in range(0, rows, EXPERT_TILE)])
        _tiles_exact[key] = bool(np.array_equal(x @ w.T, np.roll(tiled, -1, axis=0)))
    return _tiles_exact[key]


def _blas_threads() -> str:
    return "|".join(os.environ.get(k, "") for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"))


def expert_product(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T`` for the rows one call routed to one expert (``x`` already :func:`linear_input`'s): one row alone
    as :func:`linear` makes it (a matrix-vector product), more rows :data:`EXPERT_TILE` at a time, the last tile
    padded with zero rows. [n, in], [out, in] -> [n, out].

    Why tiles: a BLAS rounds the rows of a GEMM alike only where their count is a multiple of its unroll, so a
    row's bits would depend on how many other rows share its product. A product of exactly :data:`EXPERT_TILE` rows
    gives a row the same bits wherever it sits and whatever the other rows are (:func:`tiles_exact`), so each
    token's output is its own, and the expert is read once for all its rows (one GEMM: a token's expert costs its
    active parameters' flops, not a fresh read of the matrix per token). Several tiles go through one product where
    :func:`tiles_exact` says that gives each row the same bits; :func:`reference.batch.expert_products` stacks many
    calls' rows the same way. One row stays a matrix-vector product, the kernel :func:`linear` takes for it: a
    padded tile would cost its flops 8 times and pack the whole matrix (measured here: 4x the CPU time), and
    every one-token call of a layer-outer pass still reads the expert once (:func:`reference.batch.linear_rows`).
    """
    n, R = x.shape[0], EXPERT_TILE
    if n == 1:
        return x @ w.T
    rows = -(-n // R) * R
    padded = np.zeros((rows, x.shape[1]))
    padded[:n] = x
    if rows == R or tiles_exact(w, rows):
        return (padded @ w.T)[:n]
    return np.concatenate([padded[a:a + R] @ w.T for a in range(0, rows, R)])[:n]


def expert_linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """:func:`linear` for the rows routed to one expert: the product through :func:`expert_product`, the same
    hooks (:func:`linear_input`, :func:`linear_offset`). [n, in], [out, in] -> [n, out]."""
    y = expert_product(linear_input(x, w), w)
    extra = linear_offset(x, w)
    return y if extra is None else y + extra


def expert_ffn(x: np.ndarray, w_gate_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """One expert's gated-GELU MLP on the tokens routed to it: ``down(gelu(g) * u)`` with ``[g; u] = gate_up x``
    (gate first), each product through :func:`expert_linear` (one read of the expert for all the rows).

    [n, h] (or one token [h]), [2F, h], [h, F] -> [n, h] (or [h]). Source: transformers ``Gemma4TextExperts``.
    """
    if x.ndim == 1:
        return expert_ffn(x[None], w_gate_up, w_down)[0]
    F = w_down.shape[1]
    gu = expert_linear(x, w_gate_up)  # [n, 2F]
    return expert_linear(gelu_tanh(gu[:, :F]) * gu[:, F:], w_down)


def expert_sum(y: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Each token's chosen experts' outputs weighted and added in the order of its choices (``idx[t]``), from 0.
    [T, K, h], [T, K] -> [T, h]. Source: transformers ``Gemma4TextExperts``."""
    out = np.zeros((y.shape[0], y.shape[2]))
    for k in range(y.shape[1]):
        out += weights[:, k, None] * y[:, k]
    return out


def moe_experts(x: np.ndarray, w_gate_up, w_down, idx: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted sum of the chosen experts' MLPs: per expert, :func:`expert_ffn` of every token that chose it (in
    token order), then :func:`expert_sum` in the order of ``idx[t]``.

    [T, h], [E, 2F, h], [E, h, F], [T, K], [T, K] -> [T, h]; the stacks may be any mapping expert -> matrix that
    holds the experts of ``idx`` (:func:`expert_weights`). Source: transformers ``Gemma4TextExperts``.
    """
    y = np.empty(idx.shape + (x.shape[1],))  # [T, K, h]
    for e in np.unique(idx):
        t, k = np.nonzero(idx == e)  # tokens ascending; a token chooses an expert at most once
        y[t, k] = expert_ffn(x[t], w_gate_up[e], w_down[e])
    return expert_sum(y, weights)


def expert_weights(W, name: str, chosen: np.ndarray):
    """The experts ``chosen`` of the stack ``name`` (``[E, out, in]``), indexable by expert: ``W.experts`` where the
    weights have it (:meth:`reference.weights.Weights.experts`: only those experts are read and dequantized),
    else the whole stack ``W[name]`` (a plain mapping). The values are the same either way."""
    experts = getattr(W, "experts", None)
    return W[name] if experts is None else experts(name, chosen)


# --------------------------------------------------------------------------- KV cache


class KVCache:
    """Keys and values of every layer that computes its own, for all positions so far.

    ``k[il]`` / ``v[il]``: [S, Hkv, D] float64 (after k_norm+RoPE / v_norm);
    ``pos``: [S] positions. Shared layers own nothing and read their donor's
    entry. The reference keeps the full history and applies the sliding window
    as a mask (the plain form of the rule); ring buffers belong to ``fast/``.
    ``open_block``: the last call ended inside a bidirectional image block (the
    next call may not continue it: see :func:`forward`).
    """

    def __init__(self, cfg: ModelConfig):
        self.k: dict[int, np.ndarray] = {}
        self.v: dict[int, np.ndarray] = {}
        self.pos = np.zeros(0, dtype=np.int64)
        self.n_layer = cfg.n_layer
        self.open_block = False

    @property
    def n_past(self) -> int:
        """Tokens already in the cache."""
        return int(self.pos.shape[0])

    def append(self, il: int, k: np.ndarray, v: np.ndarray) -> None:
        """Add the new tokens' K/V of layer ``il``. [T, Hkv, D] each."""
        if il in self.k:
            self.k[il] = np.concatenate([self.k[il], k], axis=0)
            self.v[il] = np.concatenate([self.v[il], v], axis=0)
        else:
            self.k[il], self.v[il] = k, v


# --------------------------------------------------------------------------- blocks


def embed(cfg: ModelConfig, W, ids: np.ndarray) -> np.ndarray:
    """Scaled token embeddings: ``E[ids] * sqrt(h)``. [T] -> [T, h].

    ``W.rows`` reads only the rows of ``ids`` (:meth:`reference.weights.Weights.rows`).
    Source: transformers ``Gemma4TextScaledWordEmbedding``.
    """
    return W.rows("token_embd.weight", ids) * math.sqrt(cfg.hidden_size)


def ple_token(cfg: ModelConfig, W, ids: np.ndarray) -> np.ndarray:
    """PLE token part: ``E_ple[ids] * sqrt(P)``. [T] -> [T, L, P].

    Source: transformers ``Gemma4TextModel.get_per_layer_inputs``.
    """
    T, L, P = ids.shape[0], cfg.n_layer, cfg.ple_dim
    return W.rows("per_layer_token_embd.weight", ids).reshape(T, L, P) * math.sqrt(P)


def ple_context(cfg: ModelConfig, W, x_scaled: np.ndarray) -> np.ndarray:
    """PLE context part: ``rmsnorm(x_scaled @ W_proj.T / sqrt(h))`` per layer. [T, h] -> [T, L, P].

    Source: transformers ``Gemma4TextModel.project_per_layer_inputs``.
    """
    T, L, P = x_scaled.shape[0], cfg.n_layer, cfg.ple_dim
    ctx = linear(x_scaled, W["per_layer_model_proj.weight"]) * cfg.hidden_size**-0.5
    return rms_norm(ctx.reshape(T, L, P), W["per_layer_proj_norm.weight"], cfg.rms_eps)


def per_layer_inputs(cfg: ModelConfig, W, ids: np.ndarray, x_scaled: np.ndarray) -> np.ndarray:
    """Per-layer embeddings (PLE) for every layer: ``(context + token) / sqrt(2)``. [T], [T, h] -> [T, L, P].

    Source: transformers ``Gemma4TextModel.project_per_layer_inputs``.
    """
    return (ple_context(cfg, W, x_scaled) + ple_token(cfg, W, ids)) * 2.0**-0.5


def attention_block(cfg: ModelConfig, layer: LayerSpec, W, x: np.ndarray, positions: np.ndarray,
                    k_pos: np.ndarray, cache: KVCache, blocks: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Self-attention of one layer, from the normed stream to the o-projection.

    q/k get per-head RMSNorm with weight then RoPE; v gets RMSNorm without weight
    (Gemma 4). A k_eq_v layer uses the K projection as V; a shared layer reads its
    donor's cached K/V. ``positions``: [T] of the new tokens; ``k_pos``: [S] of
    every cached key after this step; ``blocks``: ``(q_block [T], k_block [S])`` on a sliding layer
    with bidirectional vision attention, else None. [T, h] -> [T, h].
    Source: transformers ``Gemma4TextAttention``.
    """
    b = f"blk.{layer.index}."
    T = x.shape[0]
    H, Hkv, D = layer.n_head, layer.n_kv_head, layer.head_dim
    cos, sin = rope_angles(positions, rope_inv_freq(layer))
    q = linear(x, W[b + "attn_q.weight"]).reshape(T, H, D)
    q = apply_rope(rms_norm(q, W[b + "attn_q_norm.weight"], cfg.rms_eps), cos, sin, layer.n_rot)
    if layer.has_kv:
        k_raw = linear(x, W[b + "attn_k.weight"]).reshape(T, Hkv, D)
        v = linear(x, W[b + "attn_v.weight"]).reshape(T, Hkv, D) if layer.has_v_proj else k_raw
        k = apply_rope(rms_norm(k_raw, W[b + "attn_k_norm.weight"], cfg.rms_eps), cos, sin, layer.n_rot)
        if cfg.has_v_norm:
            v = rms_norm(v, None, cfg.rms_eps)
        cache.append(layer.index, k, v)
    k_all, v_all = cache.k[layer.kv_donor], cache.v[layer.kv_donor]
    window = cfg.sliding_window if layer.is_sliding else None
    out = attention(q, k_all, v_all, positions, k_pos, window, cfg.attn_scale, *(blocks or (None, None)))
    return linear(out, W[b + "attn_output.weight"])


def moe_block(cfg: ModelConfig, layer: LayerSpec, W, attn_out: np.ndarray) -> np.ndarray:
    """The MoE branch: route the residual ``attn_out``, run the experts on its ``pre_ffw_norm_2`` norm,
    then ``post_ffw_norm_2``. [T, h] -> [T, h]. Source: transformers ``Gemma4TextDecoderLayer.forward``.

    Only the experts the tokens chose are read (:func:`expert_weights`): a token uses K of the E experts.
    """
    b, eps = f"blk.{layer.index}.", cfg.rms_eps
    idx, wgt = moe_route(attn_out, W[b + "ffn_gate_inp.weight"], W[b + "ffn_gate_inp.scale"],
                         W[b + "ffn_down_exps.scale"], cfg.n_expert_used, eps)
    xe = rms_norm(attn_out, W[b + "pre_ffw_norm_2.weight"], eps)
    moe = moe_experts(xe, expert_weights(W, b + "ffn_gate_up_exps.weight", idx),
                      expert_weights(W, b + "ffn_down_exps.weight", idx), idx, wgt)
    return rms_norm(moe, W[b + "post_ffw_norm_2.weight"], eps)


def ffn_block(cfg: ModelConfig, layer: LayerSpec, W, attn_out: np.ndarray, trace: TraceFn = no_trace) -> np.ndarray:
    """Dense FFN (:func:`gelu_ffn`), plus on MoE layers the :func:`moe_block` beside it; before ``post_ffw_norm``.

    [T, h] -> [T, h]. Source: transformers ``Gemma4TextDecoderLayer.forward``;
    llama.cpp ``gemma4.cpp`` (``ffn_mlp``, ``ffn_moe``).
    """
    b, il, eps = f"blk.{layer.index}.", layer.index, cfg.rms_eps
    x = rms_norm(attn_out, W[b + "ffn_norm.weight"], eps)
    # gelu_ffn's operations in its order, each matrix read when its product runs: a streamed layer holds one
    gate = gelu_tanh(linear(x, W[b + "ffn_gate.weight"]))
    mlp = linear(gate * linear(x, W[b + "ffn_up.weight"]), W[b + "ffn_down.weight"])
    if not layer.has_moe:
        return mlp
    mlp = rms_norm(mlp, W[b + "post_ffw_norm_1.weight"], eps)
    moe = moe_block(cfg, layer, W, attn_out)
    trace("ffn_mlp", il, mlp)
    trace("ffn_moe", il, moe)
    return mlp + moe


def ple_block(cfg: ModelConfig, layer: LayerSpec, W, x: np.ndarray, ple: np.ndarray) -> np.ndarray:
    """Per-layer-embedding branch: ``post_norm(proj(gelu(gate x) * ple))``. [T, h], [T, P] -> [T, h].

    Source: transformers ``Gemma4TextDecoderLayer.forward`` (per_layer_input_gate ...).
    """
    b = f"blk.{layer.index}."
    g = gelu_tanh(linear(x, W[b + "inp_gate.weight"])) * ple
    return rms_norm(linear(g, W[b + "proj.weight"]), W[b + "post_norm.weight"], cfg.rms_eps)


def layer_scale(cfg: ModelConfig, layer: LayerSpec, W, y: np.ndarray) -> np.ndarray:
    """The layer scalar multiplies the whole stream: ``y * layer_output_scale`` (absent: 1). [T, h] -> [T, h].

    Source: transformers ``Gemma4TextDecoderLayer.forward`` (``layer_scalar``).
    """
    name = f"blk.{layer.index}.layer_output_scale.weight"
    if cfg.has_layer_scalar and name in W:
        return y * W[name][0]
    return y


def decoder_layer(cfg: ModelConfig, layer: LayerSpec, W, x: np.ndarray, positions: np.ndarray,
                  k_pos: np.ndarray, cache: KVCache, ple: np.ndarray | None, trace: TraceFn = no_trace,
                  blocks: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """One decoder layer. [T, h] -> [T, h].

    ``a = x + post_attn_norm(attn(attn_norm(x)))``; ``y = a + post_ffw_norm(ffn(a))``;
    ``y += post_norm(PLE branch)``; ``y *= layer_output_scale`` (the whole stream). ``blocks``: see
    :func:`attention_block`. Source: transformers ``Gemma4TextDecoderLayer.forward``.
    """
    b, il, eps = f"blk.{layer.index}.", layer.index, cfg.rms_eps
    attn = attention_block(cfg, layer, W, rms_norm(x, W[b + "attn_norm.weight"], eps), positions, k_pos, cache,
                           blocks)
    a = x + rms_norm(attn, W[b + "post_attention_norm.weight"], eps)
    trace("attn_out", il, a)
    f = ffn_block(cfg, layer, W, a, trace)
    trace("ffn_out", il, f)
    y = a + rms_norm(f, W[b + "post_ffw_norm.weight"], eps)
    if ple is not None:
        p = ple_block(cfg, layer, W, y, ple)
        trace("per_layer_embd_out", il, p)
        y = y + p
    y = layer_scale(cfg, layer, W, y)
    trace("l_out", il, y)
    return y


def lm_head(cfg: ModelConfig, W, x: np.ndarray) -> np.ndarray:
    """Logits: ``x @ head.T`` (the tied ``token_embd`` or ``output``), then the final softcap when set.

    The head is read a block of vocabulary rows at a time (``W.row_blocks``, see
    :meth:`reference.weights.Weights.row_blocks`), so the table is never dequantized whole.
    [T, h] -> [T, V]. Source: transformers ``Gemma4ForCausalLM.forward``.
    """
    name = "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"
    logits = np.concatenate([linear(x, block) for block in W.row_blocks(name)], axis=1)  # [T, V]
    if cfg.final_logit_softcap is not None:
        logits = softcap(logits, cfg.final_logit_softcap)
    return logits


# --------------------------------------------------------------------------- model


def check_prompt(cfg: ModelConfig, ids: Sequence[int], n_past: int = 0) -> np.ndarray:
    """Validate token ids; return them as int64 [T].

    Raises:
        PromptError: empty, not a flat list of integers, an id outside ``[0, vocab)`` (or the PLE table),
            or ``n_past + T`` beyond the context length.
    """
    ids = list(ids) if not isinstance(ids, np.ndarray) else ids
    if not isinstance(ids, np.ndarray):
        bad_type = next((i for i in ids if isinstance(i, bool) or not isinstance(i, (int, np.integer))), None)
        if bad_type is not None:
            raise PromptError(f"token id {bad_type!r:.40}: expected an integer")
        huge = next((i for i in ids if not -2**63 <= int(i) < 2**63), None)
        if huge is not None:
            raise PromptError(f"token id {huge} is outside the vocabulary [0, {cfg.vocab_size})")
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if arr.size == 0:
        raise PromptError("prompt is empty")
    limit = cfg.vocab_size if not cfg.ple_dim else min(cfg.vocab_size, cfg.vocab_size_per_layer)
    bad = arr[(arr < 0) | (arr >= limit)]
    if bad.size:
        raise PromptError(f"token id {int(bad[0])} is outside the vocabulary [0, {limit})")
    if n_past + arr.size > cfg.context_length:
        raise PromptError(f"prompt of {n_past + arr.size} tokens is longer than the context: {context_key(cfg)} = "
                          f"{cfg.context_length}")
    return arr


def context_key(cfg) -> str:
    """Where the context length comes from, for a message: ``<file>: key <arch>.context_length`` (GGUF) or
    ``<config.json>: key max_position_embeddings`` (HF)."""
    src = str(getattr(cfg, "source", "") or "")
    key = "max_position_embeddings" if src.endswith(".json") or not src.endswith(".gguf") else \
        f"{cfg.arch}.context_length"
    return f"{src}: key {key}" if src else f"key {key}"


def check_generation(cfg, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    """Every prompt valid (:func:`reference.model.check_prompt`) and prompt + ``max_new_tokens`` within the context.

    Raises:
        PromptError: the first prompt that is not, named by its index; ``max_new_tokens`` < 1.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise PromptError(f"max_new_tokens {max_new_tokens!r}: expected an integer >= 1")
    for i, p in enumerate(prompts):
        check_prompt(cfg, p)
        if len(p) + max_new_tokens > cfg.context_length:
            raise PromptError(f"prompt {i}: {len(p)} tokens + {max_new_tokens} new exceed the context: "
                              f"{context_key(cfg)} = {cfg.context_length}")


def reseed(given: np.ndarray, shape: tuple[int, ...], il: int) -> np.ndarray:
    """The stream that enters layer ``il`` of a re-seeded forward (:func:`forward`'s ``layer_inputs``): ``given``
    as float64, checked against the stream's ``shape`` [T, h].

    Raises:
        ValueError: ``given`` is not of that shape.
    """
    x = np.asarray(given, dtype=np.float64)
    if x.shape != tuple(shape):
        raise ValueError(f"layer_inputs[{il}]: shape {list(x.shape)}, expected {list(shape)}")
    return x


def forward(cfg: ModelConfig, W, ids: Sequence[int], cache: KVCache | None = None,
            trace: TraceFn | None = None, mm: Injection | None = None,
            layer_inputs: Mapping[int, np.ndarray] | None = None) -> np.ndarray:
    """Logits for every new position; appends to ``cache`` when given.

    Args:
        cfg: model config.
        W: canonical weights (float64 arrays), e.g. :class:`reference.weights.Weights`.
        ids: token ids of the new tokens, length T.
        cache: KV cache holding earlier tokens (positions continue from it), or
            None for a stand-alone forward.
        trace: callback ``(point, layer, array)`` (:data:`TraceFn`); None records nothing.
        mm: soft tokens to inject at placeholder positions, and ``mm_token_type_ids``
            (:class:`reference.multimodal.Injection`); None for a text-only prompt. Placeholders read
            the pad row of both tables; ``inp_scaled`` is the merged input.

    Returns:
        float64 ``[T, V]`` logits (after the final softcap when the model has one).

    Raises:
        PromptError: see :func:`check_prompt` and :func:`reference.multimodal.check_injection`; a
            placeholder count other than the number of rows; an image block continued from the
            previous call (a bidirectional block must be in one call: its first token attends to its
            last).
        layer_inputs: ``{layer index: [T, h] array}``: the residual stream that enters those layers, in
            place of the previous layer's output (a *re-seeded* forward, teacher-forced per layer: each
            such layer computes from another engine's stream, its ``l_out`` of the layer before; the
            index L, the number of layers, replaces the stream that enters the final norm and the head).
            The per-layer embeddings' context part (PLE) is projected from ``layer_inputs[0]`` where given (the
            engine's own embedding, which its projection took), else from this forward's embedding; the KV cache,
            and the K/V a shared layer reads from its donor, follow from the re-seeded streams. None: the
            plain forward. Used by ``harness/parity/checks/pair.py`` (``local_rel_l2``) to judge each
            layer of an engine on its own.

    Raises:
        ValueError: a ``layer_inputs`` array that is not ``[T, h]``.

    Source: transformers ``Gemma4ForCausalLM.forward``, ``Gemma4Model.forward`` (the merge).
    """
    trace = trace or no_trace
    cache = cache if cache is not None else KVCache(cfg)
    if mm is not None:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        check_injection(cfg, mm, ids.shape[0])
        if cache.open_block and mm.placeholder[:1].any():
            raise PromptError(f"tokens {cache.n_past}.. continue an image block of the previous call: "
                              "a bidirectional image block must be prefilled in one call")
        ids = llm_input_ids(ids, mm.placeholder, pad_id(cfg))
    ids = check_prompt(cfg, ids, cache.n_past)
    positions = cache.n_past + np.arange(ids.shape[0], dtype=np.int64)
    k_pos = np.concatenate([cache.pos, positions])  # [S]
    x = embed(cfg, W, ids)  # [T, h]
    if mm is not None:
        x = merge_embeddings(x, mm.placeholder, mm.embeds)
    trace("inp_scaled", -1, x)
    ple = None
    if cfg.ple_dim:
        # re-seeded with the engine's embedding: its PLE projection took that one too (its fp32 bits decide the
        # int8 rounding of the projection's input where an engine rounds it)
        seeded = layer_inputs is not None and 0 in layer_inputs
        ple = per_layer_inputs(cfg, W, ids, reseed(layer_inputs[0], x.shape, 0) if seeded else x)  # [T, L, P]
        trace("inp_per_layer", -1, ple)
    q_block = vision_blocks(cfg, mm)  # [T] or None
    blocks = None if q_block is None else (q_block, np.concatenate([np.full(cache.n_past, -1), q_block]))
    for layer in cfg.layers:
        if layer_inputs is not None and layer.index in layer_inputs:
            x = reseed(layer_inputs[layer.index], x.shape, layer.index)
        x = decoder_layer(cfg, layer, W, x, positions, k_pos, cache,
                          None if ple is None else ple[:, layer.index], trace, blocks if layer.is_sliding else None)
    cache.pos = k_pos
    cache.open_block = q_block is not None and bool(q_block[-1] >= 0)
    if layer_inputs is not None and cfg.n_layer in layer_inputs:  # the stream that enters the final norm
        x = reseed(layer_inputs[cfg.n_layer], x.shape, cfg.n_layer)
    x = rms_norm(x, W["output_norm.weight"], cfg.rms_eps)
    trace("result_norm", -1, x)
    logits = lm_head(cfg, W, x)
    trace("result_output", -1, logits)
    return logits


def greedy_generate(cfg: ModelConfig, W, prompt: Sequence[int], max_new_tokens: int,
                    stop: Sequence[int] = ()) -> list[int]:
    """Greedy continuation with the KV cache (prefill, then one token per step).

    Args:
        prompt: token ids.
        max_new_tokens: tokens to produce at most.
        stop: ids that end generation (included in the output).

    Returns:
        the new token ids. Ties go to the lowest id (``np.argmax``).
    """
    cache = KVCache(cfg)
    logits = forward(cfg, W, prompt, cache)
    out: list[int] = []
    for _ in range(max_new_tokens):
        tok = int(np.argmax(logits[-1]))
        out.append(tok)
        if tok in stop:
            break
        logits = forward(cfg, W, [tok], cache)
    return out
