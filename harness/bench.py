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
(:func:`ratios`); see :mod:`harness.bench_report` for the report and the ratio
baseline.
"""

from __future__ import annotations

import copy
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

from reference.errors import InputError

RESULT_VERSION = 1
"""Version of the bench ``results.json`` layout."""

ENGINE_NAMES = ("fast", "transformers", "llamacpp", "reference")

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


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
    import torch

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
    nread = buf.numel() * 4
    del buf
    return buf_gbs(nread, best)


def buf_gbs(nbytes: int, seconds: float) -> float:
    """``nbytes / seconds`` in GB/s (1e9 bytes per second)."""
    return nbytes / seconds / 1e9


def machine_info(device: str = "cpu") -> dict[str, Any]:
    """What ran the benchmark: CPU model, cores, torch threads, torch version, GPU name when on CUDA."""
    import torch

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
    return info


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
    from reference.config import expected_tensors

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
    from reference.config import expected_tensors

    return int(sum(np.prod(s) for s in expected_tensors(cfg).values()))


# --------------------------------------------------------------------------- engines


def bench_ids(vocab: int, count: int, seed: int) -> list[int]:
    """``count`` token ids in ``[4, min(vocab, 32000))`` from a fixed seed (no BOS/EOS/pad specials)."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(4, max(5, min(vocab, 32000)), size=count)]


class BenchEngine:
    """Base of the per-engine adapters: ``pp`` and ``tg`` return the seconds of the timed part.

    Attributes:
        engine, dtype: as in :class:`BenchRow`.
        cfg: the model's :class:`reference.config.ModelConfig` (for bytes per token).
        max_batch: the largest batch the engine runs (None: any).
        kv_elem: bytes per KV-cache element.
    """

    engine = "?"
    dtype = "?"
    max_batch: int | None = None
    kv_elem = 4.0

    def elem_bytes(self, name: str) -> float:
        """Bytes per element of weight ``name`` as the engine reads it."""
        return DTYPE_BYTES.get(self.dtype, 4)

    def pp(self, n: int, depth: int, batch: int) -> float:
        """Seconds for one forward of ``batch`` x ``n`` new tokens after ``depth`` cached ones."""
        raise NotImplementedError

    def tg(self, n: int, depth: int, batch: int) -> float:
        """Seconds for ``n`` greedy decode steps of ``batch`` sequences after ``depth`` cached tokens."""
        raise NotImplementedError

    def timed(self, test: str, n: int, depth: int, batch: int) -> float:
        """Seconds of one ``pp`` or ``tg`` repetition."""
        return self.pp(n, depth, batch) if test == "pp" else self.tg(n, depth, batch)

    def close(self) -> None:
        """Free what the engine holds."""


class FastBench(BenchEngine):
    """:class:`fast.model.FastModel` on ``device`` in ``dtype``, over its paged KV cache (fp32).

    Args:
        cfg, W: from :func:`reference.weights.load_model`, or a shape-only model
            (:mod:`fast.shapes`).
        device, dtype: where and in what to compute.
    """

    engine = "fast"

    def __init__(self, cfg, W, device: str = "cpu", dtype: str = "float32", keep_quantized: bool = False):
        import torch

        from fast.model import FastModel

        self.torch = torch
        self.cfg = cfg
        self.dtype = dtype
        self.fm = FastModel(cfg, W, device, dtype, keep_quantized=keep_quantized)
        self.sync = torch.cuda.synchronize if self.fm.device.type == "cuda" else (lambda: None)

    def elem_bytes(self, name: str) -> float:
        t = self.fm.w[name] if name in self.fm.w else None
        if t is None:
            return DTYPE_BYTES[self.dtype]
        if isinstance(t, self.torch.Tensor):
            return float(t.element_size())
        return float(t.nbytes) / float(np.prod(t.shape))  # QuantizedTensor: packed bytes per element

    def _prepare(self, depth: int, batch: int, extra: int):
        from fast.model import SeqStep

        cache = self.fm.new_cache(batch, depth + extra + 1)
        slots = [cache.alloc() for _ in range(batch)]
        ctx = bench_ids(self.cfg.vocab_size, depth, 1) if depth else []
        chunk = 512
        with self.torch.inference_mode():
            for s0 in range(0, depth, chunk):
                part = self.torch.tensor(ctx[s0:s0 + chunk])
                self.fm.step(cache, [SeqStep(s, part, s0) for s in slots])
        self.sync()
        return cache, slots, SeqStep

    def pp(self, n: int, depth: int, batch: int) -> float:
        cache, slots, SeqStep = self._prepare(depth, batch, n)
        seqs = [SeqStep(s, self.torch.tensor(bench_ids(self.cfg.vocab_size, n, 100 + i)), depth)
                for i, s in enumerate(slots)]
        with self.torch.inference_mode():
            t = time.perf_counter()
            self.fm.step(cache, seqs)
            self.sync()
            return time.perf_counter() - t

    def tg(self, n: int, depth: int, batch: int) -> float:
        cache, slots, SeqStep = self._prepare(depth, batch, n)
        toks = self.torch.tensor(bench_ids(self.cfg.vocab_size, batch, 7))
        with self.torch.inference_mode():
            t = time.perf_counter()
            for k in range(n):
                logits = self.fm.step(cache, [SeqStep(s, toks[i:i + 1], depth + k) for i, s in enumerate(slots)])
                toks = logits.argmax(-1).cpu()
            self.sync()
            return time.perf_counter() - t

    def close(self) -> None:
        del self.fm


class TransformersBench(BenchEngine):
    """transformers eager attention with its own ``DynamicCache``: Gemma 4 from an HF folder, or Gemma 3 from a GGUF.

    Args:
        model: a loaded ``*ForCausalLM`` (fp32); it is cast to ``dtype``.
        cfg: our config of the same model (for bytes per token).
        dtype: ``float32`` or ``bfloat16``.
    """

    engine = "transformers"

    def __init__(self, model, cfg, dtype: str = "float32"):
        import torch

        self.torch = torch
        self.cfg = cfg
        self.dtype = dtype
        target = getattr(torch, dtype)
        # Module.to() casts in place: another dtype gets its own copy, so two adapters never share one module.
        same = all(p.dtype == target for p in model.parameters())
        self.model = (model if same else copy.deepcopy(model).to(target)).eval()

    def _context(self, depth: int, batch: int):
        torch = self.torch
        if not depth:
            return None
        ids = torch.tensor([bench_ids(self.cfg.vocab_size, depth, 1)] * batch)
        with torch.inference_mode():
            return self.model(ids, use_cache=True, logits_to_keep=1).past_key_values

    def pp(self, n: int, depth: int, batch: int) -> float:
        torch = self.torch
        past = self._context(depth, batch)
        ids = torch.tensor([bench_ids(self.cfg.vocab_size, n, 100 + i) for i in range(batch)])
        with torch.inference_mode():
            t = time.perf_counter()
            self.model(ids, past_key_values=past, use_cache=True, logits_to_keep=1)
            return time.perf_counter() - t

    def tg(self, n: int, depth: int, batch: int) -> float:
        torch = self.torch
        past = self._context(depth, batch)
        tok = torch.tensor(bench_ids(self.cfg.vocab_size, batch, 7)).view(batch, 1)
        with torch.inference_mode():
            t = time.perf_counter()
            for _ in range(n):
                o = self.model(tok, past_key_values=past, use_cache=True)
                past = o.past_key_values
                tok = o.logits[:, -1].argmax(-1).view(batch, 1)
            return time.perf_counter() - t

    def close(self) -> None:
        del self.model


class ReferenceBench(BenchEngine):
    """The float64 NumPy reference with its KV cache; one sequence at a time (``max_batch`` 1)."""

    engine = "reference"
    dtype = "float64"
    max_batch = 1
    kv_elem = 8.0

    def __init__(self, cfg, W):
        self.cfg = cfg
        self.W = W
        for name in W:  # dequantize up front: loading is not decoding
            W[name]

    def _context(self, depth: int):
        from reference import KVCache, forward

        cache = KVCache(self.cfg)
        if depth:
            forward(self.cfg, self.W, bench_ids(self.cfg.vocab_size, depth, 1), cache)
        return cache

    def pp(self, n: int, depth: int, batch: int) -> float:
        from reference import forward

        cache = self._context(depth)
        ids = bench_ids(self.cfg.vocab_size, n, 100)
        t = time.perf_counter()
        forward(self.cfg, self.W, ids, cache)
        return time.perf_counter() - t

    def tg(self, n: int, depth: int, batch: int) -> float:
        from reference import forward

        cache = self._context(depth)
        tok = bench_ids(self.cfg.vocab_size, 1, 7)
        t = time.perf_counter()
        for _ in range(n):
            logits = forward(self.cfg, self.W, tok, cache)
            tok = [int(np.argmax(logits[-1]))]
        return time.perf_counter() - t


class LlamaCppBench(BenchEngine):
    """llama.cpp through llama-cpp-python in its worker subprocess (:mod:`harness.llamacpp`).

    The worker times the ``pp``/``tg`` runs itself (one ``llama_decode`` per step,
    ``seq_id`` per sequence, F32 KV cache, flash attention off), so process start
    and model load are never inside a figure.

    Args:
        path: the GGUF file.
        cfg: our config of the model.
        threads: llama.cpp threads (default: torch's thread count, so every engine gets the same).
    """

    engine = "llamacpp"

    def __init__(self, path, cfg, threads: int | None = None):
        from harness.llamacpp import LlamaCppEngine

        self.path = Path(path)
        self.cfg = cfg
        self.threads = threads
        self.engine_cls = LlamaCppEngine
        self.dtype, self._per_elem = _gguf_facts(self.path)

    def elem_bytes(self, name: str) -> float:
        return self._per_elem.get(name, 4.0)

    def timed(self, test: str, n: int, depth: int, batch: int) -> float:
        """Seconds of one repetition, timed inside a fresh worker after one untimed repetition.

        Raises:
            harness.llamacpp.EngineCrashed: the worker died.
        """
        job = {"test": test, "n": n, "depth": depth, "batch": batch, "reps": 1, "warmup": 1}
        return self.run([job], n_ctx=depth + n + 8)[0][0]

    def run(self, jobs: list[dict[str, Any]], n_ctx: int) -> list[list[float]]:
        """Run bench jobs ``{"test", "n", "depth", "batch", "reps", "warmup"}`` in one worker; seconds per rep.

        Raises:
            harness.llamacpp.EngineCrashed: the worker died (the caller records it as the rows' error).
        """
        eng = self.engine_cls(self.path, n_ctx=n_ctx, threads=self.threads, timeout=6 * 3600.0)
        v = self.cfg.vocab_size
        full = []
        for j in jobs:  # the same token ids as the in-process engines get
            full.append(dict(op="bench", ctx_ids=bench_ids(v, j["depth"], 1) if j["depth"] else [],
                             pp_ids=[bench_ids(v, j["n"], 100 + i) for i in range(j["batch"])] if j["test"] == "pp" else [],
                             first=bench_ids(v, j["batch"], 7), **j))
        results, out_dir = eng.run_jobs(full)
        import shutil

        shutil.rmtree(out_dir, ignore_errors=True)
        return [r["seconds"] for r in results]


def _gguf_facts(path: Path) -> tuple[str, dict[str, float]]:
    """One read of a GGUF's header (about 9 s with a 262k vocabulary, so once): its weight type's short
    name, ``general.file_type`` (``Q4_K_M``, ``F32``...) or else the most common matrix type by elements,
    and tensor name -> stored bytes per element (block size included: Q8_0 is 34/32)."""
    from gguf import GGUFReader, LlamaFileType

    r = GGUFReader(str(path))
    per_elem = {t.name: float(t.n_bytes) / float(t.n_elements) for t in r.tensors}
    field = r.fields.get("general.file_type")
    if field is not None:
        try:
            name = LlamaFileType(int(field.parts[field.data[0]][0])).name
            return name.removeprefix("MOSTLY_").removeprefix("ALL_"), per_elem
        except (ValueError, IndexError):
            pass
    counts: dict[str, int] = {}
    for t in r.tensors:
        if t.name.endswith(".weight") and "norm" not in t.name:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
    return (max(counts, key=counts.get) if counts else "F32"), per_elem


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


def run_plan(benches: Sequence[BenchEngine], plan: BenchPlan,
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
    from harness.llamacpp import EngineCrashed

    rows: dict[tuple[int, str, int, int], BenchRow] = {}
    for test, n in plan.tests():
        for depth in plan.depths:
            for batch in plan.batches:
                live = []
                for k, be in enumerate(benches):
                    row = rows[(k, test, depth, batch)] = BenchRow(be.engine, be.dtype, test, n, depth, batch)
                    if be.max_batch is not None and batch > be.max_batch:
                        row.error = f"{be.engine} runs one sequence at a time (batch {be.max_batch} only)"
                        continue
                    if test == "tg":
                        row.bytes_per_token = bytes_per_token(be.cfg, be.elem_bytes, batch, depth, n, be.kv_elem)
                    live.append((k, be, row))
                if progress:
                    progress(f"{test}{n} depth {depth} batch {batch}: {', '.join(f'{b.engine}-{b.dtype}' for _, b, _ in live)}")
                for rep in range(-plan.warmup, plan.reps):
                    for k, be, row in live:
                        if row.error:
                            continue
                        try:
                            secs = be.timed(test, n, depth, batch)
                        except (RuntimeError, ValueError, MemoryError, InputError, EngineCrashed) as e:
                            row.error, row.tok_per_s = _one_line(e), []
                            continue
                        if rep >= 0:
                            row.tok_per_s.append(n * batch / secs)
                    gc.collect()
    return [rows[key] for key in sorted(rows, key=lambda t: (t[0], t[1] != "pp", t[2], t[3]))]


def ratios(rows: Sequence[BenchRow], numerator: str = "fast") -> dict[str, float]:
    """Speed ratios of engines measured in the same run: ``<test> b<batch> <num>/<den>`` -> ratio.

    For every (test, depth, batch), every ``fast-<dtype>`` row over the other
    engines' rows: ``transformers`` of the same dtype, ``llamacpp-<file type>`` and
    ``reference-float64``;
    and ``fast`` batch B over ``fast`` batch 1 (the batching gain).
    """
    ok = [r for r in rows if r.tok_per_s]
    by_key: dict[tuple[str, int], list[BenchRow]] = {}
    for r in ok:
        by_key.setdefault((r.label, r.batch), []).append(r)
    out: dict[str, float] = {}
    for (label, batch), group in sorted(by_key.items()):
        for num in (r for r in group if r.engine == numerator):
            for den in group:
                if den.engine != numerator and (den.engine != "transformers" or den.dtype == num.dtype):
                    out[f"{label} b{batch} {num.engine_label}/{den.engine_label}"] = num.mean / den.mean
    solo = {(r.label, r.engine_label): r for r in ok if r.batch == 1 and r.engine == numerator}
    for r in ok:
        base = solo.get((r.label, r.engine_label))
        if r.engine == numerator and r.batch > 1 and base is not None:
            out[f"{r.label} b{r.batch}/b1 {r.engine_label}"] = r.mean / base.mean
    return out
