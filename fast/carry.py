"""Which weights a compute dtype cannot carry: a load-time estimate, per tensor role, in float64.

The weight check (:mod:`reference.weight_check`) refuses NaN, Inf and magnitudes no matmul could hold. A weight
below those limits can still make the fast engine's numbers overflow *downstream*: a norm weight of 1e19 in
``ffn_norm`` is carried by float32 itself, but the gated FFN multiplies two projections of it (``gelu(gate) * up``
grows as its square) and the next RMSNorm squares the result again; a ``layer_output_scale`` of 3000 multiplies the
residual stream at every layer; in float16 a matmul's input and output must stay below 65504. This module follows
the magnitudes through one forward, op by op, as :mod:`fast.model` computes it, and names the first op each
weight pushes past what its dtype holds.

The magnitudes are *typical*, not worst-case: every normalized activation element is taken as :data:`PEAK` (an
RMSNorm output has RMS 1; over a prompt's tokens an element's largest magnitude is about 2), and a matmul output
element as the root mean square it has over random signs of its input,
``sqrt(sum_i W_ji^2 a_i^2)`` (first bounded by ``max|W| * ||a||``, from the weight check's magnitudes; only where
that bound passes a limit is the matrix read and the exact figure computed). So a warning means "this overflows
for ordinary inputs", and a weight that only an unusual input would push over is not named. Residual additions
add up (the large dimensions of real models line up, layer after layer).

Limits, per op (fast computes activations in float32; 16-bit weights multiply a 16-bit copy of their input, and
the product comes back in 16 bits: :func:`fast.model.linear`; packed quantized matrices compute in float32):

==============================  ==========================================================================
value                           must stay below
==============================  ==========================================================================
a matmul's input and output     the largest value of the matrix's held dtype (65504 for float16, 3.39e38 for
                                bfloat16, 3.40e38 for float32)
an RMSNorm's input, squared     float32's 3.40e38, so the input below 1.84e19 (``F.rms_norm`` in float32)
gelu(gate) * up, attention      float32's 3.40e38
scores, the residual stream
==============================  ==========================================================================

Roles: the input norms (``attn_norm``, ``ffn_norm``, ``pre_ffw_norm_2``, ``output_norm``) set the size of a
matmul's input; the projections (``attn_q/k/v``, ``attn_output``, ``ffn_gate/up/down``, the experts, the PLE
gate and projection, the head) scale it; ``attn_q_norm``/``attn_k_norm`` set the attention scores; the post-norms
(``post_attention_norm``, ``post_ffw_norm*``, ``post_norm``) and ``layer_output_scale`` set the residual stream,
which the next layer's RMSNorm squares and the PLE gate takes as a matmul input.

Sources: :mod:`fast.model` (``decoder_layer``, ``project_qkv``, ``ffn_block``, ``moe_block``, ``ple_block``,
``layer_scale``, ``lm_head``, ``linear``, ``rms_norm``); transformers ``Gemma4TextDecoderLayer`` (the same order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

F32_MAX = float(np.finfo(np.float32).max)
"""The largest float32 (3.4028e38): activations, RMSNorm sums, softmax inputs."""

HELD_MAX = {"float32": F32_MAX, "bfloat16": 3.3895313892515355e38, "float16": 65504.0}
"""The largest finite value of each dtype a matrix may be held in."""

PEAK = 2.0
"""The largest |element| an RMS-normalized activation (RMS 1) reaches over the tokens of a short prompt, for the
estimates: a Gaussian's expected largest magnitude over 8 to 16 draws is 1.4 to 1.8 (rounded up). Every normalized
input the estimates start from is this times its norm weight; a product of two is this squared."""

SQUARE_MAX = math.sqrt(F32_MAX)
"""An RMSNorm's input must stay below this (1.84e19): its square is summed in float32."""


@dataclass(frozen=True)
class CarryProblem:
    """A weight whose magnitude the compute dtype cannot carry through one op.

    Attributes:
        tensor: the weight at fault (the one that set the magnitude), as the file names it.
        op: where the magnitude passes the limit (``the input of blk.0.attn_q.weight``, ``blk.3 gelu(gate) * up``).
        estimate: the typical magnitude there (float64).
        limit: what that op holds in this dtype.
        dtype: the compute dtype.
    """

    tensor: str
    op: str
    estimate: float
    limit: float
    dtype: str

    def line(self, source: str) -> str:
        """One line: ``<file>: tensor <t>: <dtype> cannot carry it: <op> reaches about <x>, above <limit>``."""
        return (f"{source}: tensor {self.tensor}: {self.dtype} cannot carry it: {self.op} reaches about "
                f"{self.estimate:.3g}, above {self.limit:.6g}; expect wrong or non-finite output in {self.dtype}")


class _Model:
    """The weights' magnitudes, read as needed: 1-D tensors whole (small), matrices as their bound (``bounds``) and,
    when asked, exactly (``W.row_blocks``)."""

    def __init__(self, W, bounds: dict[str, float], held: Callable[[str], str]) -> None:
        self.W, self.bounds, self.held = W, bounds, held
        self._vec: dict[str, np.ndarray] = {}

    def has(self, name: str) -> bool:
        return name in self.W

    def vec(self, name: str) -> np.ndarray:
        """|w| of a 1-D tensor as float64."""
        if name not in self._vec:
            self._vec[name] = np.abs(np.asarray(self.W.raw(name), dtype=np.float64)).reshape(-1)
        return self._vec[name]

    def limit(self, name: str) -> float:
        return HELD_MAX.get(self.held(name), F32_MAX)

    def matvec(self, name: str, a: np.ndarray, exact: bool) -> np.ndarray:
        """Typical |W a| per output (``sqrt(W^2 @ a^2)``); ``exact`` False: the bound ``max|W| * ||a||`` for all.

        ``a``: [in] magnitudes; a 3-D expert stack gives [E, out]."""
        shape = tuple(self.W.shape(name))
        a2 = np.asarray(a, dtype=np.float64) ** 2
        if not exact or len(shape) != 2:
            bound = self.bounds.get(name, math.inf) * math.sqrt(float(a2.sum()))
            return np.full(shape[:-1], bound)
        out = [np.sqrt(np.square(block) @ a2) for block in self.W.row_blocks(name)]
        return np.concatenate(out) if out else np.zeros(0)


def carry_problems(cfg, W, bounds: dict[str, float], dtype: str, held: Callable[[str], str]) -> list[CarryProblem]:
    """The weights ``dtype`` cannot carry (see the module docstring), first op per tensor, in forward order.

    Args:
        cfg: :class:`reference.config.ModelConfig`.
        W: the loader's weights (:class:`reference.weights.Weights`): ``raw`` for 1-D tensors, ``row_blocks`` for
            the exact figure of a matrix.
        bounds: the largest ``|w|`` of each tensor (:func:`reference.weight_check.check_weights`' result).
        dtype: the compute dtype (``float32``, ``bfloat16``, ``float16``).
        held: tensor name -> the dtype its matmul runs in (``float16`` for a dense matrix held in float16,
            ``float32`` for a packed quantized one or in float32).

    Returns:
        one :class:`CarryProblem` per tensor at fault (empty when every magnitude stays within its limits).
    """
    m = _Model(W, bounds, held)
    found: dict[str, CarryProblem] = {}
    n = cfg.hidden_size
    r = bounds.get("token_embd.weight", 0.0) * math.sqrt(n)  # the scaled embedding: E[ids] * sqrt(h)
    r_src = ("token_embd.weight", r)  # the tensor behind the residual's size, and its factor
    for layer in cfg.layers:
        problems, r_new, src = _layer(m, cfg, layer, r, r_src, dtype, exact=False)
        if problems:  # the bounds pass a limit: the exact figures, from the matrices themselves
            problems, r_new, src = _layer(m, cfg, layer, r, r_src, dtype, exact=True)
        for p in problems:
            found.setdefault(p.tensor, p)
        r, r_src = r_new, src
    head = _head(m, cfg, r, r_src, dtype, exact=False)
    if head:
        head = _head(m, cfg, r, r_src, dtype, exact=True)
    for p in head:
        found.setdefault(p.tensor, p)
    return list(found.values())


class _Checks:
    def __init__(self, dtype: str) -> None:
        self.dtype, self.out = dtype, []

    def __call__(self, value: float, limit: float, tensor: str, op: str) -> None:
        if not value <= limit:
            self.out.append(CarryProblem(tensor, op, float(value), float(limit), self.dtype))


def _matmul(m: _Model, c: _Checks, name: str, a: np.ndarray, a_src: str, exact: bool) -> np.ndarray:
    """``name @ a``'s typical magnitudes, with its input and output checked against the matrix's held dtype."""
    lim = m.limit(name)
    c(float(a.max(initial=0.0)), lim, a_src, f"the input of {name}")
    y = m.matvec(name, a, exact)
    # who is at fault: a unit-RMS input is O(1) and a trained matrix's max|W| * sqrt(in) is O(1) too; the one
    # further from that set the magnitude
    in_factor = float(a.max(initial=0.0))
    w_factor = m.bounds.get(name, 0.0) * math.sqrt(a.size)
    c(float(y.max(initial=0.0)), lim, a_src if in_factor >= w_factor else name, f"the output of {name}")
    return y


def _norm_input(c: _Checks, y: np.ndarray, src: str, op: str) -> None:
    """An RMSNorm squares its input and sums: the sum of squares within float32."""
    c(float(np.sqrt(np.sum(np.square(y)))), SQUARE_MAX, src, f"the sum of squares of {op}")


def _layer(m: _Model, cfg, layer, r: float, src: tuple[str, float], dtype: str, exact: bool):
    """One layer: its problems, the residual magnitude after it and the tensor that set it (with its factor: the
    largest addition or multiplication the residual has had)."""
    r_src = src[0]
    c = _Checks(dtype)
    b = f"blk.{layer.index}."
    c(r, SQUARE_MAX, r_src, f"the residual stream into layer {layer.index} (squared by {b}attn_norm)")
    # attention: attn_norm -> q/k/v -> q_norm/k_norm/v_norm -> scores -> attn_output -> post_attention_norm
    a = PEAK * m.vec(b + "attn_norm.weight")
    for proj, norm in (("attn_q", "attn_q_norm"), ("attn_k", "attn_k_norm"), ("attn_v", None)):
        if not m.has(b + proj + ".weight"):
            continue
        y = _matmul(m, c, b + proj + ".weight", a, b + "attn_norm.weight", exact)
        heads = y.reshape(-1, layer.head_dim) if y.size % layer.head_dim == 0 else y.reshape(1, -1)
        for h in heads[:1] if not exact else heads:
            _norm_input(c, h, b + "attn_norm.weight", f"{b}{proj} (its head norm)")
    if m.has(b + "attn_q_norm.weight") and m.has(b + "attn_k_norm.weight"):
        qn, kn = m.vec(b + "attn_q_norm.weight"), m.vec(b + "attn_k_norm.weight")
        score = abs(cfg.attn_scale) * float(np.sqrt(np.sum(np.square(qn * kn))))
        c(score, F32_MAX, b + "attn_q_norm.weight", f"the attention scores of layer {layer.index}")
    o = np.full(layer.n_head * layer.head_dim, PEAK)  # softmax-weighted mean of unit-RMS values (v_norm)
    y = _matmul(m, c, b + "attn_output.weight", o, b + "attn_output.weight", exact)
    _norm_input(c, y, b + "attn_output.weight", f"{b}post_attention_norm")
    r, src = _add(r, src, m, b + "post_attention_norm.weight")
    r_src = src[0]
    c(r, SQUARE_MAX, r_src, f"the residual stream in layer {layer.index} (squared by {b}ffn_norm)")
    # dense FFN: ffn_norm -> gate, up -> gelu(gate) * up -> down -> post_ffw_norm(_1)
    a = PEAK * m.vec(b + "ffn_norm.weight")
    g = _matmul(m, c, b + "ffn_gate.weight", a, b + "ffn_norm.weight", exact)
    u = _matmul(m, c, b + "ffn_up.weight", a, b + "ffn_norm.weight", exact)
    p = g * u
    c(float(p.max(initial=0.0)), F32_MAX, b + "ffn_norm.weight", f"{b[:-1]} gelu(gate) * up")
    f = _matmul(m, c, b + "ffn_down.weight", p, b + "ffn_norm.weight", exact)
    _norm_input(c, f, b + "ffn_norm.weight", f"{b}post_ffw_norm" + ("_1" if layer.has_moe else ""))
    if layer.has_moe:
        _moe(m, c, b, exact)
        r, src = _add(r, src, m, b + "post_ffw_norm_1.weight")
        r, src = _add(r, src, m, b + "post_ffw_norm_2.weight")
    r, src = _add(r, src, m, b + "post_ffw_norm.weight")
    r_src = src[0]
    if m.has(b + "inp_gate.weight"):  # PLE: the residual itself is the gate's input (one element r, the rest 1)
        a = np.ones(cfg.hidden_size)
        a[0] = max(r, 1.0)
        g = _matmul(m, c, b + "inp_gate.weight", a, r_src, False)
        ple = max(m.bounds.get("per_layer_token_embd.weight", 0.0) * math.sqrt(cfg.ple_dim),
                  float(m.vec("per_layer_proj_norm.weight").max(initial=0.0)) if m.has("per_layer_proj_norm.weight")
                  else 0.0)
        g_src = r_src if r >= m.bounds.get(b + "inp_gate.weight", 0.0) * math.sqrt(cfg.hidden_size) else \
            b + "inp_gate.weight"  # the larger factor of the gate's output: the residual, or the gate matrix
        y = _matmul(m, c, b + "proj.weight", g * ple, g_src, exact)
        _norm_input(c, y, b + "proj.weight", f"{b}post_norm")
        r, src = _add(r, src, m, b + "post_norm.weight")
    if m.has(b + "layer_output_scale.weight"):
        s = float(m.vec(b + "layer_output_scale.weight").max(initial=0.0))
        if s > src[1]:
            src = (b + "layer_output_scale.weight", s)
        r *= s
    c(r, F32_MAX, src[0], f"the residual stream after layer {layer.index}")
    return c.out, r, src


def _moe(m: _Model, c: _Checks, b: str, exact: bool) -> None:
    """The experts branch: pre_ffw_norm_2 -> gate_up (per expert) -> gelu(gate) * up -> down x per_expert_scale ->
    post_ffw_norm_2. A stack's magnitude is its bound (3-D: not read again)."""
    a = PEAK * m.vec(b + "pre_ffw_norm_2.weight")
    gu = _matmul(m, c, b + "ffn_gate_up_exps.weight", a, b + "pre_ffw_norm_2.weight", exact)
    half = gu.shape[-1] // 2
    p = gu[..., :half] * gu[..., half:]
    c(float(p.max(initial=0.0)), F32_MAX, b + "pre_ffw_norm_2.weight", f"{b[:-1]} experts' gelu(gate) * up")
    f = _matmul(m, c, b + "ffn_down_exps.weight", p.reshape(-1, half)[0], b + "pre_ffw_norm_2.weight", exact)
    scale = float(m.vec(b + "ffn_down_exps.scale").max(initial=1.0)) if m.has(b + "ffn_down_exps.scale") else 1.0
    _norm_input(c, f * scale, b + "ffn_down_exps.weight", f"{b}post_ffw_norm_2")


def _add(r: float, src: tuple[str, float], m: _Model, norm: str) -> tuple[float, tuple[str, float]]:
    """The residual after adding a post-norm's output (its largest |w| times a unit element)."""
    if not m.has(norm):
        return r, src
    w = PEAK * float(m.vec(norm).max(initial=0.0))
    return r + w, (norm, w) if w > src[1] else src


def _head(m: _Model, cfg, r: float, src: tuple[str, float], dtype: str, exact: bool) -> list[CarryProblem]:
    c = _Checks(dtype)
    c(r, SQUARE_MAX, src[0], "the residual stream into output_norm")
    head = "token_embd.weight" if cfg.tie_word_embeddings or not m.has("output.weight") else "output.weight"
    a = PEAK * m.vec("output_norm.weight")
    y = _matmul(m, c, head, a, "output_norm.weight", exact)
    if cfg.final_logit_softcap is None:
        c(float(y.max(initial=0.0)), F32_MAX, "output_norm.weight", "the logits")
    return c.out
