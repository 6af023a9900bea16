"""A deliberately wrong ``cmd:`` engine: ``tests/cmd_stub.py`` (the reference behind the protocol) whose
``blk.L.ffn_down.weight`` (``--perturb-layer L``) holds a NaN, so its logits, its greedy log-probs and its trace
points from that layer's ``ffn_out`` on are NaN. The output check must fail it, naming that layer and point.

    python tests/cmd_nan_stub.py --perturb-layer L [cmd_stub options]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cmd_stub  # noqa: E402


class NaNWeight(cmd_stub.Perturbed):
    """The reference's weights with element [0, 0] of one tensor set to NaN."""

    def __init__(self, base, name: str) -> None:
        super().__init__(base, name)
        self.noisy = np.array(base[name], dtype=np.float64)
        self.noisy[0, 0] = np.nan


cmd_stub.Perturbed = NaNWeight

if __name__ == "__main__":
    sys.exit(cmd_stub.main())
