"""The Gemma 4 (and Gemma 3) text decoder in torch: the same forward as ``reference/``, fast.

Same config object and the same loader as the reference (:func:`reference.weights.load_model`), so a
difference between the twins is a difference in the math. It reads like :mod:`reference.model`: the
same operations under the same names and signatures (``rms_norm``, ``rope_angles``, ``apply_rope``,
``attention``, ``gelu_ffn``, ``moe_route``, ``expert_ffn``, ``moe_experts`` ...), and the same blocks as
methods of :class:`FastModel` (``embed``, ``ple_token``, ``ple_context``, ``per_layer_inputs``,
``attention_block``, ``ffn_block``, ``moe_block``, ``ple_block``, ``layer_scale``, ``decoder_layer``,
``lm_head``). The self-test's mutants override one of these each.

Speed comes from batching every new token of every sequence into one matrix (``[N, h]``: a ragged
batch, as in vLLM), from a paged KV cache (:mod:`fast.kvcache`), and from doing each thing once per step:
rotary factors and attention masks are built once and shared by the layers, and only the rows whose
logits are asked for go through the KV-shared tail (:meth:`FastModel._keep_rows`); not from clever code.
The device (``cpu``/``cuda``) and dtype (float32, bfloat16, float16) are the caller's and apply to the
weights; activations, the KV cache, norms, softmax and RoPE stay float32 (llama.cpp's layout for 16-bit
weights).

Shapes: N = new tokens in the step (all sequences), T = a sequence's new tokens, S = its keys,
h = hidden, H/Hkv = query/KV heads, D = head_dim, L = layers, P = PLE width, V = vocab.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from gemma4_harness.reference.config import LayerSpec, ModelConfig
from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.model import TraceFn, check_prompt, rope_inv_freq
from gemma4_harness.reference.multimodal import Injection, check_injection, pad_id

from . import cpu_kernels, quant_kernels
from .kvcache import PagedKVCache
from .multimodal import chunk_end, llm_input_ids, merge_embeddings, vision_blocks
from .weights import FastWeights

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
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise InputError(f"device {name!r}: expected cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"device {name!r}: expected cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device {name!r}: CUDA is not available here (torch {torch.__version__})")
    return dev


# --------------------------------------------------------------------------- operations


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in float32, result in x's dtype. [..., n], [n] -> [..., n]. Source: transformers ``Gemma4RMSNorm``.

    ``x * (1 / sqrt(mean(x**2) + eps)) * weight``. On the CPU, for float32 weights,
    :func:`fast.cpu_kernels.rms_norm_f32` (one C call: the mean square summed in float64 in a fixed order, its
    header has the bits; a decode step makes over a hundred of these calls, and torch's composite costs six
    dispatches each); elsewhere torch's fused ``F.rms_norm`` on the float32 input, which gives the bits of
    ``x * rsqrt(mean(x**2) + eps) * weight`` written out in float32. ``tests/test_ops.py`` checks both."""
    xf = x.float()
    y = cpu_kernels.rms_norm_f32(xf, weight, eps)  # None off the CPU
    if y is None:
        y = F.rms_norm(xf, (x.shape[-1],), weight, eps)
    return y.to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (``gelu_pytorch_tanh``). [...] -> [...]. Source: Hendrycks & Gimpel 2016."""
    return F.gelu(x, approximate="tanh")


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)``. [...] -> [...]. Source: transformers ``Gemma4ForCausalLM.forward``.

    On the CPU in float32 :func:`fast.cpu_kernels.softcap_f32` (in float64, rounded once: within one ulp of the
    correctly rounded value; 0.37 ms against torch's 0.94-1.15 ms on a 262,144-logit row); elsewhere torch's
    ``tanh(x / cap) * cap``."""
    y = cpu_kernels.softcap_f32(x, cap)  # None off the CPU
    return torch.tanh(x / cap) * cap if y is None else y


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
    if (w.kernel_layout is not None and x.dtype == torch.float32 and x.dim() == 2  # a decode step's products:
            and x.shape[0] <= quant_kernels.MAX_ROWS):
        y = quant_kernels.linear(x, w.raw, w.type_name, w.shape[1], w.kernel_layout)  # straight to the kernel
        if y is not None:
            return y
    return w.linear(x).to(x.dtype)


def embed_rows(w, ids: torch.Tensor, check: bool = True) -> torch.Tensor:
    """Rows ``ids`` of an embedding table (dense or kept quantized), float32. [N] -> [N, n].

    ``check=False`` skips a packed table's range check of ``ids`` (a read back to the host, which a CUDA graph
    may not hold): for callers whose ids are already known to be in range (:mod:`fast.static_decode`).
    """
    if isinstance(w, torch.Tensor):
        return w[ids].float()
    return w.take_rows(ids, dtype=torch.float32, check=check)


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``pos * inv_freq``, formed in float64 and rounded once to float32.

    [T], [n_rot/2] -> ([T, n_rot/2], [T, n_rot/2]). The reference computes them exactly; transformers
    in float32. Source: transformers ``Gemma4RotaryEmbedding.forward``.
    """
    ang = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    return torch.cos(ang).float(), torch.sin(ang).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_rot: int) -> torch.Tensor:
    """NeoX RoPE on the first n_rot dims, in float32. [N, H, D], [N, n_rot/2] x2 -> [N, H, D].

    ``[x1 c - x2 s, x2 c + x1 s, rest]``, computed as :func:`rope_rotate` with the tables of
    :func:`rope_full_tables` (the same roundings, bit for bit).
    Source: transformers ``apply_rotary_pos_emb``; equals :func:`reference.model.apply_rope`.
    """
    return rope_rotate(x, *rope_full_tables(cos, sin, n_rot, x.shape[-1]), n_rot)


def rope_full_tables(cos: torch.Tensor, sin: torch.Tensor, n_rot: int,
                     head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The half-width cos/sin of :func:`rope_angles` as full-width factors for :func:`rope_rotate`:
    ``[c, c, 1...]`` and ``[-s, s, 0...]`` (the ones and zeros over the ``head_dim - n_rot`` unrotated dims).

    Built once per step and rotary table, shared by every layer that uses it (:meth:`FastModel.attention_block`).
    [N, n_rot/2] x2 -> [N, 1, head_dim] x2, float32.
    """
    rest = head_dim - n_rot
    c = torch.cat([cos, cos, cos.new_ones(cos.shape[0], rest)], -1)
    s = torch.cat([-sin, sin, sin.new_zeros(sin.shape[0], rest)], -1)
    return c[:, None, :], s[:, None, :]


def rope_rotate(x: torch.Tensor, cos_full: torch.Tensor, sin_full: torch.Tensor, n_rot: int) -> torch.Tensor:
    """NeoX RoPE as ``x * cos_full + rotate_half(x) * sin_full`` (tables from :func:`rope_full_tables`), in float32.

    Four passes instead of seven; each output element is rounded exactly as in ``x1 c - x2 s`` /
    ``x2 c + x1 s`` (``a + b (-s)`` is ``a - b s`` bit for bit), and an unrotated dim is ``x * 1 + x * 0 = x``.
    [N, H, D], [N, 1, D] x2 -> [N, H, D]. Source: transformers ``apply_rotary_pos_emb`` (``rotate_half``).
    """
    half = n_rot // 2
    xf = x.float()
    rot = torch.cat([xf[..., half:n_rot], xf[..., :half], xf[..., n_rot:]], dim=-1)  # [x2, x1, rest]
    out = xf * cos_full
    out.add_(rot.mul_(sin_full))
    return out.to(x.dtype)


ATTENTION_BLOCK = 512
"""Queries per block in :func:`attention` (the mask and scores of a block are ``[H, block, keys in reach]``)."""


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None,
                   q_block: torch.Tensor | None = None, k_block: torch.Tensor | None = None) -> torch.Tensor:
    """Which keys each query sees: ``(pos_j <= pos_i or same block) and pos_i - pos_j < window``.

    [T], [S], window, [T], [S] -> bool [T, S]. Source: reference ``attention_mask``.
    """
    dist = q_pos[:, None] - k_pos[None, :]
    allowed = dist >= 0
    if q_block is not None:
        allowed |= (q_block[:, None] == k_block[None, :]) & (q_block[:, None] >= 0)
    if window is not None:
        allowed &= dist < window
    return allowed


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
              window: int | None, scale: float, q_block: torch.Tensor | None = None,
              k_block: torch.Tensor | None = None, masks: dict | None = None) -> torch.Tensor:
    """GQA under :func:`attention_mask`, in bounded memory.

    Queries go in blocks of :data:`ATTENTION_BLOCK`, each reading only the keys it can see (a sliding
    layer: its window; with image blocks, up to the end of its queries' blocks), so a long prompt never
    builds the ``[H, T, S]`` score matrix. Each block is :func:`attend_block`. The keys in reach are a
    slice of K/V (no copy) when they are consecutive, as the caches hand them.
    ``masks``: a dict shared by the layers of one step and sequence (:attr:`StepBatch.masks`); a block's key range
    and mask are then built by the first layer and reused by every later one whose window, query positions and
    key positions are the same (compared, never assumed). Without image blocks only.
    [T, H, D], [S, Hkv, D], [S, Hkv, D], [T], [S], window, scale, [T], [S] -> [T, H*D].
    Source: reference ``attention``; transformers ``eager_attention_forward``.
    """
    T, H, D = q.shape
    group = H // k.shape[1]
    outs = []
    for lo in range(0, T, ATTENTION_BLOCK):
        qp = q_pos[lo:lo + ATTENTION_BLOCK]
        qb = None if q_block is None else q_block[lo:lo + ATTENTION_BLOCK]
        memo = masks.get((window, lo)) if masks is not None and qb is None else None
        if memo is not None and torch.equal(memo[0], qp) and torch.equal(memo[1], k_pos):
            reach, allowed = memo[2], memo[3]
        else:
            reach = _reach(qp, k_pos, window, qb, k_block)
            allowed = attention_mask(qp, k_pos[reach], window, qb, None if qb is None else k_block[reach])
            if masks is not None and qb is None:
                masks[(window, lo)] = (qp, k_pos, reach, allowed)
        outs.append(attend_block(q[lo:lo + ATTENTION_BLOCK], k[reach], v[reach], allowed, scale, group))
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 0)).reshape(T, H * D)


def _reach(qp: torch.Tensor, k_pos: torch.Tensor, window: int | None, qb: torch.Tensor | None,
           k_block: torch.Tensor | None) -> torch.Tensor | slice:
    """The keys a block of queries can see: up to its last query (or the end of its image blocks), and within
    the window of its first one. A slice when they are consecutive (then K/V are read in place), else a bool
    mask. [t], [S], window, [t], [S] -> slice or bool [S]."""
    last = qp.max()
    if qb is not None and bool((qb >= 0).any()):
        last = torch.maximum(last, k_pos[torch.isin(k_block, qb[qb >= 0])].max())  # later keys of the blocks
    reach = k_pos <= last
    if window is not None:
        reach &= k_pos > qp.min() - window
    idx = torch.nonzero(reach).flatten()
    if idx.numel():
        first, end = int(idx[0]), int(idx[-1]) + 1
        if end - first == idx.numel():
            return slice(first, end)
    return reach


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
                 group: int) -> torch.Tensor:
    """``softmax(q k^T * scale, masked by allowed) v`` for one query block, each KV head serving its
    ``group`` query heads without a copy of K or V.

    The query heads of one KV head are stacked into one matrix product (``[Hkv, group*t, D] @ [Hkv, D, S]``);
    the softmax runs in float32 for 16-bit inputs. Written out rather than through
    ``scaled_dot_product_attention``: on the CPU, with a boolean mask, torch takes its math path, which
    repeats K/V per query head and adds a pass over the scores for rows with no visible key (none exist
    here: every query sees itself), and was 1.2-6x slower at these head sizes (measured with ``g4h bench``).
    [t, H, D], [S, Hkv, D], [S, Hkv, D], bool [t, S], scale, group -> [t, H, D].
    Source: transformers ``eager_attention_forward`` (same formula).
    """
    t, H, D = q.shape
    S, Hkv, _ = k.shape
    qg = q.reshape(t, Hkv, group, D).permute(1, 2, 0, 3).reshape(Hkv, group * t, D)
    scores = torch.matmul(qg, k.permute(1, 2, 0)).view(Hkv, group, t, S)  # [Hkv, group, t, S]
    if scores.dtype in (torch.bfloat16, torch.float16):
        scores = scores.float()
    if scale != 1.0:  # Gemma 4 attends with scale 1: no pass over the scores then
        scores.mul_(scale)
    scores.masked_fill_(~allowed, float("-inf"))  # in place: the scores are this function's own tensor
    p = torch.softmax(scores, dim=-1).to(v.dtype).view(Hkv, group * t, S)
    out = torch.matmul(p, v.transpose(0, 1))  # [Hkv, group*t, D]
    return out.view(Hkv, group, t, D).permute(2, 0, 1, 3).reshape(t, H, D)


def gelu_ffn(x: torch.Tensor, w_gate, w_up, w_down) -> torch.Tensor:
    """``down(gelu_tanh(gate x) * up x)``. [N, h] -> [N, h]. Source: transformers ``Gemma4TextMLP``.

    The product goes into the GELU's own output (no third ``[N, F]`` buffer).
    """
    return linear(gelu_tanh(linear(x, w_gate)).mul_(linear(x, w_up)), w_down)


def moe_route(x: torch.Tensor, w_router, router_scale: torch.Tensor, per_expert_scale: torch.Tensor, k: int,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts and weights. [N, h] -> ([N, K] int64, [N, K] float32). Source: transformers ``Gemma4TextRouter``."""
    h = x.shape[-1]
    z = rms_norm(x, None, eps).float() * router_scale * h**-0.5
    probs = torch.softmax(linear(z.to(x.dtype), w_router).float(), dim=-1)
    top, idx = torch.topk(probs, k, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    return idx, top * per_expert_scale[idx]


def expert_ffn(x: torch.Tensor, w_gate_up, w_down) -> torch.Tensor:
    """One expert's gated-GELU MLP: ``down(gelu(g) * u)`` with ``[g; u] = gate_up x`` (gate first).

    [N, h], [2F, h], [h, F] -> [N, h] (the reference twin takes one token, ``[h]``).
    Source: transformers ``Gemma4TextExperts``.
    """
    Fdim = w_down.shape[1]
    gu = linear(x, w_gate_up)
    return linear(gelu_tanh(gu[:, :Fdim]) * gu[:, Fdim:], w_down)


def moe_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, idx: torch.Tensor,
                weights: torch.Tensor, rows: int = 16) -> torch.Tensor:
    """Weighted sum of the chosen experts (:func:`expert_ffn`). [N, h], [E, 2F, h], [E, h, F], [N, K] x2 -> [N, h].

    Each expert runs on its tokens in blocks of exactly ``rows`` rows (the last
    one padded with zeros), so every matmul has the same shape whatever number
    of *other* tokens chose the expert: a token's result is then independent of
    its neighbours in the batch (``docs/design.md``: neighbour isolation), with any GEMM
    kernel. Source: transformers ``Gemma4TextExperts`` (gate first in gate_up).
    """
    out = torch.zeros_like(x, dtype=torch.float32)
    for e in torch.unique(idx).tolist():
        tok, slot = torch.nonzero(idx == e, as_tuple=True)
        for c in range(0, tok.numel(), rows):
            t, sl = tok[c:c + rows], slot[c:c + rows]
            n = t.numel()
            xe = x.new_zeros((rows, x.shape[1]))
            xe[:n] = x[t]
            y = expert_ffn(xe, w_gate_up[e], w_down[e])[:n]
            out.index_add_(0, t, y.float() * weights[t, sl, None])
    return out.to(x.dtype)


def moe_experts_static(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, idx: torch.Tensor,
                       weights: torch.Tensor) -> torch.Tensor:
    """:func:`fast.model.moe_experts` with shapes fixed by ``N``, ``K`` and ``E`` alone (no host reads).

    With ``2 N K < E`` (decode and small batches), each of the ``N K`` (token, expert) pairs gathers its
    expert's matrices (``w[idx]``: a copy, so the chosen experts are read twice) and they run as one batched
    product; else every expert runs on every token (all ``E`` experts read once) and the weights, 0 for
    experts not chosen, combine them. Dense expert tensors only (:class:`fast.weights.FastWeights`
    dequantizes 3-D stacks at load).
    [N, h], [E, 2F, h], [E, h, F], int64 [N, K], float32 [N, K] -> [N, h] in ``x.dtype``.
    Source: transformers ``Gemma4TextExperts`` (gate first in gate_up); :func:`fast.model.expert_ffn`.
    """
    N, K = idx.shape
    E, F2, h = w_gate_up.shape
    Fdim = F2 // 2
    if 2 * N * K < E:
        flat = idx.reshape(-1)
        xs = x.repeat_interleave(K, dim=0).to(w_gate_up.dtype)[:, :, None]  # [N*K, h, 1]
        gu = torch.bmm(w_gate_up[flat], xs)[:, :, 0].to(x.dtype)  # [N*K, 2F]
        act = (gelu_tanh(gu[:, :Fdim]) * gu[:, Fdim:]).to(w_down.dtype)[:, :, None]
        y = torch.bmm(w_down[flat], act)[:, :, 0].float().view(N, K, h)
        return (y * weights[:, :, None]).sum(1).to(x.dtype)
    mix = torch.zeros(N, E, dtype=torch.float32, device=x.device).scatter_(1, idx, weights.float())  # [N, E]
    out = torch.zeros(N, h, dtype=torch.float32, device=x.device)
    for e in range(E):
        out.add_(expert_ffn(x, w_gate_up[e], w_down[e]).float() * mix[:, e:e + 1])
    return out.to(x.dtype)


# --------------------------------------------------------------------------- the model


@dataclass
class SeqStep:
    """One sequence's part of a batched step: cache slot, token ids, first position, and the soft tokens
    and types of these T tokens (:meth:`reference.multimodal.Injection.part`; None: text only)."""

    slot: int
    ids: torch.Tensor  # [T] int64
    start: int  # position of ids[0]
    mm: Injection | None = None


@dataclass
class StepBatch:
    """The bookkeeping of one batched step, shared by every layer.

    Attributes:
        seqs: the sequences of the step.
        positions: [N] position of every new token.
        offsets: [len(seqs) + 1] where each sequence's rows start in the ``[N, ...]`` activations.
        cache: the paged KV cache.
        views: per KV-owning layer, per sequence, the ``(k, v, k_pos)`` it attended (a shared layer
            reads its donor's entry: no copy into the cache).
        blocks: per sequence, the bidirectional block ids ``[T]`` of its new tokens
            (:func:`fast.multimodal.vision_blocks`; sliding layers only), or None.
        rope: the step's full-width rotary factors (:func:`rope_full_tables`) per rotary table, built by the
            first layer that uses the table.
        masks: per sequence, the attention masks of its query blocks (the ``masks`` of :func:`attention`),
            shared by the layers of the step.
    """

    seqs: Sequence[SeqStep]
    positions: torch.Tensor
    offsets: np.ndarray
    cache: PagedKVCache
    views: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    blocks: list[torch.Tensor | None] = field(default_factory=list)
    rope: dict = field(default_factory=dict)
    masks: dict[int, dict] = field(default_factory=dict)

    def rows(self, i: int) -> slice:
        """The rows of sequence ``i`` in the step's activations."""
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))


def _no_trace(point: str, layer: int, t: torch.Tensor) -> None:
    """The default trace of a step: nothing is converted or recorded."""


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
        tables: dict[bytes, torch.Tensor] = {}  # layers with the same frequencies share one tensor (step_rope)
        self.inv_freq = {}
        for L in cfg.layers:
            inv = np.asarray(rope_inv_freq(L), dtype=np.float64)
            self.inv_freq[L.index] = tables.setdefault(inv.tobytes(), torch.tensor(inv, dtype=torch.float64))
        self._rope_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.static_shapes = False  # True inside a static-shape forward (fast.static_decode): MoE without host reads

    def new_cache(self, max_seqs: int, max_tokens: int, page_size: int = 16, ring_extra: int = 0,
                  bounded: bool = False) -> PagedKVCache:
        """A paged KV cache for up to ``max_seqs`` sequences of up to ``max_tokens`` tokens each; sliding rings keep
        ``ring_extra`` tokens beyond the window (for speculative rollback, :mod:`fast.kvcache`); ``bounded``: no
        sequence passes ``max_tokens``, so no ring is longer (:class:`fast.kvcache.PagedKVCache`)."""
        return PagedKVCache(self.cfg, max_seqs=max_seqs, max_tokens=max_tokens, page_size=page_size,
                            device=self.device, dtype=torch.float32, ring_extra=ring_extra, bounded=bounded)

    def rope_tables(self, layer: LayerSpec, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (:func:`rope_angles`) for ``positions`` of one layer, float32 ``[N, n_rot/2]``, from a
        per-layer table grown on demand."""
        need = int(positions.max().item()) + 1 if positions.numel() else 0
        cached = self._rope_cache.get(layer.index)
        if cached is None or cached[0].shape[0] < need:
            n = max(need, 256, 2 * (cached[0].shape[0] if cached else 0))
            cos, sin = rope_angles(torch.arange(n), self.inv_freq[layer.index])
            cached = (cos.to(self.device), sin.to(self.device))
            self._rope_cache[layer.index] = cached
        cos, sin = cached
        return cos[positions], sin[positions]

    # ------------------------------------------------------------------ the step

    def step(self, cache: PagedKVCache, seqs: Sequence[SeqStep], all_logits: bool = False,
             trace: TraceFn | None = None, rows: Sequence[int] | None = None,
             return_hidden: bool = False, layer_inputs: Mapping[int, Any] | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run the new tokens of several sequences through the model, appending to their caches.

        Args:
            cache: the paged cache holding each sequence's earlier tokens.
            seqs: one entry per sequence in the batch (any mix of prefill chunks and decode tokens).
            all_logits: logits of every new token, else only of each sequence's last one.
            trace: callback ``(point, layer, array)``; only for a single-sequence step.
            rows: the rows of the step's ``[N, ...]`` activations to take logits of (overrides ``all_logits``;
                speculative verification takes every row of a drafted sequence, the last of a prefill chunk).
            return_hidden: also return the post-final-norm hidden state (``result_norm``) of those rows, which a
                drafter reads.
            layer_inputs: ``{layer index: [N, h] array}`` (float32 values; NumPy or torch): the residual stream
                that enters those layers in place of the previous layer's output, the index ``n_layer`` the final
                norm's, and the PLE context projected from ``layer_inputs[0]`` where given: a *re-seeded* step, as
                :func:`reference.model.forward`'s ``layer_inputs`` (the per-layer gate of an emulated pair with the
                fast oracle, ``harness/parity/checks/reference_runs.py`` ``ReferenceRuns.reseeded``). One sequence,
                every row's logits.

        Without a trace, only the rows asked for (``rows``, or each sequence's last one) go through the KV-shared
        tail of the model (:meth:`_keep_rows`): the others are dead there.

        Returns:
            float32 logits ``[N, V]`` (all_logits), ``[len(rows), V]`` or ``[len(seqs), V]``; with
            ``return_hidden``, ``(logits, hidden [., h])``.

        Raises:
            ValueError: a trace asked for on a batch of several sequences; ``layer_inputs`` on such a batch, without
                ``all_logits``, or an array of another shape than ``[N, h]``.
            PromptError: a sequence's injection does not fit its tokens (see reference ``check_injection``).
        """
        if trace is not None and len(seqs) != 1:
            raise ValueError("tracing is for single-sequence steps")
        if layer_inputs is not None and (len(seqs) != 1 or not all_logits or rows is not None):
            raise ValueError("layer_inputs: a single-sequence step with all_logits")
        small = self.device.type == "cpu" and sum(int(s.ids.numel()) for s in seqs) <= cpu_kernels.MAX_ROWS
        with cpu_kernels.small_step_threads() if small else contextlib.nullcontext():
            return self._step(cache, seqs, all_logits, trace, rows, return_hidden, layer_inputs)

    def _reseed(self, given: Any, like: torch.Tensor, il: int) -> torch.Tensor:
        """A re-seeded stream (:meth:`step`'s ``layer_inputs``) as ``like``'s dtype and device, checked against its
        shape. Source: reference ``reseed``."""
        x = torch.as_tensor(np.asarray(given.cpu() if isinstance(given, torch.Tensor) else given, dtype=np.float32))
        if tuple(x.shape) != tuple(like.shape):
            raise ValueError(f"layer_inputs[{il}]: shape {list(x.shape)}, expected {list(like.shape)}")
        return x.to(device=like.device, dtype=like.dtype)

    def _step(self, cache, seqs, all_logits, trace, rows, return_hidden, layer_inputs=None):
        """:meth:`step`'s body (there, a decode-sized CPU step runs under :func:`fast.cpu_kernels.small_step_threads`)."""
        cfg, dev = self.cfg, self.device
        tr = _no_trace if trace is None else (lambda p, il, t: trace(p, il, t.detach().double().cpu().numpy()))
        ids = torch.cat([s.ids for s in seqs]).to(dev)
        lens = [int(s.ids.numel()) for s in seqs]
        positions = torch.cat([torch.arange(s.start, s.start + n, dtype=torch.long) for s, n in zip(seqs, lens)]).to(dev)
        batch = StepBatch(seqs, positions, np.cumsum([0] + lens), cache)
        mm = any(s.mm is not None for s in seqs)
        if mm:
            ids = self.placeholders_to_pad(batch, ids)
        x = self.embed(ids)  # [N, h] float32
        if mm:
            x = self.merge(batch, x)
        batch.blocks = [None if s.mm is None else self._blocks(s.mm) for s in seqs]
        tr("inp_scaled", -1, x)
        seeds = layer_inputs or {}
        ple = None
        if cfg.ple_dim:  # re-seeded: projected from the given embedding, as the reference's forward does
            ple = self.per_layer_inputs(ids, self._reseed(seeds[0], x, 0) if 0 in seeds else x)  # [N, L, P]
            tr("inp_per_layer", -1, ple)
        want = None if all_logits and rows is None else \
            np.asarray(list(rows) if rows is not None else batch.offsets[1:] - 1, dtype=np.int64)
        keep = None if want is None or trace is not None else np.unique(want)
        tail = self._tail_start()
        for layer in cfg.layers:
            if layer.index == tail and keep is not None and keep.shape[0] < x.shape[0]:
                x, ple, batch = self._keep_rows(batch, keep, x, ple)
                want = np.searchsorted(keep, want)
            if layer.index in seeds:
                x = self._reseed(seeds[layer.index], x, layer.index)
            x = self.decoder_layer(layer, x, batch, None if ple is None else ple[:, layer.index], tr)
        if cfg.n_layer in seeds:  # the stream that enters the final norm
            x = self._reseed(seeds[cfg.n_layer], x, cfg.n_layer)
        if want is not None and not np.array_equal(want, np.arange(x.shape[0])):
            x = x[torch.as_tensor(want, device=dev)]
        x = rms_norm(x, self.w["output_norm.weight"], cfg.rms_eps)
        tr("result_norm", -1, x)
        logits = self.lm_head(x)
        tr("result_output", -1, logits)
        return (logits, x) if return_hidden else logits

    def _tail_start(self) -> int | None:
        """First layer of the KV-shared tail (every layer from it on reads a donor's K/V and writes no cache), or
        None when the model has no such tail."""
        layers = self.cfg.layers
        i = len(layers)
        while i > 0 and not layers[i - 1].has_kv:
            i -= 1
        return layers[i].index if i < len(layers) else None

    def _keep_rows(self, batch: StepBatch, keep: np.ndarray, x: torch.Tensor, ple: torch.Tensor | None):
        """The step narrowed to the rows ``keep`` (sorted, unique) before the KV-shared tail.

        A tail layer writes no K/V, so a row whose logits and hidden state nobody asked for is dead from
        there on: only the kept rows go through the tail, as queries against the donors' K/V (``batch.views``,
        all of the step's keys). Sequences with no kept row drop out. Each kept row computes the same
        formula as before; only the GEMM shapes change (fewer rows), so its values may move by summation-order
        rounding, the same as batched vs solo. Source: transformers ``Gemma4TextModel`` (the
        ``logits_to_keep`` slice before ``first_kv_shared_layer_idx``).
        [N, h], [N, L, P] -> [n, h], [n, L, P] with n = len(keep).
        """
        idx = torch.as_tensor(keep, device=x.device)
        seqs, counts, views, blocks = [], [0], {il: [] for il in batch.views}, []
        for i, s in enumerate(batch.seqs):
            lo, hi = int(batch.offsets[i]), int(batch.offsets[i + 1])
            mine = keep[(keep >= lo) & (keep < hi)]
            if mine.shape[0] == 0:
                continue
            seqs.append(s)
            counts.append(mine.shape[0])
            for il, per_seq in batch.views.items():
                views[il].append(per_seq[i])
            b = batch.blocks[i] if batch.blocks else None
            blocks.append(None if b is None else b[torch.as_tensor(mine - lo, device=b.device)])
        kept = StepBatch(seqs, batch.positions[idx], np.cumsum(counts), batch.cache, views, blocks)
        return x[idx], None if ple is None else ple[idx], kept

    def placeholders_to_pad(self, batch: StepBatch, ids: torch.Tensor) -> torch.Tensor:
        """Each sequence's placeholders become the pad id (:func:`fast.multimodal.llm_input_ids`). [N] -> [N]."""
        parts = []
        for i, s in enumerate(batch.seqs):
            part = ids[batch.rows(i)]
            if s.mm is not None:
                check_injection(self.cfg, s.mm, part.shape[0])
                ph = torch.as_tensor(np.asarray(s.mm.placeholder), device=ids.device)
                part = llm_input_ids(part, ph, pad_id(self.cfg))
            parts.append(part)
        return torch.cat(parts)

    def merge(self, batch: StepBatch, x: torch.Tensor) -> torch.Tensor:
        """Each sequence's soft tokens replace its placeholder rows (:func:`fast.multimodal.merge_embeddings`).

        [N, h] -> [N, h]. Source: reference ``forward`` (the merge).
        """
        parts = []
        for i, s in enumerate(batch.seqs):
            part = x[batch.rows(i)]
            if s.mm is not None:
                ph = torch.as_tensor(np.asarray(s.mm.placeholder), device=x.device)
                part = merge_embeddings(part, ph, torch.as_tensor(s.mm.embeds))
            parts.append(part)
        return torch.cat(parts)

    def _blocks(self, inj: Injection) -> torch.Tensor | None:
        b = vision_blocks(self.cfg, inj)
        return None if b is None else b.to(self.device)

    def embed(self, ids: torch.Tensor, check: bool = True) -> torch.Tensor:
        """Scaled token embeddings ``E[ids] * sqrt(h)``, float32. [N] -> [N, h]. Source: reference ``embed``.

        ``check``: see :func:`embed_rows`."""
        return embed_rows(self.w["token_embd.weight"], ids, check) * math.sqrt(self.cfg.hidden_size)

    def ple_token(self, ids: torch.Tensor, check: bool = True) -> torch.Tensor:
        """PLE token part ``E_ple[ids] * sqrt(P)``. [N] -> [N, L, P]. Source: reference ``ple_token``."""
        N, L, P = ids.shape[0], self.cfg.n_layer, self.cfg.ple_dim
        return embed_rows(self.w["per_layer_token_embd.weight"], ids, check).reshape(N, L, P) * math.sqrt(P)

    def ple_context(self, x: torch.Tensor) -> torch.Tensor:
        """PLE context part ``rmsnorm(x @ W_proj.T / sqrt(h))``. [N, h] -> [N, L, P]. Source: reference ``ple_context``."""
        cfg = self.cfg
        N, L, P = x.shape[0], cfg.n_layer, cfg.ple_dim
        ctx = linear(x, self.w["per_layer_model_proj.weight"]).float() * cfg.hidden_size**-0.5
        return rms_norm(ctx.reshape(N, L, P), self.w["per_layer_proj_norm.weight"], cfg.rms_eps)

    def per_layer_inputs(self, ids: torch.Tensor, x: torch.Tensor, check: bool = True) -> torch.Tensor:
        """PLE for every layer, ``(context + token) / sqrt(2)``. [N], [N, h] -> [N, L, P].

        ``check``: see :func:`embed_rows`. Source: reference ``per_layer_inputs``.
        """
        return (self.ple_context(x) + self.ple_token(ids, check)) * 2.0**-0.5

    def decoder_layer(self, layer: LayerSpec, x: torch.Tensor, batch, ple: torch.Tensor | None,
                      tr=_no_trace, attention_block=None) -> torch.Tensor:
        """One layer over the ragged batch. [N, h] -> [N, h]. Source: reference ``decoder_layer``.

        ``attention_block``: ``(layer, normed x, batch) -> [N, h]`` in place of :meth:`attention_block` (the
        static-shape decoder's cache, :mod:`fast.static_decode`); ``batch`` is whatever it reads.
        """
        w, eps, il = self.w, self.cfg.rms_eps, layer.index
        b = f"blk.{il}."
        attend = self.attention_block if attention_block is None else attention_block
        attn = attend(layer, rms_norm(x, w[b + "attn_norm.weight"], eps), batch)
        a = x + rms_norm(attn, w[b + "post_attention_norm.weight"], eps)
        tr("attn_out", il, a)
        f = self.ffn_block(layer, a, tr)
        tr("ffn_out", il, f)
        y = a + rms_norm(f, w[b + "post_ffw_norm.weight"], eps)
        if ple is not None:
            p = self.ple_block(layer, y, ple)
            tr("per_layer_embd_out", il, p)
            y = y + p
        y = self.layer_scale(layer, y)
        tr("l_out", il, y)
        return y

    def attention_block(self, layer: LayerSpec, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """q/k/v for the whole batch, then per-sequence cached attention. [N, h] -> [N, h].

        A KV-owning layer writes its new K/V into the cache and records, per sequence, the keys it
        attended (``batch.views``) so that a shared layer reads exactly its donor's K/V without any copy
        into the cache. Source: reference ``attention_block``.
        """
        q, k, v = self.project_qkv(layer, x, *self.step_rope(layer, batch))
        if layer.has_kv:
            per_seq = []
            for i, s in enumerate(batch.seqs):
                rows = batch.rows(i)
                per_seq.append(batch.cache.attend_and_append(layer.index, s.slot, s.start, k[rows], v[rows],
                                                             derive_k=self._derive_k(layer)))
            batch.views[layer.index] = per_seq
        outs = []
        for i, (k_all, v_all, k_pos) in enumerate(batch.views[layer.kv_donor]):
            rows = batch.rows(i)
            args = (layer, q[rows], k_all, v_all, batch.positions[rows], k_pos)
            q_block = batch.blocks[i] if layer.is_sliding and batch.blocks else None
            masks = batch.masks.setdefault(i, {})
            outs.append(self.attend(*args, masks=masks) if q_block is None else
                        self.attend(*args, q_block, masks=masks))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, 0)
        return linear(out, self.w[f"blk.{layer.index}.attn_output.weight"])

    def project_qkv(self, layer: LayerSpec, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The new tokens' normed, rotated Q, and on a KV-owning layer their K and V (V normed where the model norms
        it; ``k_eq_v``: V is the K projection). [N, h], [N, 1, D] x2 -> ([N, H, D], [N, Hkv, D] | None,
        [N, Hkv, D] | None). Shared by the paged step and :mod:`fast.static_decode`.
        Source: reference ``attention_block`` (projections, q/k norms, RoPE)."""
        w, eps = self.w, self.cfg.rms_eps
        b = f"blk.{layer.index}."
        N = x.shape[0]
        H, Hkv, D = layer.n_head, layer.n_kv_head, layer.head_dim
        q = linear(x, w[b + "attn_q.weight"]).view(N, H, D)
        q = rope_rotate(rms_norm(q, w[b + "attn_q_norm.weight"], eps), cos, sin, layer.n_rot)
        if not layer.has_kv:
            return q, None, None
        k_raw = linear(x, w[b + "attn_k.weight"]).view(N, Hkv, D)
        v = linear(x, w[b + "attn_v.weight"]).view(N, Hkv, D) if layer.has_v_proj else k_raw
        if self.cfg.has_v_norm:
            v = rms_norm(v, None, eps)
        k = rope_rotate(rms_norm(k_raw, w[b + "attn_k_norm.weight"], eps), cos, sin, layer.n_rot)
        return q, k, v

    def step_rope(self, layer: LayerSpec, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The full-width rotary factors (:func:`rope_full_tables`) of ``layer`` at the step's positions,
        ``[N, 1, head_dim]`` x2, built once per step for the layers that share a rotary table (the same inverse
        frequencies object, :attr:`inv_freq`, and head size)."""
        key = (id(self.inv_freq[layer.index]), layer.n_rot, layer.head_dim)
        if key not in batch.rope:
            batch.rope[key] = rope_full_tables(*self.rope_tables(layer, batch.positions), layer.n_rot, layer.head_dim)
        return batch.rope[key]

    def attend(self, layer: LayerSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
               k_pos: torch.Tensor, q_block: torch.Tensor | None = None, masks: dict | None = None) -> torch.Tensor:
        """:func:`attention` with the layer's window (sliding layers) and the model's scale. [T, H, D] -> [T, H*D].

        ``q_block``: the new tokens' bidirectional block ids (sliding layers with vision attention); the
        cached keys before them are never in those blocks (a block is prefilled in one step), so they get -1.
        ``masks``: the sequence's masks of this step, shared by its layers (see :func:`attention`).
        """
        window = self.cfg.sliding_window if layer.is_sliding else None
        k_block = None
        if q_block is not None:
            k_block = torch.cat([q_block.new_full((k.shape[0] - q.shape[0],), -1), q_block])
        return attention(q, k, v, q_pos, k_pos, window, self.cfg.attn_scale, q_block, k_block, masks)

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

    def ffn_block(self, layer: LayerSpec, a: torch.Tensor, tr=_no_trace) -> torch.Tensor:
        """Dense FFN, plus on MoE layers :meth:`moe_block` beside it; before ``post_ffw_norm``. [N, h] -> [N, h].

        Source: reference ``ffn_block``.
        """
        w, eps, il = self.w, self.cfg.rms_eps, layer.index
        b = f"blk.{il}."
        xn = rms_norm(a, w[b + "ffn_norm.weight"], eps)
        f = gelu_ffn(xn, w[b + "ffn_gate.weight"], w[b + "ffn_up.weight"], w[b + "ffn_down.weight"])
        if not layer.has_moe:
            return f
        f = rms_norm(f, w[b + "post_ffw_norm_1.weight"], eps)
        moe = self.moe_block(layer, a)
        tr("ffn_mlp", il, f)
        tr("ffn_moe", il, moe)
        return f + moe

    def moe_block(self, layer: LayerSpec, a: torch.Tensor) -> torch.Tensor:
        """Route the residual ``a``, run the experts on its ``pre_ffw_norm_2`` norm, then ``post_ffw_norm_2``.

        [N, h] -> [N, h]. Source: reference ``moe_block``.
        """
        w, eps = self.w, self.cfg.rms_eps
        b = f"blk.{layer.index}."
        idx, wgt = self.moe_route(layer, a)
        xe = rms_norm(a, w[b + "pre_ffw_norm_2.weight"], eps)
        return rms_norm(self.moe_experts(layer, xe, idx, wgt), w[b + "post_ffw_norm_2.weight"], eps)

    def moe_route(self, layer: LayerSpec, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`moe_route` with the layer's router weights. [N, h] -> ([N, K], [N, K])."""
        w, b = self.w, f"blk.{layer.index}."
        return moe_route(x, w[b + "ffn_gate_inp.weight"], w[b + "ffn_gate_inp.scale"], w[b + "ffn_down_exps.scale"],
                         self.cfg.n_expert_used, self.cfg.rms_eps)

    def moe_experts(self, layer: LayerSpec, x: torch.Tensor, idx: torch.Tensor, wgt: torch.Tensor) -> torch.Tensor:
        """:func:`moe_experts` with the layer's expert weights (:func:`moe_experts_static` while
        :attr:`static_shapes` is set). [N, h] -> [N, h]."""
        w, b = self.w, f"blk.{layer.index}."
        dense = isinstance(w[b + "ffn_gate_up_exps.weight"], torch.Tensor)  # packed stacks: CPU, expert by expert
        run = moe_experts_static if self.static_shapes and dense else moe_experts
        return run(x, w[b + "ffn_gate_up_exps.weight"], w[b + "ffn_down_exps.weight"], idx, wgt)

    def ple_block(self, layer: LayerSpec, y: torch.Tensor, ple: torch.Tensor) -> torch.Tensor:
        """``post_norm(proj(gelu(gate y) * ple))``. [N, h], [N, P] -> [N, h]. Source: reference ``ple_block``."""
        w, b = self.w, f"blk.{layer.index}."
        g = gelu_tanh(linear(y, w[b + "inp_gate.weight"])).mul_(ple)
        return rms_norm(linear(g, w[b + "proj.weight"]), w[b + "post_norm.weight"], self.cfg.rms_eps)

    def layer_scale(self, layer: LayerSpec, y: torch.Tensor) -> torch.Tensor:
        """``y * layer_output_scale`` (absent: 1). [N, h] -> [N, h]. Source: reference ``layer_scale``."""
        name = f"blk.{layer.index}.layer_output_scale.weight"
        if self.cfg.has_layer_scalar and name in self.w:
            return y * self.w[name].to(y.dtype)
        return y

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``x @ head.T`` in float32, then the final softcap when set. [N, h] -> [N, V].

        Source: reference ``lm_head``.
        """
        cfg = self.cfg
        head = self.w["token_embd.weight"] if cfg.tie_word_embeddings else self.w["output.weight"]
        logits = linear(x, head).float()
        if cfg.final_logit_softcap is not None:
            logits = softcap(logits, cfg.final_logit_softcap)
        return logits

    # ------------------------------------------------------------------ conveniences

    def logits(self, ids: Sequence[int], chunk: int | None = None, trace: TraceFn | None = None,
               mm: Injection | None = None, layer_inputs: Mapping[int, Any] | None = None) -> torch.Tensor:
        """Logits of every position of one sequence (prefill in chunks of ``chunk``; None = one shot).

        ``mm``: the prompt's soft tokens and types (:class:`reference.multimodal.Injection`); a chunk
        never ends inside an image block (:func:`fast.multimodal.chunk_end`). ``layer_inputs``: a re-seeded
        forward (:meth:`step`), in one shot.
        Returns: float32 ``[T, V]``. Raises: PromptError (see reference ``check_prompt`` and
        ``check_injection``).
        """
        ids_np = np.asarray(ids, dtype=np.int64).reshape(-1)
        if mm is not None:
            check_injection(self.cfg, mm, ids_np.shape[0])
        check_prompt(self.cfg, ids_np if mm is None else np.where(mm.placeholder, pad_id(self.cfg), ids_np))
        T = ids_np.shape[0]
        cache = self.new_cache(1, T, bounded=True)
        slot = cache.alloc()
        chunk = T if layer_inputs is not None else chunk or T
        out = []
        with torch.inference_mode():
            start = 0
            while start < T:
                end = chunk_end(self.cfg, mm, start, chunk, T)
                part = torch.from_numpy(ids_np[start:end])
                out.append(self.step(cache, [SeqStep(slot, part, start, None if mm is None else mm.part(start, end))],
                                     all_logits=True, trace=trace if end - start >= T else None,
                                     layer_inputs=layer_inputs))
                start = end
        return torch.cat(out, 0)
