"""The fast engine's ``--compute q8``: llama.cpp's CPU arithmetic for the products with quantized and 16-bit
weights, opt-in (exact fp32 stays the default).

What changes, inside :func:`q8_compute` (docs/quantized-activations.md, "The fast engine's --compute q8"):

* :func:`linear` replaces :func:`fast.model.linear`. A product with a weight of GGML type ``t`` takes its input as
  llama.cpp's CPU backend does, rounded to ``t``'s dot-product type (:data:`reference.activation_quants.VEC_DOT_TYPE`).
  For packed Q8_0, Q4_0, Q5_0 and K-quant (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) weights
  (:data:`fast.quant_kernels.Q8_TYPES`) on the CPU the product is llama.cpp's own arithmetic in C
  (:func:`fast.quant_kernels.q8_linear`, ``fast/csrc/linear_q8.c``): int8 activations (Q8_0 blocks of 32; Q8_K
  blocks of 256 with their int16 sums of 16 for the K-quants), exact integer sums per block or sub-block, the scales
  in fp32, fp32 sums (for the K-quants in the order of ggml's generic ``ggml_vec_dot_q2_K_q8_K`` ...
  ``ggml_vec_dot_q6_K_q8_K``, bit for bit); AVX-512 VNNI or AVX2 where present, the same bits as plain C. For the
  other types (Q4_1/Q5_1, F16, BF16, matrices loaded dense, and
  every type off the CPU) the input is rounded by :func:`fast.activation_quants.round_activations` (the same
  rounding, bit for bit) and multiplied by the exact weights in fp32 (the packed or dense path of
  :func:`fast.model.linear`), plus for Q4_1/Q5_1 the fp16 rounding of the Q8_1 block sums
  (:func:`fast.activation_quants.q8_1_sum_correction`): the same numbers up to fp32 accumulation, not the speed.
  F32 weights are untouched.
* :func:`rms_norm` replaces :func:`fast.model.rms_norm`: llama.cpp's float32 steps (the int8 rounding of the
  product after a norm depends on its last bits), the same as the emulating reference's
  :func:`harness.engines.llamacpp.numerics.rms_norm_fp32`.

So the engine computes what llama.cpp computes, and the harness judges it against the reference that emulates the
rounding (it declares ``quantized_activations`` with llama.cpp's dot-product types, as the ``llamacpp`` engine
does): three implementations of one rounding (llama.cpp, the float64 reference, this one).

Dense weights carry no GGML type once loaded as float32 tensors: :func:`q8_compute` takes the types of the model's
dense matrices (:func:`dense_types`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np
import torch

from gemma4_harness.reference.activation_quants import VEC_DOT_TYPE, block_minima

from . import activation_quants as fq
from . import model as fm
from . import quant_kernels

COMPUTE_MODES = ("exact", "q8")
"""``--compute``: ``exact`` (fp32 products of the exact weights, the default) or ``q8`` (llama.cpp's arithmetic)."""

_exact_linear, _exact_rms_norm = fm.linear, fm.rms_norm
_dense: dict[Any, tuple] = {}  # id of a dense weight tensor -> (GGML type, minima), inside q8_compute
_minima: dict[int, torch.Tensor] = {}  # id of a Q4_1/Q5_1 QuantizedTensor's bytes -> its block minima


def dense_types(model: "fm.FastModel", W) -> dict[Any, tuple]:
    """The model's dense (unpacked) matrices stored in the file in another type than F32 (F16, BF16, and with
    ``--weights dequantized`` the quantized ones), as ``{id(tensor): (GGML type, block minima or None)}``: their
    products round the input to that type's dot-product type under :func:`q8_compute`; the minima (float64 ``[N,
    K/32]``, from the stored blocks) of a Q4_1 / Q5_1 matrix give its Q8_1 block-sum term; a 3-D expert stack is
    also held as ``{("stack", its storage's address): (type, minima, its storage offset)}``. ``W``: the loader's
    weights (a shape-only model's carry no types: empty). A view made later (one expert of a dense 3-D stack,
    ``--weights dequantized`` on a MoE) is another tensor: :func:`linear` finds its stack by the storage it views."""
    out: dict[Any, tuple] = {}
    if W is None or not hasattr(W, "raw_dtype") or not hasattr(W, "stored"):
        return out
    for name, t in model.w.t.items():
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and W.stored(name) is not None:
            typ = W.raw_dtype(name)
            if typ in VEC_DOT_TYPE and typ != "F32":
                mins = None
                if VEC_DOT_TYPE[typ] == "Q8_1":
                    stored = np.asarray(W.stored(name)).view(np.uint8)
                    mins = torch.from_numpy(block_minima(stored.reshape(-1, stored.shape[-1]), typ))
                out[id(t)] = (typ, mins)
                if t.dim() == 3:  # an expert stack: its experts are views made at call time, found by storage
                    out[("stack", t.untyped_storage().data_ptr())] = (typ, mins, t.storage_offset())
    return out


def _q8_1_minima(w) -> torch.Tensor:
    """The fp16 block minima of a Q4_1/Q5_1 packed weight, float64 ``[N, K/32]``, read once from its bytes."""
    key = id(w.raw)
    if key not in _minima:
        _minima[key] = torch.from_numpy(block_minima(w.raw.cpu().numpy(), w.type_name))
    return _minima[key]


def _rounded_product(x: torch.Tensor, w, typ: str, mins) -> torch.Tensor:
    """The rounded input times the exact weights in fp32, plus the Q8_1 block-sum term for Q4_1/Q5_1."""
    y = _exact_linear(fq.round_activations(x, typ).to(x.dtype), w)
    if VEC_DOT_TYPE[typ] == "Q8_1":
        y = (y.double() + fq.q8_1_sum_correction(x, mins() if callable(mins) else mins)).to(y.dtype)
    return y


def _expert_of(w: torch.Tensor, typ: str, mins, offset: int) -> tuple[str, torch.Tensor | None]:
    """The GGML type and block minima of ``w``, a view of whole rows of a dense stack (one expert ``stack[e]`` of
    ``[E, N, K]``, made at call time by :func:`fast.model.moe_experts`) whose type, minima (``[E*N, K/32]``) and
    storage offset (elements) are :func:`dense_types`'s: the minima of the view's rows."""
    if mins is None:
        return typ, None
    first = (w.storage_offset() - offset) // w.shape[-1]
    return typ, mins[first:first + w.numel() // w.shape[-1]]


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """``x @ w.T`` as llama.cpp's CPU backend computes it (the module docstring). [N, in] -> [N, out], float32.

    Source: ``ggml_compute_forward_mul_mat`` (``ggml/src/ggml-cpu/ggml-cpu.c``: ``from_float`` of the weight type's
    ``vec_dot_type``, then ``vec_dot``); the rounding as :func:`reference.activation_quants.round_activations`.
    """
    if isinstance(w, torch.Tensor):
        known = _dense.get(id(w))
        if known is None and w._base is not None:  # one expert of a dense 3-D stack (a view of its storage)
            stack = _dense.get(("stack", w.untyped_storage().data_ptr()))
            known = None if stack is None else _expert_of(w, *stack)
        return _exact_linear(x, w) if known is None else _rounded_product(x, w, *known)
    typ = w.type_name
    if x.dim() == 2 and len(w.shape) == 2:
        y = quant_kernels.q8_linear(x, w.raw, typ, w.shape[1])  # None unless CPU, float32, one of Q8_TYPES
        if y is not None:
            return y
    return _rounded_product(x, w, typ, lambda: _q8_1_minima(w))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in llama.cpp's float32 steps (``ggml_compute_forward_rms_norm_f32`` and its fused ``mul``,
    ``ggml/src/ggml-cpu/ops.cpp``): the float32 squares (``x * x`` rounded to float32, then widened: squaring in
    double instead moved layer 0 of Gemma 3 270M Q4_K_M off llama.cpp's ties, its ``ffn_out`` median 9.6e-3) summed
    in double, ``mean = fp32(sum / n)``, ``scale =
    fp32(1 / sqrtf(mean + eps))``, ``y = fp32(fp32(x * scale) * w)``. [..., n], [n] or None -> [..., n], x's dtype.
    The same steps as :func:`harness.engines.llamacpp.numerics.rms_norm_fp32` (the emulating reference's)."""
    x32 = x.float()
    mean = ((x32 * x32).double().sum(-1, keepdim=True) / x32.shape[-1]).float()  # float32 squares, summed in double
    # sqrtf and the float32 division, correctly rounded: each through float64, rounded once to float32 (exact for a
    # float32 operand: 53 >= 2 x 24 + 2 bits); torch's float32 ``1.0 / t`` was one ulp off (58 rows of 400, tested)
    root = torch.sqrt((mean + np.float32(eps)).double()).float()
    scale = (1.0 / root.double()).float()
    y = x32 * scale
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


@contextlib.contextmanager
def q8_compute(dense: dict[int, tuple] | None = None) -> Iterator[None]:
    """While inside, :mod:`fast.model` computes its products and norms as llama.cpp does (:func:`linear`,
    :func:`rms_norm` swapped into ``fast.model``, looked up there at call time); ``dense``: :func:`dense_types`.
    Restores on exit; re-entrant; not thread-safe (one model steps at a time in a process)."""
    saved = fm.linear, fm.rms_norm, dict(_dense)
    fm.linear, fm.rms_norm = linear, rms_norm
    _dense.update(dense or {})
    try:
        yield
    finally:
        fm.linear, fm.rms_norm = saved[0], saved[1]
        _dense.clear()
        _dense.update(saved[2])
