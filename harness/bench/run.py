"""Throughput, measured the way llama-bench measures it, for every engine in one run.

Two tests, named as llama-bench names them:

- ``pp<N>`` (prompt processing): ``batch`` sequences of ``N`` new tokens each,
  after ``depth`` tokens of context already in the cache, in one forward; tokens/s
  counts all ``batch * N`` tokens.
- ``tg<N>`` (token generation): ``N`` greedy decode steps of ``batch`` sequences
  at once, after ``depth`` tokens of context; tokens/s counts all ``batch * N``
  tokens.

The context (``depth``) is filled before the clock starts and is never part of a
figure. Each configuration runs ``warmup`` untimed repetitions, then ``reps``
timed ones, and reports mean ± standard deviation of the per-repetition tokens/s
(llama-bench's ``avg_ts`` / ``stddev_ts``). Every engine of a run sees the same
token ids (a fixed-seed draw), the same shapes and the same thread count.

Roofline: :func:`measure_read_bandwidth` reads a buffer much larger than the
last-level cache in the same process, and :func:`bytes_per_token` counts the bytes
of weights and KV cache an engine must read per generated token. Their ratio
(bytes/token x tokens/s / bandwidth) is the share of the memory roofline an
engine reaches; decode on a CPU is bound by that read, so the share says how much
headroom a kernel has left.

Speed figures are compared only as ratios of engines measured in the same run
(:func:`ratios`); see :mod:`harness.bench.report` for the report and the ratio
baseline. The engines time themselves (:class:`harness.engines.base.Benchable`).
"""

from __future__ import annotations

import gc
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from gemma4_harness.reference.config import expected_tensors
from gemma4_harness.reference.errors import InputError

from ..core.engine_kinds import BENCH, BENCH_ENGINES, KIND, TWIN
from ..core.workers import EngineCrashed
from ..engines.base import Benchable

RESULT_VERSION = 1
"""Version of the bench ``results.json`` layout."""

ENGINE_NAMES = tuple(b.name for b in BENCH_ENGINES)
"""``--engines`` names: the rows of :data:`harness.core.engine_kinds.BENCH_ENGINES` (each with the kind it times and
how)."""


# --------------------------------------------------------------------------- results


@dataclass
class BenchRow:
    """One (engine, dtype, test, depth, batch) measurement.

    Attributes:
        engine: ``fast``, ``transformers``, ``llamacpp`` or ``reference``.
        dtype: what the engine computes in (``float32``, ``bfloat16``, ``float64``; llama.cpp: the file's type).
        test: ``pp`` or ``tg``.
        n: tokens per sequence (the ``512`` of ``pp512``).
        depth: tokens of context before the test.
        batch: sequences at once.
        tok_per_s: tokens/s of each timed repetition (all sequences counted).
        bytes_per_token: bytes of weights + KV read per token (see :func:`bytes_per_token`), or None.
        error: one line when the configuration could not run (then ``tok_per_s`` is empty).
    """

    engine: str
    dtype: str
    test: str
    n: int
    depth: int
    batch: int
    tok_per_s: list[float] = field(default_factory=list)
    bytes_per_token: float | None = None
    error: str | None = None

    @property
    def label(self) -> str:
        """llama-bench's test name: ``pp512``, ``tg128 @ d4096``."""
        return f"{self.test}{self.n}" + (f" @ d{self.depth}" if self.depth else "")

    @property
    def engine_label(self) -> str:
        """``engine-dtype``, the name used in ratios and plots."""
        return f"{self.engine}-{self.dtype}"

    @property
    def mean(self) -> float:
        """Mean tokens/s over the repetitions (nan when none ran)."""
        return statistics.fmean(self.tok_per_s) if self.tok_per_s else math.nan

    @property
    def std(self) -> float:
        """Sample standard deviation of tokens/s (0 for one repetition)."""
        return statistics.stdev(self.tok_per_s) if len(self.tok_per_s) > 1 else 0.0

    def as_dict(self, bandwidth_gbs: float | None) -> dict[str, Any]:
        """JSON-able row with the derived GB/s and roofline share (share of ``bandwidth_gbs``)."""
        gbs = (self.bytes_per_token * self.mean / 1e9
               if self.bytes_per_token is not None and self.tok_per_s else None)
        share = gbs / bandwidth_gbs if gbs is not None and bandwidth_gbs else None
        return {"engine": self.engine, "dtype": self.dtype, "test": self.test, "n": self.n,
                "depth": self.depth, "batch": self.batch, "label": self.label,
                "mean_tok_s": None if not self.tok_per_s else self.mean,
                "std_tok_s": None if not self.tok_per_s else self.std, "reps_tok_s": self.tok_per_s,
                "bytes_per_token": self.bytes_per_token, "read_gbs": gbs, "roofline_share": share,
                "error": self.error}


# --------------------------------------------------------------------------- machine


def measure_read_bandwidth(device: str = "cpu", nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Sustained read bandwidth of this machine in GB/s (1e9 bytes/s): the roofline of a decode step.

    Reads a float32 buffer of ``nbytes`` (default 1 GiB, far above any CPU's
    last-level cache, so it streams from DRAM) with torch on ``device``, using
    torch's current thread count, twice over: a sum, and a matrix-vector product
    over the same bytes; it keeps the best of ``reps`` timed passes of each after
    one warm-up. This is the "plain read" figure the roofline share is
    taken against; a matrix-vector kernel reaches at most this.

    Args:
        device: ``cpu`` or ``cuda[:N]``.
        nbytes: buffer size in bytes.
        reps: timed passes.

    Returns:
        GB/s, a float > 0.

    Raises:
        InputError: ``nbytes`` < 1 MiB or ``reps`` < 1.
    """
    if nbytes < (1 << 20) or reps < 1:
        raise InputError(f"bandwidth probe: need nbytes >= 1 MiB and reps >= 1, got {nbytes} and {reps}")
    dev = torch.device(device)
    cols = 1 << 14
    buf = torch.ones(nbytes // 4 // cols * cols, dtype=torch.float32, device=dev)
    ones = torch.ones(cols, dtype=torch.float32, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    best = math.inf
    # Two streaming reads (a reduction and a matrix-vector product); on some CPUs one, on others the other is
    # faster, and the faster is the better estimate of what the memory system delivers.
    for fn in (lambda: buf.sum(), lambda: torch.mv(buf.view(-1, cols), ones)):
        for i in range(reps + 1):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            dt = time.perf_counter() - t
            if i:
                best = min(best, dt)
    return buf_gbs(buf.numel() * 4, best)


def buf_gbs(nbytes: int, seconds: float) -> float:
    """``nbytes / seconds`` in GB/s (1e9 bytes per second)."""
    return nbytes / seconds / 1e9


def machine_info(device: str = "cpu") -> dict[str, Any]:
    """What ran the benchmark: CPU model, cores, torch threads, torch version, GPU name when on CUDA."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
        spec = hbm_spec_gbs(info["gpu"])
        if spec is not None:
            info["hbm_spec_gbs"] = spec
    return info


HBM_SPEC_GBS = (("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0),
                ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0), ("A100", 1555.0), ("L40S", 864.0),
                ("RTX 4090", 1008.0))
"""Datasheet memory bandwidth in GB/s of common GPUs, by a substring of ``torch.cuda.get_device_name`` (first
match wins, so the specific names come first). Source: NVIDIA's product datasheets (H200 SXM 4.8 TB/s; H100 SXM
3.35, PCIe 2.0, NVL 3.9; A100 80GB SXM 2.039, PCIe 1.935, 40GB 1.555; L40S 864 GB/s; GeForce RTX 4090 1,008 GB/s).
The roofline share of a row is taken against the *measured* read bandwidth; the datasheet figure is reported
beside it (``machine.hbm_spec_gbs``, ``spec_share`` in the report), the figure published numbers such as vLLM's
are quoted against."""


def hbm_spec_gbs(gpu_name: str) -> float | None:
    """The datasheet bandwidth of ``gpu_name`` (:data:`HBM_SPEC_GBS`), or None for a GPU not in the table."""
    for key, gbs in HBM_SPEC_GBS:
        if key in gpu_name:
            return gbs
    return None


def load_average() -> list[float] | None:
    """The system's 1-, 5- and 15-minute load averages (runnable processes), or None where the OS has none.

    Recorded at the start and end of a bench run (``machine.load_avg``): on a shared CPU the other processes'
    load moves every timing, and a same-run ratio only partly cancels it."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# --------------------------------------------------------------------------- bytes per token


def weight_bytes_per_step(cfg, elem_bytes: Callable[[str], float], batch: int) -> float:
    """Bytes of weights one decode step of ``batch`` sequences reads.

    Every matrix is read once per step, whatever the batch. Embedding tables
    (``token_embd``, ``per_layer_token_embd``) are gathered: ``batch`` rows each,
    unless ``token_embd`` is also the output head (tied), when it is read whole.
    ``rope_freqs`` (one float32 table) counts once. MoE expert tensors are read
    for the experts the step touches: with ``k`` of
    ``n`` experts per token and uniform routing that is
    ``n * (1 - (1 - k/n) ** batch)`` experts (an expectation).

    Args:
        cfg: :class:`reference.config.ModelConfig`.
        elem_bytes: tensor name -> bytes per element as the engine stores it
            (4 for fp32, 2 for bf16, 34/32 for Q8_0...).
        batch: sequences per step.

    Returns:
        bytes (float).
    """
    shapes = expected_tensors(cfg)
    tied = "output.weight" not in shapes
    total = 0.0
    for name, shape in shapes.items():
        n = float(np.prod(shape))
        base = name.split(".", 1)[-1] if name.startswith("blk.") else name
        if name == "token_embd.weight" and not tied:
            n = shape[-1] * batch
        elif name == "per_layer_token_embd.weight":
            n = shape[-1] * min(batch, shape[0]) if len(shape) == 2 else n
        elif "_exps" in base and cfg.n_expert:
            k, e = cfg.n_expert_used, cfg.n_expert
            n *= 1.0 - (1.0 - k / e) ** batch
        total += n * elem_bytes(name)
    factors = {L.rope_freq_factors.size for L in cfg.layers if L.rope_freq_factors is not None}
    if factors:  # rope_freqs.weight: one float32 table of n_rot/2 divisors, shared by the full layers
        total += 4.0 * max(factors)
    return total


def kv_bytes_per_token(cfg, context: int, elem: float = 4.0) -> float:
    """Bytes of K and V one sequence's new token reads from the cache, at ``context`` tokens of context.

    Every layer reads its KV (a KV-shared layer reads its donor's again); a
    sliding layer reads at most its window; a ``k_eq_v`` layer stores V only.

    Args:
        cfg: :class:`reference.config.ModelConfig`.
        context: tokens in the cache when the token attends (including itself).
        elem: bytes per cached element (4: fp32 cache).

    Returns:
        bytes (float).
    """
    total = 0.0
    for L in cfg.layers:
        n = min(context, cfg.sliding_window) if L.is_sliding else context
        donor = cfg.layers[L.kv_donor]
        tensors = 2 if donor.has_v_proj or not cfg.has_v_norm else 1
        total += n * donor.n_kv_head * donor.head_dim * tensors * elem
    return total


def bytes_per_token(cfg, elem_bytes: Callable[[str], float], batch: int, depth: int, n: int,
                    kv_elem: float = 4.0) -> float:
    """Bytes read per generated token in ``tg<n> @ d<depth>`` at ``batch``: weights/batch + mean KV per token."""
    w = weight_bytes_per_step(cfg, elem_bytes, batch) / batch
    kv = statistics.fmean(kv_bytes_per_token(cfg, depth + i + 1, kv_elem) for i in range(0, n, max(1, n // 16)))
    return w + kv


def param_count(cfg) -> int:
    """Parameters of the model (every tensor of :func:`reference.config.expected_tensors`)."""
    return int(sum(np.prod(s) for s in expected_tensors(cfg).values()))


# --------------------------------------------------------------------------- the run


@dataclass
class BenchPlan:
    """What one ``g4h bench`` run measures.

    Attributes:
        engines: engine names, in order.
        dtypes: compute dtypes for ``fast`` and ``transformers``.
        batches: batch sizes.
        pp: prompt tokens per sequence for ``pp`` (0: no pp test).
        tg: generated tokens per sequence for ``tg`` (0: no tg test).
        depths: context depths.
        reps, warmup: timed and untimed repetitions.
    """

    engines: Sequence[str]
    dtypes: Sequence[str] = ("float32",)
    batches: Sequence[int] = (1,)
    pp: int = 512
    tg: int = 128
    depths: Sequence[int] = (0,)
    reps: int = 5
    warmup: int = 1

    def tests(self) -> list[tuple[str, int]]:
        """``[("pp", N), ("tg", N)]`` for the tests asked for."""
        return [(t, n) for t, n in (("pp", self.pp), ("tg", self.tg)) if n > 0]


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".strip()


def run_plan(benches: Sequence[Benchable], plan: BenchPlan,
             progress: Callable[[str], None] | None = None) -> list[BenchRow]:
    """Measure every (test, depth, batch) of ``plan`` on every engine, interleaved.

    For each configuration, every engine first runs its warm-up, then the timed
    repetitions go round-robin (repetition 1 of every engine, then repetition 2,
    ...), so a drift of the machine's speed during a long run (a busy neighbour
    on a shared VM, thermal limits) touches every engine alike and the same-run
    ratios stay fair. llama.cpp runs each of its turns in its own worker process
    (its timing starts after the model is loaded and its own warm-up step).

    A configuration beyond an engine's ``max_batch``, or one that raises, gets a
    row with ``error`` set (one line) and the run goes on.

    Returns:
        rows in the order engine, test, depth, batch.
    """
    rows: dict[tuple[int, str, int, int], BenchRow] = {}
    for test, n in plan.tests():
        for depth in plan.depths:
            for batch in plan.batches:
                live = []
                for k, be in enumerate(benches):
                    if test not in getattr(be, "tests", ("pp", "tg")):  # speculative decoding: tg only
                        continue
                    row = rows[(k, test, depth, batch)] = BenchRow(be.engine, be.dtype, test, n, depth, batch)
                    if be.max_batch is not None and batch > be.max_batch:
                        row.error = f"{be.engine} runs one sequence at a time (batch {be.max_batch} only)"
                        continue
                    if test == "tg" and getattr(be, "roofline", True):
                        row.bytes_per_token = bytes_per_token(be.cfg, be.elem_bytes, batch, depth, n, be.kv_elem)
                    live.append((k, be, row))
                if progress:
                    progress(f"{test}{n} depth {depth} batch {batch}: {', '.join(f'{b.engine}-{b.dtype}' for _, b, _ in live)}")
                for rep in range(-plan.warmup, plan.reps):
                    for k, be, row in live:
                        if row.error:
                            continue
                        try:
                            secs = be.bench_time(test, n, depth, batch)
                        except (RuntimeError, ValueError, MemoryError, InputError, EngineCrashed) as e:
                            row.error, row.tok_per_s = _one_line(e), []
                            continue
                        if rep >= 0:
                            row.tok_per_s.append(n * batch / secs)
                    gc.collect()
    return [rows[key] for key in sorted(rows, key=lambda t: (t[0], t[1] != "pp", t[2], t[3]))]


def _always_rounds(engine: str) -> bool:
    """Whether bench row ``engine`` times a kind that always rounds its activations (llama.cpp's arithmetic:
    :attr:`harness.core.engine_kinds.EngineKind.rounds`)."""
    return engine in BENCH and KIND[BENCH[engine].kind].rounds == "always"


def _same_dtype(engine: str) -> bool:
    """Whether bench row ``engine`` is set beside the fast rows of its own dtype only (``same_dtype``)."""
    return engine in BENCH and BENCH[engine].same_dtype


def ratios(rows: Sequence[BenchRow], numerator: str = TWIN) -> dict[str, float]:
    """Speed ratios of engines measured in the same run: ``<test> b<batch> <num>/<den>`` -> ratio.

    For every (test, depth, batch), every ``fast-<dtype>`` row over the other
    engines' rows: ``transformers`` of the same dtype, ``llamacpp-<file type>`` and
    ``reference-float64``;
    and ``fast`` batch B over ``fast`` batch 1 (the batching gain); with a drafter, ``fast-spec-<dtype>`` over
    ``fast-<dtype>`` (the speed-up of speculative decoding); ``fast-graph-<dtype>`` over ``fast-<dtype>`` (static
    shapes and CUDA graphs against the paged step), and ``fast-graph`` batch B over its batch 1;
    ``fast-unchecked-<dtype>`` over ``fast-<dtype>`` (what the output check costs: 1.01 = 1 %); ``fast-q8-<dtype>``
    over ``fast-<dtype>`` and over the ``llamacpp`` rows, and its batch B over its batch 1.
    """
    ok = [r for r in rows if r.tok_per_s]
    by_key: dict[tuple[str, int], list[BenchRow]] = {}
    for r in ok:
        by_key.setdefault((r.label, r.batch), []).append(r)
    out: dict[str, float] = {}
    for (label, batch), group in sorted(by_key.items()):
        for num in (r for r in group if r.engine == numerator):
            for den in group:
                if den.engine in (f"{numerator}-spec", f"{numerator}-graph", f"{numerator}-unchecked",
                                  f"{numerator}-q8"):
                    if den.dtype == num.dtype:
                        out[f"{label} b{batch} {den.engine_label}/{num.engine_label}"] = den.mean / num.mean
                    if den.engine == f"{numerator}-q8":  # llama.cpp's arithmetic against llama.cpp itself
                        for ll in (r for r in group if _always_rounds(r.engine)):
                            out[f"{label} b{batch} {den.engine_label}/{ll.engine_label}"] = den.mean / ll.mean
                elif den.engine != numerator and (not _same_dtype(den.engine) or den.dtype == num.dtype):
                    out[f"{label} b{batch} {num.engine_label}/{den.engine_label}"] = num.mean / den.mean
    batched = (numerator, f"{numerator}-graph", f"{numerator}-q8")
    solo = {(r.label, r.engine_label): r for r in ok if r.batch == 1 and r.engine in batched}
    for r in ok:
        base = solo.get((r.label, r.engine_label))
        if r.engine in batched and r.batch > 1 and base is not None:
            out[f"{r.label} b{r.batch}/b1 {r.engine_label}"] = r.mean / base.mean
    return out
