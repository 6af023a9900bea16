"""``g4h bench``: throughput of every engine on one model, llama-bench style, in one run.

The job (:func:`bench`), read top-down:

1. check the options and read the baseline (bad input stops here, before any work);
2. find the model (:class:`.models.ModelSource`) and measure the machine's read bandwidth;
3. build each engine that can run (:func:`.models.make_bench_engines`; one that cannot is listed as
   skipped with a one-line reason); with ``--draft-model``, the fast engine with that drafter beside it
   (:mod:`.speculative`);
4. time every (test, depth, batch) on every engine, interleaved (:func:`.run.run_plan`);
5. same-run ratios, the baseline verdict, and the report (:mod:`.report`).

Modules: :mod:`.run` (measurement, bytes per token, ratios), :mod:`.models`, :mod:`.speculative`, :mod:`.report`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from gemma4_harness.reference.errors import InputError

from ..core.engine_kinds import BENCH_ENGINES, KIND
from ..core.gates import SPEED_RATIO_MARGIN
from ..core.io import staged_run_dir
from ..core.workers import EngineCrashed
from ..engines.base import EngineUnavailable
from ..engines.reference import cache_bytes
from .models import ModelSource, make_bench_engines
from .report import compare_baseline, read_baseline, results, write_baseline, write_report
from .run import ENGINE_NAMES, BenchPlan, load_average, machine_info, measure_read_bandwidth, ratios, run_plan
from .speculative import SpecBench, speculative_summary

__all__ = ["BenchOptions", "bench"]

DRAFTED = tuple(b.name for b in BENCH_ENGINES if KIND[b.kind].drafts and not b.variant)
"""The ``--engines`` rows a drafter is timed beside (``--draft-model``): the plain engine of a kind that takes one
(the fast engine)."""

_WEIGHED = tuple(b.name for b in BENCH_ENGINES if KIND[b.kind].weights and not b.variant)
"""The plain ``--engines`` rows whose weight mode ``results.json`` records (``fast_weights``: the fast engine)."""

MAX_BATCH = 4096
"""The largest ``--batch`` accepted (the KV cache of every sequence is allocated up front)."""


@dataclass
class BenchOptions:
    """What ``g4h bench`` was asked for (its command-line options; see ``g4h bench --help``)."""

    model: str | None = None
    shape: str | None = None
    quant: str | None = None
    vocab_size: int | None = None  # shape-only: a smaller vocabulary (g4h device-bench --smoke)
    layers: int | None = None
    ref_cache_gb: float | None = None
    engines: list[str] = field(default_factory=lambda: list(ENGINE_NAMES))
    device: str = "cpu"
    dtypes: list[str] = field(default_factory=lambda: ["float32"])
    weights: str | None = None
    plan: BenchPlan = field(default_factory=lambda: BenchPlan(engines=list(ENGINE_NAMES)))
    threads: int | None = None
    out: str | None = None
    baseline: str | None = None
    write_baseline: str | None = None
    draft_model: str | None = None
    draft_tokens: int = 4
    draft_label: str | None = None


def check_options(o: BenchOptions) -> None:
    """Refuse bad options before anything runs.

    Raises:
        InputError: an unknown engine or dtype, nothing to measure, a batch, repetition or size below its
            minimum, a baseline file already there, or a CUDA device torch does not see.
    """
    unknown = [e for e in o.engines if e not in ENGINE_NAMES]
    if unknown or not o.engines:
        raise InputError(f"--engines: unknown engine {unknown[0] if unknown else '(none)'} "
                         f"(available: {', '.join(ENGINE_NAMES)})")
    bad = [d for d in o.dtypes if d not in ("float32", "bfloat16", "float16")]
    if bad or not o.dtypes:
        raise InputError(f"--dtype: expected float32, bfloat16 or float16, got {','.join(o.dtypes)!r}")
    if o.plan.pp < 0 or o.plan.tg < 0 or o.plan.warmup < 0:
        raise InputError(f"--pp {o.plan.pp}, --tg {o.plan.tg}, --warmup {o.plan.warmup}: expected integers >= 0")
    if not o.plan.tests():
        raise InputError("--pp and --tg are both 0: nothing to measure")
    if min(o.plan.batches) < 1 or o.plan.reps < 1:
        raise InputError("--batch values and --reps must be >= 1")
    if max(o.plan.batches) > MAX_BATCH:
        raise InputError(f"--batch {max(o.plan.batches)}: at most {MAX_BATCH} sequences")
    if o.layers is not None and o.layers < 1:
        raise InputError(f"--layers {o.layers}: expected an integer >= 1")
    if o.write_baseline and Path(o.write_baseline).exists():
        raise InputError(f"{o.write_baseline}: a baseline is there already; remove it or choose another path")
    if o.device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"--device {o.device}: torch sees no CUDA device")
    if o.draft_model is not None and (not set(DRAFTED) & set(o.engines) or not o.plan.tg):
        raise InputError("--draft-model: speculative decoding is timed against the fast engine's tg test "
                         "(needs --engines with fast and --tg > 0)")
    if o.draft_tokens < 1:
        raise InputError(f"--draft-tokens {o.draft_tokens}: expected >= 1")


def bench(o: BenchOptions, progress: Callable[[str], None]) -> tuple[dict[str, Any], int, Path]:
    """Run the benchmark job (module docstring); returns ``(results, exit status, run directory)``.

    Exit status: 0, or 1 when ``baseline`` finds a ratio regression.

    Raises:
        InputError: see :func:`check_options`; an unreadable model or baseline.
    """
    check_options(o)
    baseline = read_baseline(o.baseline) if o.baseline else None
    if o.threads:
        torch.set_num_threads(o.threads)
    threads = torch.get_num_threads()
    load_start = load_average()
    src = ModelSource(o.model, o.shape, o.device, o.layers, cache_bytes(o.ref_cache_gb), o.quant, o.vocab_size)
    longest = max(o.plan.depths) + max(o.plan.pp, o.plan.tg)
    if longest > src.cfg.context_length:
        raise InputError(f"--depth {max(o.plan.depths)} + {max(o.plan.pp, o.plan.tg)} tokens exceed the model's "
                         f"context ({src.cfg.context_length})")
    progress(f"measuring read bandwidth on {o.device}")
    bandwidth = measure_read_bandwidth(o.device)
    benches = []
    skipped: dict[str, str] = {}
    for name in o.engines:
        try:
            benches += make_bench_engines(name, src, o.dtypes, o.device, threads, o.weights, built=benches)
        except (EngineUnavailable, InputError) as e:
            skipped[name] = str(e).splitlines()[0]
            progress(f"{name}: skipped: {skipped[name]}")
    spec = []
    if o.draft_model is not None:
        fast = next((b for b in benches if b.engine in DRAFTED), None)
        if fast is not None:
            label = o.draft_label or (Path(o.draft_model).name if Path(o.draft_model).exists() else o.draft_model)
            spec = [SpecBench(fast, o.draft_model, o.draft_tokens, label)]
            progress(f"speculative decoding: drafter {label}, K = {o.draft_tokens}, beside fast-{fast.dtype}")
    builds = {}
    for be in benches:  # which llama.cpp build each llama.cpp row ran (portable, native: its CPU features)
        if hasattr(be, "build_info"):
            try:
                builds[be.engine] = be.build_info()
            except EngineCrashed as e:
                builds[be.engine] = {"error": str(e).splitlines()[0]}
    rows = run_plan(benches + spec, o.plan, progress)
    for be in benches:
        be.close()
    machine = {**machine_info(o.device), "load_avg": {"start": load_start, "end": load_average()}}
    data = results(rows, o.plan, machine, src.info(), bandwidth, ratios(rows))
    if spec:
        data["speculative"] = speculative_summary(spec, rows)
    data["skipped"] = skipped  # before the report is written: report.md lists them
    if builds:
        data["engine_builds"] = builds
    modes = sorted({b.weights for b in benches if b.engine in _WEIGHED})
    if modes:
        data["fast_weights"] = modes[0]  # packed | dequantized (harness.engines.fast.WEIGHT_MODES)
    status = 0
    if baseline is not None:
        status = 0 if compare_baseline(data, baseline, o.baseline, SPEED_RATIO_MARGIN)["pass"] else 1
    with staged_run_dir("bench", o.out) as run_dir:
        write_report(run_dir.path, data)
    if o.write_baseline:
        data["baseline_written"] = str(write_baseline(o.write_baseline, data))
    return data, status, run_dir.final
