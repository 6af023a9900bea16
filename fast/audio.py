"""The Gemma 4 audio encoder (conformer) and ``embed_audio`` in torch: the twin of :mod:`reference.audio`.

Same names and signatures as the reference (``silu``, ``glu``, ``layer_norm``, ``clip_stream``,
``clippable_linear``, ``conv2d_stride2``, ``subsample_block``, ``subsample``, ``rel_pos_table``,
``attention_mask``, ``relative_bias``, ``audio_attention``, ``ffn_half_step``,
``causal_depthwise_conv``, ``light_conv``, ``conformer_layer``, ``output_proj``, ``embed_audio``,
``encode_audio``) and the same trace points. The attention is written, as in the reference, as full
attention under the equivalent mask with an explicit relative bias (``[nh, T', T']``: at most 750
frames after the 30 s cap).

The mel front end stays on the reference side (:func:`reference.audio_features.extract_features`):
it runs once per clip on the waveform, costs a few milliseconds per second of audio, and its source
(transformers' ``Gemma4AudioFeatureExtractor``) is itself NumPy on the CPU, so there is no device
version to be a twin of. :func:`encode_audio` takes its ``[T, 128]`` features, as the reference does.

Matrices may be 16-bit; activations, norms, convolutions and softmax stay float32.
Shapes: T = mel frames, T' = encoder frames, H = hidden, nh = heads, D = H / nh, F = relative positions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F

from gemma4_harness.reference.audio import FIXED_NORM_EPS
from gemma4_harness.reference.audio_config import AudioConfig
from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.model import TraceFn

from .model import linear, rms_norm, softcap


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)``. Source: reference ``silu``."""
    return F.silu(x)


def glu(x: torch.Tensor) -> torch.Tensor:
    """First half times sigmoid(second half) on the last axis. [..., 2n] -> [..., n]. Source: reference ``glu``."""
    return F.glu(x, dim=-1)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm without bias over the last axis. [..., n] -> [..., n]. Source: reference ``layer_norm``."""
    return F.layer_norm(x, (x.shape[-1],), weight, None, eps)


def clip_stream(x: torch.Tensor, cfg: AudioConfig) -> torch.Tensor:
    """``clamp(x, -gradient_clipping, +gradient_clipping)``. Source: reference ``clip_stream``."""
    return x.clamp(-cfg.gradient_clipping, cfg.gradient_clipping)


def clippable_linear(x: torch.Tensor, W: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """``clamp(W clamp(x, in_min, in_max), out_min, out_max)``; absent bounds do not clamp. [T, in] -> [T, out].

    Source: reference ``clippable_linear``.
    """

    def bound(suffix: str, default: float) -> float:
        key = f"{name}.{suffix}"
        return float(W[key][0]) if key in W else default

    x = x.clamp(bound("input_min", -math.inf), bound("input_max", math.inf))
    return linear(x, W[f"{name}.weight"]).clamp(bound("output_min", -math.inf), bound("output_max", math.inf))


def conv2d_stride2(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """3x3 convolution, stride 2, zero padding 1, no bias. [C_in, T, F], [C_out, C_in, 3, 3] -> [C_out, T/2, F/2].

    Source: reference ``conv2d_stride2``.
    """
    return F.conv2d(x[None], w.to(x.dtype), stride=2, padding=1)[0]


def subsample_block(x: torch.Tensor, mask: torch.Tensor, w_conv: torch.Tensor, w_norm: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero invalid frames, conv, LayerNorm over channels, ReLU; mask ``[::2]``.

    [C_in, T, F], [T] -> ([C_out, T/2, F/2], [T/2]). Source: reference ``subsample_block``.
    """
    y = conv2d_stride2(x * mask[None, :, None], w_conv)
    y = layer_norm(y.movedim(0, -1), w_norm, eps)  # [T/2, F/2, C_out]
    return torch.relu(y).movedim(-1, 0), mask[::2]


def subsample(cfg: AudioConfig, W, features: torch.Tensor, mask: torch.Tensor,
              trace: TraceFn | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Two subsampling blocks, then the input projection. [T, M], [T] -> ([T', H], [T'] bool).

    Source: reference ``subsample``.
    """
    x, m = features[None].float(), mask.bool()
    for i in range(2):
        x, m = subsample_block(x, m, W[f"a.conv1d.{i}.weight"], W[f"a.conv1d.{i}.norm.weight"], cfg.rms_norm_eps)
        _trace(trace, f"sscp_conv_{i}", -1, x.movedim(0, -1))
    x = x.movedim(0, -1)  # [T', F', ch1]
    return linear(x.reshape(x.shape[0], -1), W["a.input_projection.weight"]), m


def rel_pos_table(cfg: AudioConfig) -> torch.Tensor:
    """Sinusoidal table of the relative positions ``K, ..., 0``, formed in float64, float32. [] -> [F, H].

    Source: reference ``rel_pos_table``.
    """
    half = cfg.hidden_size // 2
    inv = torch.exp(-torch.arange(half, dtype=torch.float64) * math.log(1e4) / max(half - 1, 1))
    pos = torch.arange(cfg.n_rel_pos - 1, -1, -1, dtype=torch.float64)
    ang = pos[:, None] * inv[None, :]
    return torch.cat([torch.sin(ang), torch.cos(ang)], dim=-1).float()


def attention_mask(cfg: AudioConfig, valid: torch.Tensor) -> torch.Tensor:
    """Valid keys at distance ``0 <= t - s < P`` (or ``0 < s - t < R``). [T'] -> bool [T', T'].

    Source: reference ``attention_mask`` (audio).
    """
    t = torch.arange(valid.shape[0], device=valid.device)
    d = t[:, None] - t[None, :]
    near = ((d >= 0) & (d < cfg.max_past)) | ((d < 0) & (-d < cfg.attention_context_right))
    return near & valid[None, :]


def relative_bias(cfg: AudioConfig, q: torch.Tensor, rel_k: torch.Tensor) -> torch.Tensor:
    """``bias[h, t, s] = q[t, h] . rel_k[P - (t - s), h]``, 0 where that row does not exist.

    [T', nh, D], [F, nh, D] -> [nh, T', T']. Source: reference ``relative_bias``.
    """
    T = q.shape[0]
    qr = torch.einsum("thd,rhd->htr", q, rel_k)  # [nh, T', F]
    t = torch.arange(T, device=q.device)
    r = cfg.max_past - (t[:, None] - t[None, :])
    ok = (r >= 0) & (r < rel_k.shape[0])
    idx = r.clamp(0, rel_k.shape[0] - 1)[None].expand(qr.shape[0], -1, -1)
    return torch.where(ok[None], torch.gather(qr, 2, idx), torch.zeros((), device=q.device))


def audio_attention(cfg: AudioConfig, W, il: int, x: torch.Tensor, valid: torch.Tensor,
                    pos: torch.Tensor) -> torch.Tensor:
    """Chunked local self-attention as full attention under the equivalent mask. [T', H] -> [T', H].

    Source: reference ``audio_attention``.
    """
    b = f"a.blk.{il}."
    T, nh, D = x.shape[0], cfg.num_attention_heads, cfg.head_dim
    q = clippable_linear(x, W, b + "attn_q").reshape(T, nh, D)
    q = q * (D**-0.5 / math.log(2.0)) * W[b + "per_dim_scale.weight"]
    k = clippable_linear(x, W, b + "attn_k").reshape(T, nh, D) * (math.log(1.0 + math.e) / math.log(2.0))
    v = clippable_linear(x, W, b + "attn_v").reshape(T, nh, D)
    rel_k = linear(pos, W[b + "attn_k_rel.weight"]).reshape(-1, nh, D)
    logits = torch.einsum("thd,shd->hts", q, k) + relative_bias(cfg, q, rel_k)
    logits = softcap(logits, cfg.attention_logit_cap)
    logits = torch.where(attention_mask(cfg, valid)[None], logits,
                         torch.full((), cfg.attention_invalid_logits_value, device=x.device))
    out = torch.einsum("hts,shd->thd", torch.softmax(logits, dim=-1), v).reshape(T, nh * D)
    return clippable_linear(out, W, b + "attn_out")


def ffn_half_step(cfg: AudioConfig, W, il: int, x: torch.Tensor, second: bool) -> torch.Tensor:
    """``x + 0.5 * N_post(clamp(down(silu(up(N_pre(clamp x))))))``. [T', H] -> [T', H]. Source: reference."""
    s = "_1" if second else ""
    b = f"a.blk.{il}."
    h = rms_norm(clip_stream(x, cfg), W[f"{b}ffn_norm{s}.weight"], FIXED_NORM_EPS)
    h = clippable_linear(silu(clippable_linear(h, W, f"{b}ffn_up{s}")), W, f"{b}ffn_down{s}")
    h = rms_norm(clip_stream(h, cfg), W[f"{b}ffn_post_norm{s}.weight"], FIXED_NORM_EPS)
    return x + cfg.residual_weight * h


def causal_depthwise_conv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-channel causal convolution, left zero padding k - 1. [T', H], [H, k] -> [T', H]. Source: reference."""
    k = w.shape[1]
    xp = F.pad(x.T[None], (k - 1, 0))  # [1, H, T' + k - 1]
    return F.conv1d(xp, w[:, None, :].to(x.dtype), groups=w.shape[0])[0].T


def light_conv(cfg: AudioConfig, W, il: int, x: torch.Tensor) -> torch.Tensor:
    """``x + pw2(silu(N_conv(clamp(dw(glu(pw1(N_pre x)))))))``. [T', H] -> [T', H]. Source: reference."""
    b, eps = f"a.blk.{il}.", cfg.rms_norm_eps
    h = glu(clippable_linear(rms_norm(x, W[b + "conv_norm.weight"], eps), W, b + "conv_pw1"))
    h = clip_stream(causal_depthwise_conv(h, W[b + "conv_dw.weight"]), cfg)
    h = silu(rms_norm(h, W[b + "norm_conv.weight"], eps))
    return x + clippable_linear(h, W, b + "conv_pw2")


def conformer_layer(cfg: AudioConfig, W, il: int, x: torch.Tensor, valid: torch.Tensor, pos: torch.Tensor,
                    trace: TraceFn | None = None) -> torch.Tensor:
    """FFN half-step, attention, light conv, FFN half-step, ``norm_out``. [T', H] -> [T', H]. Source: reference."""
    b = f"a.blk.{il}."
    x = ffn_half_step(cfg, W, il, x, second=False)
    _trace(trace, "ffn_1_out", il, x)
    a = rms_norm(clip_stream(x, cfg), W[b + "attn_pre_norm.weight"], FIXED_NORM_EPS)
    a = audio_attention(cfg, W, il, a, valid, pos)
    x = x + rms_norm(clip_stream(a, cfg), W[b + "attn_post_norm.weight"], FIXED_NORM_EPS)
    _trace(trace, "attn_out", il, x)
    x = light_conv(cfg, W, il, x)
    _trace(trace, "conv_out", il, x)
    x = ffn_half_step(cfg, W, il, x, second=True)
    _trace(trace, "ffn_2_out", il, x)
    x = rms_norm(clip_stream(x, cfg), W[b + "ln2.weight"], FIXED_NORM_EPS)
    _trace(trace, "layer_out", il, x)
    return x


def output_proj(W, x: torch.Tensor) -> torch.Tensor:
    """Linear with bias. [T', H] -> [T', E]. Source: reference ``output_proj``."""
    return linear(x, W["a.pre_encode.out.weight"]) + W["a.pre_encode.out.bias"]


def embed_audio(cfg: AudioConfig, W, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm without weight, then linear into the text width (no sqrt scale). [n, E] -> [n, Ht]. Source: reference."""
    return linear(rms_norm(x, None, cfg.rms_norm_eps), W["mm.a.input_projection.weight"])


def _trace(trace: TraceFn | None, point: str, layer: int, arr: torch.Tensor) -> None:
    if trace:
        trace(point, layer, arr.detach().double().cpu().numpy())


def encode_audio(cfg: AudioConfig, W, features, mask, trace: TraceFn | None = None) -> torch.Tensor:
    """Audio soft tokens of one clip, float32 ``[n_soft, Ht]`` on W's device.

    Args as reference ``encode_audio`` (features [T, M] log-mel, mask [T]; numpy or torch);
    ``W``: :class:`fast.mm_weights.EncoderWeights`.

    Raises:
        InputError: features or mask of the wrong shape.
    """
    feats_np, mask_np = np.asarray(features, dtype=np.float32), np.asarray(mask, dtype=bool)
    if feats_np.ndim != 2 or feats_np.shape[1] != cfg.n_mels or mask_np.shape != (feats_np.shape[0],):
        raise InputError(f"audio features: shape {list(feats_np.shape)} / mask {list(mask_np.shape)}, expected "
                         f"[T, {cfg.n_mels}] / [T]")
    dev = W["a.input_projection.weight"].device
    feats, m = torch.from_numpy(feats_np).to(dev), torch.from_numpy(mask_np).to(dev)
    _trace(trace, "inp_raw", -1, feats * m[:, None])
    x, valid = subsample(cfg, W, feats, m, trace)
    _trace(trace, "inp_proj", -1, x)
    pos = rel_pos_table(cfg).to(dev)
    _trace(trace, "pos_emb", -1, pos)
    for il in range(cfg.num_hidden_layers):
        x = conformer_layer(cfg, W, il, x, valid, pos, trace)
    x = output_proj(W, x)
    _trace(trace, "output_proj", -1, x)
    y = embed_audio(cfg, W, x)
    _trace(trace, "projected", -1, y)
    return y[valid]
