"""``g4h synth``: build synthetic cases (HF folder + GGUFs) and print their paths; or, with ``--shape``,
write a real-size GGUF with random weights (:mod:`harness.synth.scale`)."""

from __future__ import annotations

import argparse
import time

from gemma4_harness.reference.errors import InputError

from ..core.cases import builtin_specs, resolve_spec
from ..core.prompts import load_prompts
from ..synth import ensure_built, logit_stats
from ..synth.scale import FORMATS, write_scale_gguf
from ._args import Count, OutDir, OutFile, check_out_file


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``g4h synth``."""
    p.add_argument("specs", nargs="*", help="spec files or built-in case names (default: every built-in case)")
    p.add_argument("--cache", default=None, type=OutDir(),
                   help="cache root (default: $G4H_CACHE/synth, else ~/.cache/gemma4-harness/synth)")
    p.add_argument("--stats", action="store_true", help="also print logit magnitude / margin statistics")
    p.add_argument("--shape", default=None,
                   help="instead: write a real-size GGUF with random weights of this shape (e2b, e4b, 26b-a4b, "
                        "31b or a cases/shapes/*.toml), a tensor at a time, to --out")
    p.add_argument("--layers", type=Count(1, 512), default=None, help="with --shape: keep only the first N layers")
    p.add_argument("--format", default="q8_0", choices=sorted(FORMATS), help="with --shape: type of the matrices")
    p.add_argument("--seed", type=Count(0), default=0, help="with --shape: random seed")
    p.add_argument("--out", default=None, type=OutFile(regular=True), help="with --shape: the .gguf to write")


def run(args: argparse.Namespace) -> int:
    """Build each case and print where it is (or write the ``--shape`` file); exit 0 (2 on bad input, from the
    caller)."""
    if args.shape is not None:
        if not args.out or args.specs:
            raise InputError("g4h synth --shape: give --out FILE.gguf (and no case specs)")
        check_out_file(args.out)
        t0 = time.perf_counter()
        path = write_scale_gguf(args.shape, args.out, layers=args.layers, fmt=args.format, seed=args.seed)
        print(f"{path}: {args.shape} {args.format}, {path.stat().st_size / 1e9:.2f} GB "
              f"({time.perf_counter() - t0:.0f}s)")
        return 0
    if args.layers is not None or args.out is not None:
        raise InputError("g4h synth: --layers and --out go with --shape")
    paths = [resolve_spec(s) for s in args.specs] or builtin_specs()
    prompts = [r["prompt_ids"] for r in load_prompts(ids_only=True)] if args.stats else []
    for p in paths:
        t0 = time.perf_counter()
        case = ensure_built(p, args.cache)
        print(f"{case.spec.name}: {case.root} ({time.perf_counter() - t0:.2f}s)")
        print(f"  hf: {case.hf_dir}")
        for q, g in case.gguf.items():
            print(f"  {q}: {g}")
        if args.stats:
            s = logit_stats(case.hf_dir, prompts)
            print("  stats: " + ", ".join(f"{k}={v:.4g}" for k, v in s.items()))
    return 0
