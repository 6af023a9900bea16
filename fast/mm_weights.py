"""The encoders' weights in torch: the canonical vision or audio arrays (:mod:`reference.mm_weights`,
:mod:`reference.audio_weights`) on one device, matrices in the compute dtype, the rest float32.

Float32 whatever the dtype, as llama.cpp keeps them (its converter forces the vision position table
and the audio convolutions to F32, and every 1-D tensor stays F32): norms, clip bounds, ``std_*``,
``per_dim_scale``, biases, the position table, the subsampling and depthwise convolutions.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
import torch

FLOAT32_ALWAYS = ("position_embd", "conv1d", "conv_dw", "norm", "std_", "per_dim_scale", "bias")


class EncoderWeights(Mapping[str, torch.Tensor]):
    """Read-only mapping canonical name -> torch tensor.

    Args:
        W: canonical weights (a mapping name -> ndarray, e.g. :class:`reference.mm_weights.VisionWeights`).
        device, dtype: where and in what the matrices are kept (see the module docstring).
    """

    def __init__(self, W: Mapping[str, np.ndarray], device: torch.device, dtype: torch.dtype):
        self.t: dict[str, torch.Tensor] = {}
        for name in W:
            arr = np.array(W[name], dtype=np.float32)  # own copy: the source may be read-only
            keep32 = arr.ndim <= 1 or any(s in name for s in FLOAT32_ALWAYS)
            self.t[name] = torch.from_numpy(arr).to(device=device, dtype=torch.float32 if keep32 else dtype)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.t[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.t)

    def __len__(self) -> int:
        return len(self.t)
