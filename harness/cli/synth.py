"""``g4h synth``: build synthetic cases (HF folder + GGUFs) and print their paths."""

from __future__ import annotations

import argparse
import time

from ..core.cases import builtin_specs, load_prompts, resolve_spec
from ..synth import ensure_built, logit_stats


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``g4h synth``."""
    p.add_argument("specs", nargs="*", help="spec files or built-in case names (default: every built-in case)")
    p.add_argument("--cache", default=None,
                   help="cache root (default: $G4H_CACHE/synth or <repo>/.g4h-cache/synth)")
    p.add_argument("--stats", action="store_true", help="also print logit magnitude / margin statistics")


def run(args: argparse.Namespace) -> int:
    """Build each case and print where it is; exit 0 (2 on a bad spec, from the caller)."""
    paths = [resolve_spec(s) for s in args.specs] or builtin_specs()
    prompts = [r["prompt_ids"] for r in load_prompts()] if args.stats else []
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
