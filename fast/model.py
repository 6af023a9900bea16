"""The Gemma 4 (and Gemma 3) text decoder in torch: the same forward as ``reference/``, fast.

Same config object and the same loader as the reference
(:func:`reference.weights.load_model`), so a difference between the twins is a
difference in the math. Functions carry the reference's names (``rms_norm``,
``apply_rope``, ``attention``, ``gelu_ffn``, ``moe_route`` ...).

Speed comes from batching every new token of every sequence into one matrix
(``[N, h]``: a ragged batch, as in vLLM), from ``scaled_dot_product_attention``
and from a paged KV cache (:mod:`fast.kvcache`), not from clever code. The
device (``cpu``/``cuda``) and dtype (float32, bfloat16, float16) are the
caller's and applies to the weights; activations, the KV cache, norms, softmax
and RoPE stay float32 (llama.cpp's layout for 16-bit weights).

Shapes: N = new tokens in the step (all sequences), T = a sequence's new tokens,
S = its keys, h = hidden, H/Hkv = query/KV heads, D = head_dim, L = layers,
P = PLE width, V = vocab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from reference.config import LayerSpec, ModelConfig
from reference.errors import InputError, PromptError
from reference.model import check_prompt, rope_inv_freq

from . import cpu_kernels
from .kvcache import PagedKVCache

TraceFn = Callable[[str, int, np.ndarray], None]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """``float32`` | ``bfloat16`` | ``float16`` (or a torch dtype) -> torch dtype.

    Raises:
        InputError: unknown name.
    """
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise InputError(f"dtype {name!r}: expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_device(name: str | None) -> torch.device:
    """``cpu`` | ``cuda`` | ``cuda:N`` | None (cuda when present, else cpu).

    Raises:
        InputError: cuda asked for but not available.
    """
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device {name!r}: CUDA is not available here (torch {torch.__version__})")
    return dev


# --------------------------------------------------------------------------- operations


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in float32, result in x's dtype. [..., n], [n] -> [..., n]. Source: transformers ``Gemma4RMSNorm``."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    return y.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_rot: int) -> torch.Tensor:
    """NeoX RoPE on the first n_rot dims. [N, H, D], [N, 1, n_rot/2] x2 -> [N, H, D].

    Source: transformers ``apply_rotary_pos_emb``; equals :func:`reference.model.apply_rope`.
    """
    half = n_rot // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:n_rot]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xf[..., n_rot:]], dim=-1)
    return out.to(x.dtype)


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """``x @ w.T`` for a dense weight or a :class:`fast.quants.QuantizedTensor`. [N, in] -> [N, out].

    Activations are float32; a 16-bit weight multiplies a 16-bit copy of ``x``
    (the GEMM accumulates in float32) and the result returns to float32, as in
    llama.cpp's 16-bit weight path. On the CPU in float32, 1 to 16 rows go
    through :func:`fast.cpu_kernels.linear_f32` (a bandwidth-bound kernel; see
    that module for why and when), more through ``F.linear``.
    """
    if isinstance(w, torch.Tensor):
        if w.dtype != x.dtype:
            return F.linear(x.to(w.dtype), w).to(x.dtype)
        if x.dim() == 2 and x.shape[0] <= cpu_kernels.MAX_ROWS and x.device.type == "cpu":
            y = cpu_kernels.linear_f32(x, w)  # small-M CPU fp32 decode kernel; None when it does not apply
            if y is not None:
                return y
        return F.linear(x, w)
    return w.linear(x).to(x.dtype)


def embed_rows(w, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of an embedding table (dense or kept quantized), float32. [N] -> [N, n]."""
    if isinstance(w, torch.Tensor):
        return w[ids].float()
    return w.take_rows(ids, dtype=torch.float32)


def gelu_ffn(x: torch.Tensor, w_gate, w_up, w_down) -> torch.Tensor:
    """``down(gelu_tanh(gate x) * up x)``. [N, h] -> [N, h]. Source: transformers ``Gemma4TextMLP``."""
    return linear(F.gelu(linear(x, w_gate), approximate="tanh") * linear(x, w_up), w_down)


def moe_route(x: torch.Tensor, w_router, router_scale: torch.Tensor, per_expert_scale: torch.Tensor, k: int,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts and weights. [N, h] -> ([N, K] int64, [N, K] float32). Source: transformers ``Gemma4TextRouter``."""
    h = x.shape[-1]
    z = rms_norm(x, None, eps).float() * router_scale * h**-0.5
    probs = torch.softmax(linear(z.to(x.dtype), w_router).float(), dim=-1)
    top, idx = torch.topk(probs, k, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    return idx, top * per_expert_scale[idx]


def moe_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, idx: torch.Tensor,
                weights: torch.Tensor, rows: int = 16,
                act: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Weighted sum of the chosen experts. [N, h], [E, 2F, h], [E, h, F], [N, K] x2 -> [N, h].

    ``act`` is the gate activation, GELU-tanh when None (the mutation self-test passes another).

    Each expert runs on its tokens in blocks of exactly ``rows`` rows (the last
    one padded with zeros), so every matmul has the same shape whatever number
    of *other* tokens chose the expert: a token's result is then independent of
    its neighbours in the batch (DESIGN.md: neighbour isolation), with any GEMM
    kernel. Source: transformers ``Gemma4TextExperts`` (gate first in gate_up).
    """
    out = torch.zeros_like(x, dtype=torch.float32)
    Fdim = w_down.shape[2]
    for e in torch.unique(idx).tolist():
        tok, slot = torch.nonzero(idx == e, as_tuple=True)
        for c in range(0, tok.numel(), rows):
            t, sl = tok[c:c + rows], slot[c:c + rows]
            n = t.numel()
            xe = x.new_zeros((rows, x.shape[1]))
            xe[:n] = x[t]
            gu = linear(xe, w_gate_up[e])
            g = F.gelu(gu[:, :Fdim], approximate="tanh") if act is None else act(gu[:, :Fdim])
            y = linear(g * gu[:, Fdim:], w_down[e])[:n]
            out.index_add_(0, t, y.float() * weights[t, sl, None])
    return out.to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
              window: int | None, scale: float) -> torch.Tensor:
    """Causal (optionally sliding-window) GQA through ``scaled_dot_product_attention``.

    [T, H, D], [S, Hkv, D], [S, Hkv, D], [T], [S] -> [T, H*D]. Query i sees key j
    iff ``0 <= pos_i - pos_j (< window)``. Source: transformers ``eager_attention_forward``.
    """
    T, H, D = q.shape
    dist = q_pos[:, None] - k_pos[None, :]
    allowed = dist >= 0
    if window is not None:
        allowed &= dist < window
    group = H // k.shape[1]
    kk = k.transpose(0, 1)  # [Hkv, S, D]
    vv = v.transpose(0, 1)
    if group > 1:
        kk = kk.repeat_interleave(group, dim=0)
        vv = vv.repeat_interleave(group, dim=0)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=allowed, scale=scale)  # [H, T, D]
    return out.transpose(0, 1).reshape(T, H * D)


# --------------------------------------------------------------------------- weights


class FastWeights:
    """Canonical weights as torch tensors on one device and dtype.

    GGUF tensors are dequantized with :mod:`fast.quants` on the device from the
    mapped bytes (bit-exact with ``gguf.quants``); safetensors go through numpy.
    With ``keep_quantized``, 2-D quantized weights stay packed and are
    dequantized on the fly inside each matmul (on the CPU, as views of the
    memory-mapped file, through :mod:`fast.quant_kernels`). Norms, scales and
    ``rope_freqs`` are kept in float32.

    Raises:
        InputError: a quant type fast dequantization does not support.
    """

    FLOAT32_ALWAYS = ("norm", "scale", "rope_freqs", "ffn_gate_inp.scale", "ffn_down_exps.scale")

    def __init__(self, cfg: ModelConfig, W, device: torch.device, dtype: torch.dtype, keep_quantized: bool = False):
        self.t: dict[str, object] = {}
        for name in W:
            keep32 = any(s in name for s in self.FLOAT32_ALWAYS) or len(W.shape(name)) == 1
            target = torch.float32 if keep32 else dtype
            if hasattr(W, "torch_tensor"):  # made on the device, no file (fast.shapes.RandomWeights)
                self.t[name] = W.torch_tensor(name, device, target)
                continue
            stored = W.stored(name) if hasattr(W, "stored") else None
            qtype = W.raw_dtype(name) if hasattr(W, "raw_dtype") else "F32"
            if stored is not None and qtype != "F32":
                from . import quants

                if qtype not in quants.SUPPORTED:
                    raise InputError(f"{W.source}: tensor {name}: type {qtype} is not supported by fast dequantization")
                if keep_quantized and len(W.shape(name)) == 2 and qtype not in ("F16", "BF16"):
                    # CPU: a view of the mapped file, no copy; elsewhere: one copy on the device
                    self.t[name] = quants.QuantizedTensor.from_numpy(stored, qtype, W.shape(name), device,
                                                                     copy=device.type != "cpu")
                    continue
                raw = torch.from_numpy(np.array(stored).view(np.uint8)).to(device)  # own copy of the mapped bytes
                self.t[name] = quants.dequantize(raw, qtype, W.shape(name), dtype=torch.float32).to(target)
            else:
                arr = np.array(W.raw(name), dtype=np.float32)  # own copy: the source may be a read-only map
                self.t[name] = torch.from_numpy(arr).to(device=device, dtype=target)

    def __getitem__(self, name: str):
        return self.t[name]

    def __contains__(self, name: str) -> bool:
        return name in self.t

    def nbytes(self) -> int:
        """Bytes the weights occupy on the device."""
        total = 0
        for v in self.t.values():
            total += v.numel() * v.element_size() if isinstance(v, torch.Tensor) else int(v.nbytes)
        return total


# --------------------------------------------------------------------------- model


@dataclass
class SeqStep:
    """One sequence's part of a batched step: cache slot, token ids and first position."""

    slot: int
    ids: torch.Tensor  # [T] int64
    start: int  # position of ids[0]


class FastModel:
    """The torch twin of :func:`reference.model.forward`, for ragged batches over a paged cache.

    Args:
        cfg: the config from :func:`reference.weights.load_model`.
        W: the weights from the same call.
        device, dtype: where and in what to compute.
        keep_quantized: keep GGUF quantized matrices packed (dequantize on the fly).

    Raises:
        InputError: bad device/dtype or unsupported quant type.
    """

    def __init__(self, cfg: ModelConfig, W, device: str | torch.device | None = None,
                 dtype: str | torch.dtype = "float32", keep_quantized: bool = False):
        self.cfg = cfg
        self.device = resolve_device(device) if not isinstance(device, torch.device) else device
        self.dtype = resolve_dtype(dtype)
        self.w = FastWeights(cfg, W, self.device, self.dtype, keep_quantized)
        self.inv_freq = {L.index: torch.tensor(rope_inv_freq(L), dtype=torch.float64) for L in cfg.layers}
        self._rope_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.embed_scale = math.sqrt(cfg.hidden_size)

    def new_cache(self, max_seqs: int, max_tokens: int, page_size: int = 16) -> PagedKVCache:
        """A paged KV cache for up to ``max_seqs`` sequences of up to ``max_tokens`` tokens each."""
        return PagedKVCache(self.cfg, max_seqs=max_seqs, max_tokens=max_tokens, page_size=page_size,
                            device=self.device, dtype=torch.float32)

    def rope_tables(self, layer: LayerSpec, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for ``positions`` of one layer, float32 ``[N, 1, n_rot/2]``.

        Angles are formed in float64 and rounded once (the reference computes
        them exactly; transformers in float32).
        """
        need = int(positions.max().item()) + 1 if positions.numel() else 0
        cached = self._rope_cache.get(layer.index)
        if cached is None or cached[0].shape[0] < need:
            n = max(need, 256, 2 * (cached[0].shape[0] if cached else 0))
            ang = torch.arange(n, dtype=torch.float64)[:, None] * self.inv_freq[layer.index][None, :]
            cached = (torch.cos(ang).float().to(self.device), torch.sin(ang).float().to(self.device))
            self._rope_cache[layer.index] = cached
        cos, sin = cached
        return cos[positions][:, None, :], sin[positions][:, None, :]

    # ------------------------------------------------------------------ the step

    def step(self, cache: PagedKVCache, seqs: Sequence[SeqStep], all_logits: bool = False,
             trace: TraceFn | None = None) -> torch.Tensor:
        """Run the new tokens of several sequences through the model, appending to their caches.

        Args:
            cache: the paged cache holding each sequence's earlier tokens.
            seqs: one entry per sequence in the batch (any mix of prefill chunks and decode tokens).
            all_logits: logits of every new token, else only of each sequence's last one.
            trace: callback ``(point, layer, array)``; only for a single-sequence step.

        Returns:
            float32 logits ``[N, V]`` (all_logits) or ``[len(seqs), V]``.
        """
        cfg, w, dev = self.cfg, self.w, self.device
        if trace is not None and len(seqs) != 1:
            raise ValueError("tracing is for single-sequence steps")
        ids = torch.cat([s.ids for s in seqs]).to(dev)
        lens = [int(s.ids.numel()) for s in seqs]
        positions = torch.cat([torch.arange(s.start, s.start + n, dtype=torch.long) for s, n in zip(seqs, lens)]).to(dev)
        offsets = np.cumsum([0] + lens)

        def tr(point, layer, t):
            if trace is not None:
                trace(point, layer, t.detach().double().cpu().numpy())

        x = embed_rows(w["token_embd.weight"], ids) * self.embed_scale  # [N, h] float32
        tr("inp_scaled", -1, x)
        ple = None
        if cfg.ple_dim:
            ple = self.per_layer_inputs(ids, x)  # [N, L, P]
            tr("inp_per_layer", -1, ple)
        views: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        for layer in cfg.layers:
            x = self.decoder_layer(layer, x, positions, seqs, offsets, cache, views,
                                   None if ple is None else ple[:, layer.index], tr if trace else None)
        if not all_logits:
            x = x[torch.as_tensor(offsets[1:] - 1, device=dev)]
        x = rms_norm(x, w["output_norm.weight"], cfg.rms_eps)
        tr("result_norm", -1, x)
        head = w["token_embd.weight"] if cfg.tie_word_embeddings else w["output.weight"]
        logits = linear(x, head).float()
        if cfg.final_logit_softcap is not None:
            c = cfg.final_logit_softcap
            logits = torch.tanh(logits / c) * c
        tr("result_output", -1, logits)
        return logits

    def per_layer_inputs(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """PLE for every layer. [N], [N, h] -> [N, L, P]. Source: reference ``per_layer_inputs``."""
        cfg, w = self.cfg, self.w
        N, L, P = ids.shape[0], cfg.n_layer, cfg.ple_dim
        tok = embed_rows(w["per_layer_token_embd.weight"], ids).reshape(N, L, P) * math.sqrt(P)
        ctx = linear(x, w["per_layer_model_proj.weight"]).float() * cfg.hidden_size**-0.5
        ctx = rms_norm(ctx.reshape(N, L, P), w["per_layer_proj_norm.weight"], cfg.rms_eps)
        return (ctx + tok) * 2.0**-0.5

    def decoder_layer(self, layer: LayerSpec, x, positions, seqs, offsets, cache, views, ple, tr) -> torch.Tensor:
        """One layer over the ragged batch. [N, h] -> [N, h]. Source: reference ``decoder_layer``."""
        cfg, w, eps, il = self.cfg, self.w, self.cfg.rms_eps, layer.index
        b = f"blk.{il}."
        attn = self.attention_block(layer, rms_norm(x, w[b + "attn_norm.weight"], eps), positions, seqs, offsets,
                                    cache, views)
        a = x + rms_norm(attn, w[b + "post_attention_norm.weight"], eps)
        if tr:
            tr("attn_out", il, a)
        xn = rms_norm(a, w[b + "ffn_norm.weight"], eps)
        f = gelu_ffn(xn, w[b + "ffn_gate.weight"], w[b + "ffn_up.weight"], w[b + "ffn_down.weight"])
        if layer.has_moe:
            f = rms_norm(f, w[b + "post_ffw_norm_1.weight"], eps)
            idx, wgt = moe_route(a, w[b + "ffn_gate_inp.weight"], w[b + "ffn_gate_inp.scale"],
                                 w[b + "ffn_down_exps.scale"], cfg.n_expert_used, eps)
            xe = rms_norm(a, w[b + "pre_ffw_norm_2.weight"], eps)
            moe = rms_norm(moe_experts(xe, w[b + "ffn_gate_up_exps.weight"], w[b + "ffn_down_exps.weight"], idx, wgt),
                           w[b + "post_ffw_norm_2.weight"], eps)
            if tr:
                tr("ffn_mlp", il, f)
                tr("ffn_moe", il, moe)
            f = f + moe
        if tr:
            tr("ffn_out", il, f)
        y = a + rms_norm(f, w[b + "post_ffw_norm.weight"], eps)
        if ple is not None:
            g = F.gelu(linear(y, w[b + "inp_gate.weight"]), approximate="tanh") * ple
            p = rms_norm(linear(g, w[b + "proj.weight"]), w[b + "post_norm.weight"], eps)
            if tr:
                tr("per_layer_embd_out", il, p)
            y = y + p
        if cfg.has_layer_scalar and b + "layer_output_scale.weight" in w:
            y = y * w[b + "layer_output_scale.weight"].to(y.dtype)
        if tr:
            tr("l_out", il, y)
        return y

    def attention_block(self, layer: LayerSpec, x, positions, seqs, offsets, cache: PagedKVCache, views):
        """q/k/v for the whole batch, then per-sequence cached attention. [N, h] -> [N, h].

        A KV-owning layer writes its new K/V into the cache and records, per
        sequence, the keys it attended (``views``) so that a shared layer reads
        exactly its donor's K/V without any copy into the cache.
        Source: reference ``attention_block``.
        """
        cfg, w, eps = self.cfg, self.w, self.cfg.rms_eps
        b = f"blk.{layer.index}."
        N = x.shape[0]
        H, Hkv, D = layer.n_head, layer.n_kv_head, layer.head_dim
        cos, sin = self.rope_tables(layer, positions)
        q = linear(x, w[b + "attn_q.weight"]).view(N, H, D)
        q = apply_rope(rms_norm(q, w[b + "attn_q_norm.weight"], eps), cos, sin, layer.n_rot)
        window = cfg.sliding_window if layer.is_sliding else None
        outs = []
        if layer.has_kv:
            k_raw = linear(x, w[b + "attn_k.weight"]).view(N, Hkv, D)
            v = linear(x, w[b + "attn_v.weight"]).view(N, Hkv, D) if layer.has_v_proj else k_raw
            if cfg.has_v_norm:
                v = rms_norm(v, None, eps)
            k = apply_rope(rms_norm(k_raw, w[b + "attn_k_norm.weight"], eps), cos, sin, layer.n_rot)
            per_seq = []
            for i, s in enumerate(seqs):
                lo, hi = offsets[i], offsets[i + 1]
                k_all, v_all, k_pos = cache.attend_and_append(layer.index, s.slot, s.start, k[lo:hi], v[lo:hi],
                                                              derive_k=self._derive_k(layer))
                per_seq.append((k_all, v_all, k_pos))
                outs.append(attention(q[lo:hi], k_all, v_all, positions[lo:hi], k_pos, window, cfg.attn_scale))
            views[layer.index] = per_seq
        else:
            donor = views[layer.kv_donor]
            for i, s in enumerate(seqs):
                lo, hi = offsets[i], offsets[i + 1]
                k_all, v_all, k_pos = donor[i]
                outs.append(attention(q[lo:hi], k_all, v_all, positions[lo:hi], k_pos, window, cfg.attn_scale))
        return linear(torch.cat(outs, 0), w[b + "attn_output.weight"])

    def _derive_k(self, layer: LayerSpec):
        """For a k_eq_v layer the cache keeps only V = rmsnorm(raw); K = rope(V * k_norm weight) is
        rebuilt for cached positions (same RMS factor as K's own norm)."""
        if layer.has_v_proj or not self.cfg.has_v_norm:
            return None
        wk = self.w[f"blk.{layer.index}.attn_k_norm.weight"]

        def derive(v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            cos, sin = self.rope_tables(layer, pos)
            return apply_rope((v.float() * wk).to(v.dtype), cos, sin, layer.n_rot)

        return derive

    # ------------------------------------------------------------------ conveniences

    def logits(self, ids: Sequence[int], chunk: int | None = None, trace: TraceFn | None = None) -> torch.Tensor:
        """Logits of every position of one sequence (prefill in chunks of ``chunk``; None = one shot).

        Returns: float32 ``[T, V]``. Raises: PromptError (see reference ``check_prompt``).
        """
        ids_np = check_prompt(self.cfg, ids)
        T = ids_np.shape[0]
        cache = self.new_cache(1, T)
        slot = cache.alloc()
        chunk = chunk or T
        out = []
        with torch.inference_mode():
            for start in range(0, T, chunk):
                part = torch.from_numpy(ids_np[start:start + chunk])
                out.append(self.step(cache, [SeqStep(slot, part, start)], all_logits=True,
                                     trace=trace if chunk >= T else None))
        return torch.cat(out, 0)
