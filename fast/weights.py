"""The fast path's weights: the one loader's canonical tensors (:func:`reference.weights.load_model`) as torch
tensors on one device and dtype, or packed GGUF blocks dequantized on the fly (:mod:`fast.quants`).

Three sources, one class (:class:`FastWeights`):

* a GGUF: each tensor's stored bytes are decoded in torch on the device, bit-exact with
  ``gguf.quants.dequantize``; with ``keep_quantized``, 2-D quantized matrices stay packed
  (:class:`fast.quants.QuantizedTensor`) and are dequantized on the fly inside each matmul and gather
  (on the CPU as views of the memory-mapped file, through the packed kernels of :mod:`fast.quant_kernels`);
* HF safetensors: read through numpy;
* a shape-only model (:class:`fast.shapes.RandomWeights`): random tensors made on the device, no file.

Norms, scales and ``rope_freqs`` (every 1-D tensor) stay float32 whatever the compute dtype, as llama.cpp
keeps them.

At load, after the weight check, every weight whose magnitude the compute dtype cannot carry through the ops that
follow it (:mod:`fast.carry`) is named in a :class:`reference.weight_check.CarryWarning`.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from gemma4_harness.reference.config import ModelConfig
from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.weight_check import CarryWarning, check_weights, max_abs_for

from . import quants
from .quant_blocks import SUPPORTED
from .carry import carry_problems

MAX_CARRY_WARNINGS = 5
"""Carry warnings shown per model load (the rest are counted in the last line)."""


def warn_carry(cfg: ModelConfig, W, bounds: dict[str, float], dtype: torch.dtype, held) -> list:
    """Warn (:class:`reference.weight_check.CarryWarning`, one line each) for every weight ``dtype`` cannot carry
    (:func:`fast.carry.carry_problems`); returns the problems."""
    name = str(dtype).replace("torch.", "")
    problems = carry_problems(cfg, W, bounds, name, held)
    for p in problems[:MAX_CARRY_WARNINGS]:
        warnings.warn(CarryWarning(p.line(W.source)), stacklevel=2)
    if len(problems) > MAX_CARRY_WARNINGS:
        warnings.warn(CarryWarning(f"{W.source}: {len(problems) - MAX_CARRY_WARNINGS} more weights {name} cannot "
                                   "carry"), stacklevel=2)
    return problems


class FastWeights:
    """Canonical weights as torch tensors on one device and dtype.

    Args:
        cfg: the model config (unused today; the per-layer table a loader may need).
        W: the loader's weights (:class:`reference.weights.Weights`) or :class:`fast.shapes.RandomWeights`.
        device, dtype: where and in what (1-D tensors and :data:`FLOAT32_ALWAYS` stay float32).
        keep_quantized: keep GGUF quantized matrices packed (see the module docstring).

    Raises:
        InputError: a quant type fast dequantization does not support.
        ModelFileError: a weight that is NaN, Inf or too large for ``dtype``
            (:func:`reference.weight_check.check_weights`).
    """

    FLOAT32_ALWAYS = ("norm", "scale", "rope_freqs", "ffn_gate_inp.scale", "ffn_down_exps.scale")

    def __init__(self, cfg: ModelConfig, W, device: torch.device, dtype: torch.dtype, keep_quantized: bool = False):
        self.t: dict[str, object] = {}
        bounds = check_weights(W, max_abs_for(dtype))  # NaN/Inf/|w| beyond the dtype, named, before any tensor is used
        if bounds:
            warn_carry(cfg, W, bounds, dtype, lambda name: self._held(W, name, dtype, keep_quantized))
        for name in W:
            keep32 = self._keep32(W, name)
            target = torch.float32 if keep32 else dtype
            if hasattr(W, "torch_tensor") and W.is_packed(name):  # random packed blocks (RandomWeights qtype)
                qt = W.torch_packed(name, device)
                self.t[name] = qt if keep_quantized else qt.dequantize(torch.float32).to(target)
            elif hasattr(W, "torch_tensor"):  # made on the device, no file (fast.shapes.RandomWeights)
                self.t[name] = W.torch_tensor(name, device, target)
            elif W.stored(name) is not None and W.raw_dtype(name) != "F32":
                self.t[name] = self._from_gguf(W, name, device, target, keep_quantized)
            else:
                arr = np.array(W.raw(name), dtype=np.float32)  # own copy: the source may be a read-only map
                self.t[name] = torch.from_numpy(arr).to(device=device, dtype=target)

    @classmethod
    def _keep32(cls, W, name: str) -> bool:
        return any(s in name for s in cls.FLOAT32_ALWAYS) or len(W.shape(name)) == 1

    @classmethod
    def _held(cls, W, name: str, dtype: torch.dtype, keep_quantized: bool) -> str:
        """The dtype the matmuls of tensor ``name`` run in: float32 for a 1-D tensor and a packed quantized matrix
        (dequantized to float32 inside the product), else the compute dtype."""
        packed = keep_quantized and len(W.shape(name)) in (2, 3) and hasattr(W, "stored") \
            and W.stored(name) is not None and W.raw_dtype(name) not in ("F32", "F16", "BF16")
        return "float32" if cls._keep32(W, name) or packed else str(dtype).replace("torch.", "")

    @staticmethod
    def _from_gguf(W, name: str, device: torch.device, target: torch.dtype, keep_quantized: bool):
        qtype = W.raw_dtype(name)
        if qtype not in SUPPORTED:
            raise InputError(f"{W.source}: tensor {name}: type {qtype} is not supported by fast dequantization")
        if keep_quantized and qtype not in ("F16", "BF16") and (
                len(W.shape(name)) == 2 or len(W.shape(name)) == 3 and device.type == "cpu"):
            # CPU: a view of the memory-mapped file, no copy, where its bytes are contiguous (a table cut by
            # --layers, such as the PLE table's first columns, is not: one packed copy); elsewhere: one copy
            # on the device. A MoE layer's expert stacks ([E, rows, row_len]) stay packed on the CPU, each expert
            # a view (QuantizedTensor.__getitem__) through the packed kernels; on a GPU they are dequantized (the
            # static-shape decoder gathers dense experts, fast.model.moe_experts_static).
            stored = W.stored(name)
            view = device.type == "cpu" and np.asarray(stored).flags.c_contiguous
            return quants.QuantizedTensor.from_numpy(stored, qtype, W.shape(name), device, copy=not view)
        raw = torch.from_numpy(np.array(W.stored(name)).view(np.uint8)).to(device)  # own copy of the mapped bytes
        return quants.dequantize(raw, qtype, W.shape(name), dtype=torch.float32).to(target)

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
