"""``g4h diff A B``: compare two traces and name the first (point, layer) that diverges."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from reference.errors import InputError

from ..core.gates import DIFF_TOL
from ..core.io import write_json_atomic
from ..traces.compare import DivergenceRule, compare, render_diff
from ..traces.format import read_trace
from ._args import InFile, Number, OutFile


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``g4h diff``."""
    p.add_argument("a", type=InFile(streams=True), help="trace under test (.jsonl)")
    p.add_argument("b", type=InFile(streams=True), help="baseline trace (.jsonl); relative errors divide by its norms")
    p.add_argument("--tol", type=Number(0), default=DIFF_TOL,
                   help=f"relative error bound: rel L2 with tensor dumps, else the checksum lower bound "
                        f"(default {DIFF_TOL:g})")
    p.add_argument("--min-cosine", type=Number(-1, 1), default=None,
                   help="also require this cosine (tensor dumps only)")
    p.add_argument("--skip", action="append", default=None, metavar="POINT",
                   help="leave this point out (repeatable), e.g. result_output when one side kept only the last row")
    p.add_argument("--json", default=None, type=OutFile(), help="also write the comparison as JSON here")


def diff_command(path_a: str, path_b: str, tol: float = DIFF_TOL, skip: Sequence[str] = (),
                 min_cosine: float | None = None, json_out: str | None = None, stream=None) -> int:
    """``g4h diff A B``: print the comparison (:func:`render_diff`); return 0 (no divergence) or 1.

    Raises:
        InputError: unreadable/invalid trace, different prompts, bad ``--tol`` (exit 2 in the CLI).
    """
    if not (tol >= 0):
        raise InputError(f"--tol {tol}: expected a non-negative number")
    a, b = read_trace(path_a), read_trace(path_b)
    res = compare(a, b, DivergenceRule(tol=tol, min_cosine=min_cosine), skip=skip)
    print(render_diff(res, a, b), end="", file=stream or sys.stdout)
    if json_out:
        try:
            write_json_atomic(json_out, {"a": str(a.path), "b": str(b.path), **res.as_dict()})
        except OSError as e:
            raise InputError(f"{json_out}: cannot write ({e.strerror or e})") from None
    return 1 if res.first is not None else 0


def run(args: argparse.Namespace) -> int:
    """Exit 0 when nothing diverges, 1 when a point does (2 on bad input, from the caller)."""
    return diff_command(args.a, args.b, tol=args.tol, skip=args.skip or (), min_cosine=args.min_cosine,
                        json_out=args.json)
