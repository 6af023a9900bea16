"""The weights' values, read once: the problems only the tensor data shows (``weights``, ``weight_not_carried``).

Everything else :func:`harness.inspect.inspect_model` reports comes from the header; these two read every tensor once
(about a second per GB).
"""

from __future__ import annotations

from pathlib import Path

from gemma4_harness.fast.carry import carry_problems
from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.weight_check import MAX_ABS_FP16, MAX_ABS_FP32, check_weights
from gemma4_harness.reference.weights import load_model

from ..core.engine_kinds import KIND
from .common import named_in, one_line
from .model import UNUSABLE, WARNING, Inspection, Problem

CARRY_DTYPES = ("float32", "bfloat16", "float16")
"""The fast engine's compute dtypes whose carry limits :func:`weight_problems` checks."""


def weight_problems(path: Path) -> list[Problem]:
    """The weights' values, read once: ``weights`` (unusable: NaN, Inf or a magnitude no matmul holds,
    :func:`reference.weight_check.check_weights`) or, per fast compute dtype, ``weight_not_carried`` (a warning:
    a weight that dtype holds but cannot carry through the ops after it, :func:`fast.carry.carry_problems`; GGUF
    quantized matrices counted packed, as the fast engine keeps them by default)."""
    try:
        cfg, W = load_model(path, cache_bytes=0)
        bounds = check_weights(W, MAX_ABS_FP32)
    except InputError as e:
        return [Problem(UNUSABLE, "weights", named_in(e, str(path)), one_line(e))]
    out = []
    for dtype in CARRY_DTYPES:
        if dtype == "float16":
            try:
                bounds = check_weights(W, MAX_ABS_FP16)
            except InputError as e:
                out.append(Problem(WARNING, "weight_not_carried", named_in(e, str(path)), f"{one_line(e)} (float16)"))
                continue

        def held(name: str, dtype=dtype) -> str:
            packed = len(W.shape(name)) == 2 and W.stored(name) is not None and \
                W.raw_dtype(name) not in ("F32", "F16", "BF16")
            return "float32" if len(W.shape(name)) == 1 or packed else dtype

        for p in carry_problems(cfg, W, bounds, dtype, held):
            out.append(Problem(WARNING, "weight_not_carried", p.tensor, p.line(str(path))))
    return out


def note_carry(info: Inspection) -> None:
    """On each fast row, how many weights its dtype cannot carry (the ``weight_not_carried`` problems)."""
    for row in info.engines:
        n = sum(1 for p in info.problems if p.code == "weight_not_carried"
                and (f" {row.dtype} cannot carry" in p.message or p.message.endswith(f"({row.dtype})")))
        if "dtype" in KIND[row.engine].options and row.can_run and n:  # an engine whose --dtype picks its dtype
            row.notes.append(f"{n} weight(s) {row.dtype} cannot carry: expect wrong or non-finite output (problems)")
