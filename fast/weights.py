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
"""

from __future__ import annotations

import numpy as np
import torch

from reference.config import ModelConfig
from reference.errors import InputError
from reference.weight_check import check_weights, max_abs_for

from . import quants


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
        check_weights(W, max_abs_for(dtype))  # NaN/Inf/|w| beyond the dtype, named, before any tensor is used
        for name in W:
            keep32 = any(s in name for s in self.FLOAT32_ALWAYS) or len(W.shape(name)) == 1
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

    @staticmethod
    def _from_gguf(W, name: str, device: torch.device, target: torch.dtype, keep_quantized: bool):
        qtype = W.raw_dtype(name)
        if qtype not in quants.SUPPORTED:
            raise InputError(f"{W.source}: tensor {name}: type {qtype} is not supported by fast dequantization")
        if keep_quantized and len(W.shape(name)) == 2 and qtype not in ("F16", "BF16"):
            # CPU: a view of the memory-mapped file, no copy, where its bytes are contiguous (a table cut by
            # --layers, such as the PLE table's first columns, is not: one packed copy); elsewhere: one copy
            # on the device
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
