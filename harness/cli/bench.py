"""``g4h bench``: throughput (pp/tg tokens/s, batch and depth sweep, roofline share); the job is
:func:`harness.bench.bench`.

::

    g4h bench --model PATH --engines fast,transformers,llamacpp,reference [--device cpu] \\
        [--dtype float32,bfloat16] [--weights packed|dequantized] [--batch 1,2,4,8] [--pp 512] [--tg 128] \\
        [--depth 0,4096] [--reps 5] \\
        [--threads N] [--out DIR] [--baseline FILE] [--write-baseline FILE] [--draft-model PATH [--draft-tokens K]]
    g4h bench --shape e2b --engines fast --device cuda --dtype bfloat16    # real dims, random weights, no file
    g4h bench --shape e4b --quant Q4_K --engines fast,fast-graph --device cuda --batch 1,8,64    # packed blocks

Exit status: 0, or 1 when ``--baseline`` finds a ratio regression, or 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys

from gemma4_harness.fast.shapes import PACKED_TYPES
from gemma4_harness.reference.errors import InputError

from ..bench import BenchOptions, bench
from ..bench.report import summary_lines
from ..bench.run import BenchPlan
from ..core.engine_kinds import BENCH_ENGINES
from ..core.gates import SPEED_RATIO_MARGIN
from ._args import Count, Device, InFile, ModelArg, Number, OutDir, OutFile, check_out_dir, resolve_draft_model


def _int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"--{what}: expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 0 for v in vals):
        raise InputError(f"--{what}: expected non-negative integers, got {text!r}")
    return vals


def run(args: argparse.Namespace) -> int:
    """``g4h bench``; returns the exit status."""
    check_out_dir(args.out)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    plan = BenchPlan(engines=engines, dtypes=dtypes, batches=_int_list(args.batch, "batch"), pp=args.pp, tg=args.tg,
                     depths=_int_list(args.depth, "depth"), reps=args.reps, warmup=args.warmup)
    opts = BenchOptions(model=args.model, shape=args.shape, quant=args.quant, layers=args.layers,
                        ref_cache_gb=args.ref_cache_gb,
                        engines=engines, device=args.device,
                        dtypes=dtypes, weights=args.weights, plan=plan, threads=args.threads, out=args.out,
                        baseline=args.baseline,
                        write_baseline=args.write_baseline,
                        draft_model=None if args.draft_model is None else resolve_draft_model(args.draft_model),
                        draft_tokens=args.draft_tokens, draft_label=args.draft_model)
    data, status, run_dir = bench(opts, lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True))
    for line in summary_lines(data):
        print(line)
    for name, why in data["skipped"].items():
        print(f"{name}: skipped: {why}")
    if data.get("baseline_written"):
        print(f"baseline written: {data['baseline_written']}")
    if args.baseline:
        print("speed baseline: " + ("PASS" if status == 0 else "FAIL: a same-run ratio dropped more than "
                                    f"{100 * SPEED_RATIO_MARGIN:.0f} % (see report)"))
    print(f"report: {run_dir / 'report.md'}")
    return status


def add_arguments(b: argparse.ArgumentParser) -> None:
    """The options of ``g4h bench``."""
    b.add_argument("--model", default=None, type=ModelArg(), help=".gguf file, HF folder, or case spec .toml")
    b.add_argument("--shape", default=None,
                   help="shape-only model with real dimensions (e2b, e4b, 26b-a4b, 31b or a cases/shapes/*.toml); "
                        "random weights made on the device, fast engine only")
    b.add_argument("--quant", default=None, choices=PACKED_TYPES,
                   help="with --shape: draw every matrix as random packed GGUF blocks of this type (kept packed by "
                        "default; --weights dequantized decodes them at load)")
    b.add_argument("--layers", type=Count(1, 512), default=None,
                   help="keep only the first N layers (--shape, or a model file for fast, reference and transformers)")
    b.add_argument("--ref-cache-gb", dest="ref_cache_gb", type=Number(0, 1e6), default=None, metavar="GB",
                   help="reference engine: GB of dequantized float64 weights kept between forwards (default 2)")
    b.add_argument("--engines", default=",".join(e.name for e in BENCH_ENGINES if e.default),
                   help="comma-separated: fast, fast-graph, fast-unchecked (tg without the output check: its cost), "
                        "fast-q8 (the fast engine under --compute q8: llama.cpp's arithmetic), "
                        "transformers, llamacpp, reference")
    b.add_argument("--device", default="cpu", type=Device(), help="cpu | cuda[:N] (fast and transformers)")
    b.add_argument("--dtype", default="float32", help="comma-separated compute dtypes for fast and transformers")
    b.add_argument("--weights", choices=("packed", "dequantized"), default=None,
                   help="fast engine, GGUF input: keep quantized matrices packed (the packed kernels on the CPU) or "
                        "dequantize them at load (default: packed for a quantized GGUF)")
    b.add_argument("--batch", default="1", help="comma-separated batch sizes, e.g. 1,2,4,8")
    b.add_argument("--pp", type=Count(0, 1 << 24), default=512, help="prompt tokens per sequence for ppN (0: skip)")
    b.add_argument("--tg", type=Count(0, 1 << 24), default=128, help="generated tokens per sequence for tgN (0: skip)")
    b.add_argument("--depth", default="0", help="comma-separated context depths, e.g. 0,4096")
    b.add_argument("--reps", type=Count(1, 10000), default=5, help="timed repetitions")
    b.add_argument("--warmup", type=Count(0, 10000), default=1, help="untimed repetitions first")
    b.add_argument("--threads", type=Count(1, 4096), default=None,
                   help="CPU threads for every engine (default: torch's)")
    b.add_argument("--out", default=None, type=OutDir(),
                   help="base folder for the run directory (default reports/)")
    b.add_argument("--baseline", default=None, type=InFile(streams=True),
                   help="earlier bench results.json or baseline: fail on a ratio drop")
    b.add_argument("--write-baseline", default=None, type=OutFile(),
                   help="write this run's ratios as a new baseline file")
    b.add_argument("--draft-model", default=None, type=ModelArg(),
                   help="also time tg with speculative decoding on the fast engine: a Gemma 4 assistant (HF folder, "
                        "gemma4-assistant GGUF, or a drafter case such as e2b-assistant), or oracle (the upper bound), "
                        "random, partial:J")
    b.add_argument("--draft-tokens", type=Count(1, 1024), default=4, help="with --draft-model: drafts per round (K)")
