"""``g4h logits``: the logits of every position of one prompt, ``[T, vocab]``, to a ``.npy`` file; with images or
audio (:mod:`._mm`) over the expanded prompt."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from ..core.io import save_npy_atomic
from ..core.prompts import read_prompt_ids
from ..engines import make_engine
from ._args import InFile, OutFile, add_model_args, check_out_file, engine_options, out_dtype, resolve_model
from ._mm import add_mm_args, mm_requested, open_mm_prompt


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``g4h logits``."""
    add_model_args(p)
    p.add_argument("--prompt-ids", required=True, type=InFile(streams=True), help="JSON list of token ids")
    p.add_argument("--out", required=True, type=OutFile(), help="output .npy")
    p.add_argument("--out-dtype", dest="dtype", choices=["float32", "float64"], default=None,
                   help="dtype of the .npy (default float64 for the reference, else float32)")
    add_mm_args(p)


def run(args: argparse.Namespace) -> int:
    """Write the logits; exit 0 (2 on bad input, from the caller)."""
    check_out_file(args.out)
    ids = read_prompt_ids(args.prompt_ids)
    if mm_requested(args):
        _, prompt, engine = open_mm_prompt(args, ids)
        logits = engine.logits(prompt)
        print(f"{args.out}: prompt expanded to {len(prompt.ids)} tokens ({prompt.n_soft} soft tokens of "
              f"{len(prompt.items)} items)", file=sys.stderr)
    else:
        engine = make_engine(args.engine, resolve_model(args.model, args.engine), **engine_options(args))
        logits = engine.logits(ids)
    dtype = args.dtype or out_dtype(args.engine)
    save_npy_atomic(args.out, np.asarray(logits, dtype=dtype))
    print(f"{args.out}: logits {list(logits.shape)} {dtype}", file=sys.stderr)
    return 0
