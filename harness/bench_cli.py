"""``g4h bench``: throughput of every engine on one model, llama-bench style, in one run.

::

    g4h bench --model PATH --engines fast,transformers,llamacpp,reference [--device cpu] \\
        [--dtype float32,bfloat16] [--batch 1,2,4,8] [--pp 512] [--tg 128] [--depth 0,4096] [--reps 5] \\
        [--threads N] [--out DIR] [--baseline FILE] [--write-baseline FILE]
    g4h bench --shape e2b --engines fast --device cuda --dtype bfloat16    # real dims, random weights, no file

``--model`` takes a GGUF file, an HF folder, or a case spec (``cases/bench/*.toml``,
``cases/models/*.toml``: built and cached on first use, giving both a GGUF and an
HF folder). Which engine reads which form:

- ``fast``, ``reference``: either form, through :func:`reference.weights.load_model`;
- ``transformers``: an HF folder (Gemma 4), or a Gemma 3 GGUF through transformers' GGUF loader;
- ``llamacpp``: a GGUF (an optional extra: ``pip install 'gemma4-harness[llamacpp]'``).

An engine that cannot read the given form, or is not installed, is listed as
skipped with a one-line reason; the others run. Exit status: 0, or 1 when
``--baseline`` finds a ratio regression, or 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from reference.errors import InputError

from . import bench as B


def _int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"--{what}: expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 0 for v in vals):
        raise InputError(f"--{what}: expected non-negative integers, got {text!r}")
    return vals


class ModelSource:
    """Where each engine finds the model named by ``--model`` or ``--shape``.

    Attributes:
        name: short model name for the report.
        gguf: a GGUF file or None.
        hf_dir: a Gemma 4 HF folder or None.
        shape: a shape-only model name or None.
        cfg, W: our config and weights (W is lazy; for a shape, random on the device).
    """

    def __init__(self, model: str | None, shape: str | None, device: str, layers: int | None = None):
        self.gguf: Path | None = None
        self.hf_dir: Path | None = None
        self.shape = shape
        if shape:
            from fast import shapes

            self.cfg = shapes.load_shape(shape, layers=layers)
            self.W = shapes.RandomWeights(self.cfg)
            self.name = f"{Path(shape).stem} (shape only)"
            self.path = str(shape)
            self.size_bytes = None
            return
        if model is None:
            raise InputError("g4h bench: give --model PATH or --shape NAME")
        p = Path(model)
        if not p.exists():
            raise InputError(f"{p}: no such file or folder")
        if p.suffix == ".toml":
            from . import synth

            built = synth.ensure_built(p)
            qt = "F32" if "F32" in built.gguf else sorted(built.gguf)[0]
            self.gguf, self.hf_dir = built.gguf[qt], built.hf_dir
        elif p.is_dir():
            self.hf_dir = p
        else:
            self.gguf = p
        from reference import load_model

        self.cfg, self.W = load_model(self.gguf or self.hf_dir)
        self.name = p.stem
        self.path = str(p)
        self.size_bytes = (self.gguf.stat().st_size if self.gguf else
                           sum(f.stat().st_size for f in self.hf_dir.glob("*.safetensors")))

    def info(self) -> dict[str, Any]:
        """Model facts for ``results.json``."""
        return {"name": self.name, "path": self.path, "arch": self.cfg.arch, "params": B.param_count(self.cfg),
                "size_bytes": self.size_bytes, "gguf": str(self.gguf) if self.gguf else None,
                "hf_dir": str(self.hf_dir) if self.hf_dir else None, "n_layer": self.cfg.n_layer,
                "hidden_size": self.cfg.hidden_size, "vocab_size": self.cfg.vocab_size}


def _transformers_model(src: ModelSource):
    """A fp32 eager ``*ForCausalLM`` for ``src``, or raise :class:`harness.engines.EngineUnavailable`."""
    from .engines import EngineUnavailable, TransformersEngine

    if src.hf_dir is not None:
        return TransformersEngine(src.hf_dir).model
    if src.gguf is not None and src.cfg.arch == "gemma3":
        from .gemma3_check import _load_transformers

        try:
            return _load_transformers(str(src.gguf))[0]
        except ImportError as e:
            raise EngineUnavailable(f"transformers engine unavailable ({e})") from None
    raise EngineUnavailable("transformers needs an HF folder for Gemma 4 (it cannot read a Gemma 4 GGUF); "
                            "pass a case spec (cases/bench/*.toml) or an HF folder")


def make_bench_engines(name: str, src: ModelSource, args) -> list[B.BenchEngine]:
    """The bench adapters of engine ``name`` (one per dtype where the engine takes a dtype).

    Raises:
        harness.engines.EngineUnavailable: not installed, or cannot read this model form (one line).
    """
    from .engines import EngineUnavailable

    if src.shape and name != "fast":
        raise EngineUnavailable(f"{name}: a shape-only model has no file; only the fast engine runs it")
    if name == "fast":
        return [B.FastBench(src.cfg, src.W, args.device, dt) for dt in args.dtypes]
    if name == "transformers":
        model = _transformers_model(src)
        if args.device != "cpu":
            model = model.to(args.device)
        out = []
        for dt in args.dtypes:
            if dt == "float16":
                continue
            out.append(B.TransformersBench(model, src.cfg, dt))
        return out
    if name == "reference":
        return [B.ReferenceBench(src.cfg, src.W)]
    if name == "llamacpp":
        if src.gguf is None:
            raise EngineUnavailable("llamacpp needs a GGUF file")
        from .llamacpp import llama_cpp_available

        if not llama_cpp_available():
            raise EngineUnavailable("llama-cpp-python is not installed; install with: "
                                    "pip install 'gemma4-harness[llamacpp]' (builds llama.cpp, ~5 min), "
                                    "or nox -s llamacpp")
        return [B.LlamaCppBench(src.gguf, src.cfg, threads=args.threads)]
    raise EngineUnavailable(f"unknown engine {name!r} (available: {', '.join(B.ENGINE_NAMES)})")


def cmd_bench(args: argparse.Namespace) -> int:
    """Run ``g4h bench``; returns the exit status."""
    import torch

    from .bench_report import compare_baseline, read_baseline, results, summary_lines, write_baseline, write_report
    from .engines import EngineUnavailable
    from .gates import SPEED_RATIO_MARGIN
    from .report import new_run_dir

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in B.ENGINE_NAMES]
    if unknown or not engines:
        raise InputError(f"--engines: unknown engine {unknown[0] if unknown else '(none)'} "
                         f"(available: {', '.join(B.ENGINE_NAMES)})")
    args.dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    bad = [d for d in args.dtypes if d not in ("float32", "bfloat16", "float16")]
    if bad or not args.dtypes:
        raise InputError(f"--dtype: expected float32, bfloat16 or float16, got {args.dtype!r}")
    plan = B.BenchPlan(engines=engines, dtypes=args.dtypes, batches=_int_list(args.batch, "batch"),
                       pp=args.pp, tg=args.tg, depths=_int_list(args.depth, "depth"), reps=args.reps,
                       warmup=args.warmup)
    if not plan.tests():
        raise InputError("--pp and --tg are both 0: nothing to measure")
    if min(plan.batches) < 1 or plan.reps < 1:
        raise InputError("--batch values and --reps must be >= 1")
    baseline = read_baseline(args.baseline) if args.baseline else None
    if args.write_baseline and Path(args.write_baseline).exists():
        raise InputError(f"{args.write_baseline}: a baseline is there already; remove it or choose another path")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"--device {args.device}: torch sees no CUDA device")
    src = ModelSource(args.model, args.shape, args.device, args.layers)
    run_dir = new_run_dir("bench", args.out)

    def progress(msg: str) -> None:
        print(f"[bench] {msg}", file=sys.stderr, flush=True)

    progress(f"measuring read bandwidth on {args.device}")
    bandwidth = B.measure_read_bandwidth(args.device)
    benches: list[B.BenchEngine] = []
    skipped: dict[str, str] = {}
    for name in engines:
        try:
            benches += make_bench_engines(name, src, args)
        except (EngineUnavailable, InputError) as e:
            skipped[name] = str(e).splitlines()[0]
            progress(f"{name}: skipped: {skipped[name]}")
    rows = B.run_plan(benches, plan, progress)
    for be in benches:
        be.close()
    data = results(rows, plan, B.machine_info(args.device), src.info(), bandwidth, B.ratios(rows))
    data["skipped"] = skipped  # before the report is written: report.md lists them
    status = 0
    if baseline is not None:
        verdict = compare_baseline(data, baseline, args.baseline, SPEED_RATIO_MARGIN)
        status = 0 if verdict["pass"] else 1
    write_report(run_dir, data)
    for line in summary_lines(data):
        print(line)
    for name, why in skipped.items():
        print(f"{name}: skipped: {why}")
    if args.write_baseline:
        print(f"baseline written: {write_baseline(args.write_baseline, data)}")
    if baseline is not None:
        print("speed baseline: " + ("PASS" if status == 0 else "FAIL: a same-run ratio dropped more than "
                                    f"{100 * SPEED_RATIO_MARGIN:.0f} % (see report)"))
    print(f"report: {run_dir / 'report.md'}")
    return status


def add_parser(sub) -> None:
    """Register ``g4h bench`` on the sub-command parser ``sub``."""
    b = sub.add_parser("bench", help="throughput (pp/tg tokens/s, batch and depth sweep, roofline share)")
    b.add_argument("--model", default=None, help=".gguf file, HF folder, or case spec .toml")
    b.add_argument("--shape", default=None,
                   help="shape-only model with real dimensions (e2b, e4b, 26b-a4b, 31b or a cases/shapes/*.toml); "
                        "random weights made on the device, fast engine only")
    b.add_argument("--layers", type=int, default=None, help="with --shape: keep only the first N layers")
    b.add_argument("--engines", default="fast,transformers,llamacpp,reference",
                   help="comma-separated: fast, transformers, llamacpp, reference")
    b.add_argument("--device", default="cpu", help="cpu | cuda[:N] (fast and transformers)")
    b.add_argument("--dtype", default="float32", help="comma-separated compute dtypes for fast and transformers")
    b.add_argument("--batch", default="1", help="comma-separated batch sizes, e.g. 1,2,4,8")
    b.add_argument("--pp", type=int, default=512, help="prompt tokens per sequence for ppN (0: skip)")
    b.add_argument("--tg", type=int, default=128, help="generated tokens per sequence for tgN (0: skip)")
    b.add_argument("--depth", default="0", help="comma-separated context depths, e.g. 0,4096")
    b.add_argument("--reps", type=int, default=5, help="timed repetitions")
    b.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    b.add_argument("--threads", type=int, default=None, help="CPU threads for every engine (default: torch's)")
    b.add_argument("--out", default=None, help="base folder for the run directory (default reports/)")
    b.add_argument("--baseline", default=None, help="earlier bench results.json or baseline: fail on a ratio drop")
    b.add_argument("--write-baseline", default=None, help="write this run's ratios as a new baseline file")
    b.set_defaults(func=cmd_bench)
