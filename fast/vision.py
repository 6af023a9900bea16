"""The Gemma 4 vision encoder in torch: the twin of :mod:`reference.vision`, function by function.

Same names and signatures as the reference (``clipped_linear``, ``scale_pixels``, ``patch_embed``,
``position_embed``, ``rope_inv_freq_2d``, ``rope_2d``, ``vision_attention``, ``vision_mlp``,
``pool_cells``, ``pool``, ``standardize``, ``embed_vision``, ``clip_bounds``, ``attention_block``,
``encoder_layer``, ``encode_image``) and the same trace points; the config and the input checks are
the reference's (:class:`reference.vision.VisionConfig`, :func:`reference.vision.check_patches`).
Weights: :class:`fast.mm_weights.EncoderWeights`. Matrices may be 16-bit; activations, norms, RoPE,
softmax and the pooler stay float32 (transformers pools and standardizes in float32 too).

Shapes: N = patches (padding rows included), H = hidden, nH / nKV = heads, D = head_dim.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F

from gemma4_harness.reference.model import TraceFn
from gemma4_harness.reference.vision import CLIP_BOUND_SUFFIXES, VisionConfig, check_patches

from .model import ATTENTION_BLOCK, apply_rope, gelu_tanh, linear, rms_norm, rope_angles


def clipped_linear(x: torch.Tensor, w, bounds: tuple[float, float, float, float] | None) -> torch.Tensor:
    """ClippableLinear: clamp the input, ``x @ w.T``, clamp the output. [N, in] -> [N, out].

    Source: reference ``clipped_linear``.
    """
    if bounds is None:
        return linear(x, w)
    in_lo, in_hi, out_lo, out_hi = bounds
    return linear(x.clamp(in_lo, in_hi), w).clamp(out_lo, out_hi)


def scale_pixels(pixel_values: torch.Tensor) -> torch.Tensor:
    """``2x - 1``. [N, 3p^2] -> [N, 3p^2]. Source: reference ``scale_pixels``."""
    return 2.0 * pixel_values - 1.0


def patch_embed(x: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """Patch projection on HWC-flattened patches with llama.cpp's conv kernel ``[H, 3, p, p]``.

    [N, p*p*3], [H, 3, p, p] -> [N, H]. Source: reference ``patch_embed``.
    """
    return linear(x, kernel.permute(0, 2, 3, 1).reshape(kernel.shape[0], -1))


def position_embed(positions: torch.Tensor, table: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
    """``T_x[x] + T_y[y]``, zero on padding rows. [N, 2], [2, P, H], [N] -> [N, H]. Source: reference."""
    pos = positions.clamp(min=0)
    emb = table[0][pos[:, 0]] + table[1][pos[:, 1]]
    return torch.where(padding[:, None], torch.zeros_like(emb), emb)


def rope_inv_freq_2d(head_dim: int, theta: float) -> torch.Tensor:
    """``theta^(-2i / (D/2))`` for i < D/4, float64. [] -> [D/4]. Source: reference ``rope_inv_freq_2d``."""
    half = head_dim // 2
    return theta ** (-torch.arange(0, half, 2, dtype=torch.float64) / half)


def rope_2d(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """2-D RoPE: dims [0, D/2) by x, [D/2, D) by y, NeoX pairs within each half. [N, heads, D], [N, 2] -> same.

    Source: reference ``rope_2d``.
    """
    half = x.shape[-1] // 2
    inv = rope_inv_freq_2d(x.shape[-1], theta)
    cos_x, sin_x = rope_angles(positions[:, 0].cpu(), inv)
    cos_y, sin_y = rope_angles(positions[:, 1].cpu(), inv)
    dev = x.device
    x_part = apply_rope(x[..., :half], cos_x.to(dev), sin_x.to(dev), half)
    y_part = apply_rope(x[..., half:], cos_y.to(dev), sin_y.to(dev), half)
    return torch.cat([x_part, y_part], dim=-1)


def vision_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
    """Non-causal attention, scale 1.0, padding keys masked; queries in blocks of ``ATTENTION_BLOCK``.

    [N, nH, D], [N, nKV, D], [N, nKV, D], [N] bool -> [N, nH*D]. Source: reference ``vision_attention``.
    """
    n, heads, d = q.shape
    group = heads // k.shape[1]
    kk, vv = k.transpose(0, 1), v.transpose(0, 1)  # [nKV, N, D]
    if group > 1:
        kk, vv = kk.repeat_interleave(group, dim=0), vv.repeat_interleave(group, dim=0)
    mask = key_valid[None, :]
    outs = [F.scaled_dot_product_attention(q[lo:lo + ATTENTION_BLOCK].transpose(0, 1), kk, vv, attn_mask=mask,
                                           scale=1.0).transpose(0, 1) for lo in range(0, n, ATTENTION_BLOCK)]
    return torch.cat(outs, 0).reshape(n, heads * d)


def vision_mlp(cfg: VisionConfig, W: Mapping[str, torch.Tensor], b: str, x: torch.Tensor) -> torch.Tensor:
    """``down(gelu_tanh(gate x) * up x)`` with ClippableLinears. [N, H] -> [N, H]. Source: reference."""
    g = clipped_linear(x, W[b + "ffn_gate.weight"], clip_bounds(cfg, W, b + "ffn_gate"))
    u = clipped_linear(x, W[b + "ffn_up.weight"], clip_bounds(cfg, W, b + "ffn_up"))
    return clipped_linear(gelu_tanh(g) * u, W[b + "ffn_down.weight"], clip_bounds(cfg, W, b + "ffn_down"))


def pool_cells(positions: torch.Tensor, k: int) -> torch.Tensor:
    """Pooled cell of each patch, row-major. [N, 2] -> [N] int64. Source: reference ``pool_cells``."""
    pos = positions.clamp(min=0)
    cells_per_row = (int(pos[:, 0].max()) + 1) // k
    return pos[:, 0] // k + cells_per_row * (pos[:, 1] // k)


def pool(h: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor, k: int) -> torch.Tensor:
    """Average each k x k cell (sum / k^2), drop empty cells, scale by ``sqrt(H)``; float32.

    [N, H], [N, 2], [N] -> [n_soft, H]. Source: reference ``pool``.
    """
    valid = ~padding
    cells = pool_cells(positions, k)[valid]
    n_cells = int(cells.max()) + 1
    sums = torch.zeros((n_cells, h.shape[1]), dtype=torch.float32, device=h.device)
    sums.index_add_(0, cells, h[valid].float())
    counts = torch.bincount(cells, minlength=n_cells)
    return sums[counts > 0] / k**2 * math.sqrt(h.shape[1])


def standardize(h: torch.Tensor, std_bias: torch.Tensor, std_scale: torch.Tensor) -> torch.Tensor:
    """``(h - std_bias) * std_scale``. [n, H] -> [n, H]. Source: reference ``standardize``."""
    return (h - std_bias) * std_scale


def embed_vision(h: torch.Tensor, w, eps: float) -> torch.Tensor:
    """RMSNorm without weight, then linear into the text width (no sqrt scale). [n, H] -> [n, H_text].

    Source: reference ``embed_vision``.
    """
    return linear(rms_norm(h, None, eps), w)


def clip_bounds(cfg: VisionConfig, W: Mapping[str, torch.Tensor], name: str) -> tuple[float, ...] | None:
    """The four ClippableLinear scalars of ``name``; a missing one is no bound. Source: reference."""
    if not cfg.use_clipped_linears:
        return None
    inf = (-math.inf, math.inf, -math.inf, math.inf)
    return tuple(float(W[f"{name}.{s}"][0]) if f"{name}.{s}" in W else d for s, d in zip(CLIP_BOUND_SUFFIXES, inf))


def _trace(trace: TraceFn | None, point: str, layer: int, arr: torch.Tensor, rows: torch.Tensor | None) -> None:
    if trace:
        a = arr if rows is None else arr[rows]
        trace(point, layer, a.detach().double().cpu().numpy())


def attention_block(cfg: VisionConfig, W: Mapping[str, torch.Tensor], il: int, x: torch.Tensor,
                    positions: torch.Tensor, valid: torch.Tensor, trace: TraceFn | None) -> torch.Tensor:
    """Self-attention of one encoder layer. [N, H] -> [N, H]. Source: reference ``attention_block``."""
    b, n, d, eps = f"v.blk.{il}.", x.shape[0], cfg.head_dim, cfg.rms_norm_eps
    q = clipped_linear(x, W[b + "attn_q.weight"], clip_bounds(cfg, W, b + "attn_q")).reshape(n, -1, d)
    k = clipped_linear(x, W[b + "attn_k.weight"], clip_bounds(cfg, W, b + "attn_k")).reshape(n, -1, d)
    v = clipped_linear(x, W[b + "attn_v.weight"], clip_bounds(cfg, W, b + "attn_v")).reshape(n, -1, d)
    q = rope_2d(rms_norm(q, W[b + "attn_q_norm.weight"], eps), positions, cfg.rope_theta)
    k = rope_2d(rms_norm(k, W[b + "attn_k_norm.weight"], eps), positions, cfg.rope_theta)
    v = rms_norm(v, None, eps)
    _trace(trace, "Qcur_pos", il, q, valid)
    _trace(trace, "Kcur_pos", il, k, valid)
    _trace(trace, "Vcur_normed", il, v, valid)
    out = vision_attention(q, k, v, valid)
    _trace(trace, "kqv_out", il, out, valid)
    return clipped_linear(out, W[b + "attn_out.weight"], clip_bounds(cfg, W, b + "attn_out"))


def encoder_layer(cfg: VisionConfig, W: Mapping[str, torch.Tensor], il: int, h: torch.Tensor,
                  positions: torch.Tensor, valid: torch.Tensor, trace: TraceFn | None) -> torch.Tensor:
    """One encoder layer with sandwich norms. [N, H] -> [N, H]. Source: reference ``encoder_layer``."""
    b, eps = f"v.blk.{il}.", cfg.rms_norm_eps
    x = rms_norm(h, W[b + "ln1.weight"], eps)
    _trace(trace, "layer_inp_normed", il, x, valid)
    a = attention_block(cfg, W, il, x, positions, valid, trace)
    _trace(trace, "attn_out", il, a, valid)
    a = rms_norm(a, W[b + "attn_post_norm.weight"], eps)
    _trace(trace, "attn_post_normed", il, a, valid)
    h = h + a
    _trace(trace, "ffn_inp", il, h, valid)
    x = rms_norm(h, W[b + "ln2.weight"], eps)
    _trace(trace, "ffn_inp_normed", il, x, valid)
    f = vision_mlp(cfg, W, b, x)
    _trace(trace, "ffn_out", il, f, valid)
    f = rms_norm(f, W[b + "ffn_post_norm.weight"], eps)
    _trace(trace, "ffn_post_normed", il, f, valid)
    h = h + f
    _trace(trace, "layer_out", il, h, valid)
    return h


def encode_image(cfg: VisionConfig, W: Mapping[str, torch.Tensor], pixel_values, position_ids,
                 trace: TraceFn | None = None) -> torch.Tensor:
    """Soft-token embeddings of one image, float32 ``[n_valid / k^2, H_text]`` on W's device.

    Args as reference ``encode_image`` (pixel_values [N, 3p^2] in [0, 1], position_ids [N, 2] with
    ``(-1, -1)`` padding; numpy or torch); ``W``: :class:`fast.mm_weights.EncoderWeights`.

    Raises:
        InputError: see :func:`reference.vision.check_patches`.
    """
    pv_np, pos_np = np.asarray(pixel_values, dtype=np.float32), np.asarray(position_ids, dtype=np.int64)
    padding_np = check_patches(cfg, pv_np, pos_np)
    dev = W["v.patch_embd.weight"].device
    padding = torch.from_numpy(padding_np).to(dev)
    valid = ~padding
    pos = torch.from_numpy(pos_np).to(dev)
    x = scale_pixels(torch.from_numpy(pv_np).to(dev))
    _trace(trace, "inp_raw_scaled", -1, x, valid)
    h = patch_embed(x, W["v.patch_embd.weight"])
    _trace(trace, "inp", -1, h, valid)
    h = h + position_embed(pos, W["v.position_embd.weight"], padding)
    _trace(trace, "pos_embd", -1, h, valid)
    for il in range(cfg.num_hidden_layers):
        h = encoder_layer(cfg, W, il, h, pos, valid, trace)
    h = pool(h, pos, padding, cfg.pooling_kernel_size)
    _trace(trace, "pooled", -1, h, None)
    if cfg.standardize:
        h = standardize(h, W["v.std_bias"], W["v.std_scale"])
        _trace(trace, "std_scaled", -1, h, None)
    out = embed_vision(h, W["mm.input_projection.weight"], cfg.rms_norm_eps)
    _trace(trace, "projected", -1, out, None)
    return out
