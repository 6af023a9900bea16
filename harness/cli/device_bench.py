"""``g4h device-bench``: the accelerator speed figures in one prepared run, and the same run in miniature on the CPU.

::

    g4h device-bench [--device cuda] [--out DIR]       # on a GPU machine (an estimate: 5-8 minutes)
    g4h device-bench --smoke --device cpu              # every step at toy sizes, to rehearse on the CPU
    g4h device-bench --steps decode --shapes 31b       # one step, one shape (a short device lease)

Exit status: 0 when every step ran, 1 when a step failed (its error is in summary.json and report.md), 2 on bad
input.

A GPU lent for a few minutes should go to measuring, not to debugging a script: this is that script, and
``g4h device-bench --smoke --device cpu`` (a test runs it) walks every step at toy sizes first. Steps, in
order; each is recorded with its wall time, and one that fails is recorded with its one-line error while the
next one runs:

1. ``static~paged``: the CUDA-graph decoder (:class:`fast.static_decode.StaticDecoder`) against the paged
   engine on an E4B-shape model cut to 4 layers, fp32, random weights
   (:func:`harness.parity.checks.fast.static_vs_paged`; gates ``fast.static~paged.*``). No file is needed.
2. ``kernels``: the fused packed kernel (:mod:`fast.cuda_kernels`) against dequantize-then-multiply, Q8_0
   and Q4_K, E4B and 31B FFN matrices and the LM head, 1/8/64 rows (:func:`fast.cuda_bench.run`; on the CPU
   through Triton's interpreter, at toy sizes: ``TRITON_INTERPRET=1`` is set for this process).
3. ``decode``: ``g4h bench --shape S --engines fast,fast-graph --dtype bfloat16 --batch 1,8,64 --pp 0``
   for S in e4b, 31b, 26b-a4b: tokens/s and the share of the read roofline (measured on the device, and the
   datasheet figure where :data:`harness.bench.run.HBM_SPEC_GBS` knows the GPU).
4. ``packed decode``: ``--shape e4b --quant Q8_0`` and ``Q4_K`` through ``fast-graph``, batch 1 and 8, with the
   fused kernel and with it disabled (``G4H_CUDA_KERNEL=0`` semantics, :func:`fast.cuda_kernels.disabled`). On the
   CPU both runs take the CPU's packed kernels (:mod:`fast.quant_kernels`): there it is a rehearsal only.

Output: ``<out>/<UTC>-device-bench/summary.json`` and ``report.md`` (the headline figures beside their
targets), with each ``g4h bench`` run's own folder beneath. Nothing here asserts a timing.

It lives in the CLI layer because it composes two siblings below it: :mod:`harness.bench` and the parity check
:func:`harness.parity.checks.fast.static_vs_paged`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch

from gemma4_harness.fast import cuda_bench, cuda_kernels, shapes
from gemma4_harness.fast.model import FastModel
from gemma4_harness.reference.errors import InputError

from ..bench import BenchOptions, bench
from ..bench.run import BenchPlan
from ..core.engine_kinds import BENCH_ENGINES, TWIN
from ..core.gates import resolve
from ..core.io import staged_run_dir, write_text_atomic
from ..parity.checks.fast import static_vs_paged
from ._args import Device, OutDir, check_out_dir

__all__ = ["DevicePlan", "device_bench", "FULL", "SMOKE", "STEPS", "add_arguments", "run"]


DECODE_ENGINES = [b.name for b in BENCH_ENGINES if b.kind == TWIN and b.variant in ("", "graph")]
"""The ``--engines`` rows the decode step times: the fast engine, paged and static (``fast``, ``fast-graph``)."""


@dataclass(frozen=True)
class DevicePlan:
    """The sizes of one device-bench run.

    Attributes:
        shapes: shape-only models for the decode step.
        layers: keep the first N layers (None: all); vocab: a smaller vocabulary (None: the model's).
        batches: decode batch sizes; tg: tokens generated per repetition; reps, warmup: timed and untimed repetitions.
        packed_batches: batch sizes of the packed-decode step.
        check_layers, check_vocab, check_window: the size of the static~paged check's model (``check_window``: its
            sliding window, None: the shape's 512; its longest requests span three windows, so the window sets
            their length).
        kernel_smoke: the kernel step at toy sizes (:func:`fast.cuda_bench.run` ``smoke``).
    """

    shapes: tuple[str, ...]
    layers: int | None
    vocab: int | None
    batches: tuple[int, ...]
    tg: int
    reps: int
    warmup: int
    packed_batches: tuple[int, ...]
    check_layers: int
    check_vocab: int | None
    check_window: int | None
    kernel_smoke: bool


FULL = DevicePlan(shapes=("e4b", "31b", "26b-a4b"), layers=None, vocab=None, batches=(1, 8, 64), tg=64, reps=3,
                  warmup=1, packed_batches=(1, 8), check_layers=4, check_vocab=None, check_window=None,
                  kernel_smoke=False)
"""The speed figures on a GPU (weights drawn on the device; nothing read from disk). Not yet timed on one: an
estimate of 5-8 minutes on an H200, so a lease of one 10-minute call may need ``--steps``/``--shapes`` in two."""

SMOKE = DevicePlan(shapes=("e4b", "31b", "26b-a4b"), layers=1, vocab=512, batches=(1, 2), tg=2, reps=1, warmup=1,
                   packed_batches=(1,), check_layers=2, check_vocab=512, check_window=32, kernel_smoke=True)
"""Every step at toy sizes: the CPU rehearsal of :data:`FULL` (``--smoke``)."""


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _step(record: dict[str, Any], name: str, fn: Callable[[], Any], progress: Callable[[str], None]) -> None:
    """Run one step into ``record[name]`` (its figures, wall seconds, or its one-line error)."""
    progress(f"device-bench: {name}")
    t0 = time.perf_counter()
    try:
        record[name] = {"figures": fn()}
    except Exception as e:  # a step that fails is recorded; the next one runs (the GPU time is not wasted)
        record[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                        "where": traceback.format_exc().splitlines()[-3:]}
    record[name]["seconds"] = round(time.perf_counter() - t0, 2)


def _check(plan: DevicePlan, device: str) -> dict[str, Any]:
    cfg = shapes.load_shape("e4b", layers=plan.check_layers, vocab_size=plan.check_vocab,
                            overrides={"sliding_window": plan.check_window} if plan.check_window else None)
    fm = FastModel(cfg, shapes.RandomWeights(cfg, seed=0), device, "float32")
    r = static_vs_paged(fm)
    gates = resolve({}, "device-bench")
    r["pass"] = bool(gates["fast.static~paged.same_tokens"].check(r["same_tokens"])
                     and gates["fast.static~paged.max_abs_logit"].check(r["max_abs_logit"]))
    return r


def _bench(out: str, device: str, shape: str, plan: DevicePlan, engines: list[str], batches, quant: str | None = None,
           dtype: str = "bfloat16") -> dict[str, Any]:
    bp = BenchPlan(engines=engines, dtypes=[dtype], batches=list(batches), pp=0, tg=plan.tg, reps=plan.reps,
                   warmup=plan.warmup)
    data, _, run_dir = bench(BenchOptions(shape=shape, quant=quant, vocab_size=plan.vocab, layers=plan.layers,
                                          engines=engines, device=device, dtypes=[dtype], plan=bp, out=out),
                             lambda msg: None)
    _free(device)
    rows = [{k: r.get(k) for k in ("engine", "dtype", "batch", "mean_tok_s", "std_tok_s", "bytes_per_token",
                                   "read_gbs", "roofline_share", "spec_share", "error")} for r in data["rows"]]
    return {"run_dir": Path(run_dir).name, "read_bandwidth_gbs": data["read_bandwidth_gbs"],
            "hbm_spec_gbs": data["machine"].get("hbm_spec_gbs"), "rows": rows, "ratios": data["ratios"]}


def _packed(out: str, device: str, plan: DevicePlan) -> dict[str, Any]:
    res = {}
    for qtype in ("Q8_0", "Q4_K"):
        for mode in ("fused", "dequantize-then-multiply"):
            with contextlib.nullcontext() if mode == "fused" else cuda_kernels.disabled():
                res[f"{qtype} {mode}"] = _bench(out, device, "e4b", plan, ["fast-graph"], plan.packed_batches,
                                                quant=qtype, dtype="float32")
    return res


def _kernels(device: str, plan: DevicePlan) -> list[dict[str, Any]]:
    if not device.startswith("cuda"):
        os.environ["TRITON_INTERPRET"] = "1"  # the CPU rehearsal runs the kernels' source through Triton's interpreter
    names = list(cuda_bench.SMOKE_SHAPES if plan.kernel_smoke else cuda_bench.SHAPES)
    rows = cuda_bench.run(["Q8_0", "Q4_K"], names, [1, 8, 64], "cuda" if device.startswith("cuda") else "cpu",
                          smoke=plan.kernel_smoke)
    _free(device)
    return rows


def headline(record: dict[str, Any]) -> list[str]:
    """The report's lines: each headline figure beside its target, from a :func:`device_bench` record."""
    lines = []
    chk = record.get("static~paged", {}).get("figures")
    if chk:
        lines.append(f"- static~paged (graphs {chk['graphs']}): same tokens {chk['same_tokens']:.0f}, max |Δlogit| "
                     f"{chk['max_abs_logit']:.2e}: {'PASS' if chk['pass'] else 'FAIL'}")
    dec = record.get("decode", {}).get("figures") or {}
    for shape, d in dec.items():
        for r in d.get("rows", []):
            if r["mean_tok_s"] is None:
                lines.append(f"- {shape} {r['engine']} b{r['batch']}: {r['error']}")
                continue
            share = "" if r["roofline_share"] is None else f", {100 * r['roofline_share']:.0f} % of measured read"
            spec = "" if r.get("spec_share") is None else f", {100 * r['spec_share']:.0f} % of datasheet"
            target = " (target: >= 50 %)" if shape == "e4b" and r["batch"] == 1 else ""
            lines.append(f"- {shape} bf16 {r['engine']} b{r['batch']}: {r['mean_tok_s']:.1f} t/s{share}{spec}{target}")
    kern = record.get("kernels", {}).get("figures") or []
    for row in kern:
        lines.append(f"- kernel {row['type']} {row['shape']} M={row['M']}: fused {row['fused']:.0f} GB/s, "
                     f"fused/dequantize-then-multiply {row['ratio']:.2f}x (target >= 1.5x)")
    packed = record.get("packed decode", {}).get("figures") or {}
    for q in ("Q8_0", "Q4_K"):
        fused, deq = packed.get(f"{q} fused"), packed.get(f"{q} dequantize-then-multiply")
        if not fused or not deq:
            continue
        for a, b in zip(fused["rows"], deq["rows"]):
            if a["mean_tok_s"] and b["mean_tok_s"]:
                ratio = a["mean_tok_s"] / b["mean_tok_s"]
                lines.append(f"- e4b {q} fast-graph b{a['batch']}: fused {a['mean_tok_s']:.1f} t/s, "
                             f"dequantize-then-multiply {b['mean_tok_s']:.1f} t/s ({ratio:.2f}x)")
    for name, step in record.items():
        if isinstance(step, dict) and "error" in step:
            lines.append(f"- step {name} FAILED: {step['error']}")
    return lines


STEPS = ("static~paged", "kernels", "decode", "packed decode")
"""The steps, in the order they run (``--steps`` picks some)."""


def device_bench(out: str | None, device: str = "cuda", plan: DevicePlan = FULL,
                 progress: Callable[[str], None] = lambda m: None,
                 steps: tuple[str, ...] = STEPS) -> tuple[dict[str, Any], str]:
    """Run every step (module docstring) on ``device``; write ``summary.json`` and ``report.md`` atomically.

    Args:
        out: base folder (default ``reports/``).
        device: ``cuda[:N]``, or ``cpu`` for the rehearsal (with :data:`SMOKE`).
        plan: :data:`FULL` or :data:`SMOKE` (``dataclasses.replace`` it to measure fewer shapes).
        steps: which of :data:`STEPS` to run (a device lease too short for all of them can take two calls).

    Returns:
        (the record, the run directory).

    Raises:
        InputError: a CUDA device torch does not see (before anything runs).
    """
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"--device {device}: torch sees no CUDA device")
    record: dict[str, Any] = {"created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                              "device": device, "plan": dataclasses.asdict(plan),
                              "torch": torch.__version__,
                              "gpu": torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda")
                              else None}
    with staged_run_dir("device-bench", out) as run:
        base = str(run.path)
        run_step = {"static~paged": lambda: _check(plan, device), "kernels": lambda: _kernels(device, plan),
                    "decode": lambda: {s: _bench(base, device, s, plan, DECODE_ENGINES, plan.batches)
                                       for s in plan.shapes},
                    "packed decode": lambda: _packed(base, device, plan)}
        for name in STEPS:
            if name in steps:
                _step(record, name, run_step[name], progress)
                _free(device)
        record["headline"] = headline(record)
        write_text_atomic(run.path / "summary.json", json.dumps(record, indent=1, sort_keys=True, default=str))
        write_text_atomic(run.path / "report.md", "# g4h device-bench\n\n" + f"device {device} ({record['gpu']}), "
                          f"torch {record['torch']}\n\n" + "\n".join(record["headline"]) + "\n")
    return record, str(run.final)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``g4h device-bench``."""
    p.add_argument("--device", default="cuda", type=Device(), help="cuda[:N] (cpu with --smoke for a rehearsal)")
    p.add_argument("--smoke", action="store_true", help="every step at toy sizes (1 layer, vocabulary 512, tg 2)")
    p.add_argument("--out", default=None, type=OutDir(), help="base folder for the run directory (default reports/)")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of: {', '.join(STEPS)} (default all)")
    p.add_argument("--shapes", default=None,
                   help="comma-separated shapes for the decode step (default e4b,31b,26b-a4b)")


def run(args: argparse.Namespace) -> int:
    """Run the steps; print the headline figures and the report's path; 1 when a step failed."""
    check_out_dir(args.out)
    if not args.device.startswith("cuda"):
        # the CPU rehearsal runs the Triton kernels through the interpreter, which must be on before triton's
        # first import (transformers imports it); the kernels step sets it again for a caller of device_bench
        os.environ["TRITON_INTERPRET"] = "1"
    steps = tuple(x.strip() for x in args.steps.split(",") if x.strip())
    bad = [x for x in steps if x not in STEPS]
    if bad or not steps:
        raise InputError(f"--steps {args.steps!r}: expected some of {', '.join(STEPS)}")
    plan = SMOKE if args.smoke else FULL
    if args.shapes:
        names = tuple(x.strip() for x in args.shapes.split(",") if x.strip())
        for name in names:
            shapes.shape_path(name)  # InputError for an unknown shape, before anything runs
        plan = dataclasses.replace(plan, shapes=names)
    record, run_dir = device_bench(args.out, args.device, plan,
                                   lambda msg: print(f"[device-bench] {msg}", file=sys.stderr, flush=True), steps)
    for line in record["headline"]:
        print(line)
    print(f"report: {run_dir}/report.md")
    failed = [k for k, v in record.items() if isinstance(v, dict) and "error" in v]
    return 1 if failed else 0
