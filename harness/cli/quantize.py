"""``g4h quantize``: GGUF quantizations with llama.cpp's ``llama-quantize`` (:mod:`harness.engines.llamacpp.tools`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from gemma4_harness.reference.errors import InputError

from ..engines.llamacpp import tools
from ._args import Count, InFile, OutDir


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``g4h quantize``."""
    p.add_argument("source", type=InFile(), help="the GGUF to quantize (F32, BF16 or F16)")
    p.add_argument("--types", required=True, metavar="TYPE[,TYPE...]",
                   help=f"llama-quantize file types: {', '.join(tools.QUANT_TYPES)} (Q4_K is Q4_K_M ...)")
    p.add_argument("--out-dir", required=True, metavar="DIR", type=OutDir(),
                   help="folder of the quantized files (created)")
    p.add_argument("--imatrix", default=None, metavar="FILE", type=InFile(),
                   help="importance matrix for the types that need one (" + ", ".join(sorted(tools.IMATRIX_TYPES))
                        + ")")
    p.add_argument("--imatrix-text", default=None, metavar="FILE", type=InFile(),
                   help="or make one with llama-imatrix over this UTF-8 text (written to DIR/imatrix.gguf)")
    p.add_argument("--imatrix-ctx", type=Count(1, 1 << 20), default=128, metavar="N",
                   help="llama-imatrix chunk length (default 128)")
    p.add_argument("--threads", type=Count(1, 1 << 16), default=None, metavar="N",
                   help="quantizer threads (default: every CPU)")


def run(args: argparse.Namespace) -> int:
    """Quantize to each type and print ``TYPE: PATH`` per file; exit 0 (2 on bad input, from the caller)."""
    src = Path(args.source)
    if not src.is_file():
        raise InputError(f"{src}: no such file")
    types = [tools.canonical_type(t) for t in args.types.split(",") if t.strip()]
    needs = [t for t in types if t in tools.IMATRIX_TYPES]
    if needs and not (args.imatrix or args.imatrix_text):
        raise InputError(f"--types {needs[0]}: needs an importance matrix: give --imatrix FILE or --imatrix-text FILE")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t = tools.ensure_tools()
    matrix = args.imatrix
    if needs and matrix is None:
        matrix = str(tools.make_imatrix(src, args.imatrix_text, out / "imatrix.gguf", ctx=args.imatrix_ctx,
                                        threads=args.threads, tools=t))
        print(f"imatrix: {matrix}")
    stem = src.stem
    for suffix in ("-F32", "-BF16", "-F16"):
        stem = stem.removesuffix(suffix)
    for qt in types:
        dst = tools.quantize(src, out / f"{stem}-{qt}.gguf", qt, imatrix=matrix if qt in tools.IMATRIX_TYPES else None,
                             threads=args.threads, tools=t)
        print(f"{qt}: {dst}")
    return 0
