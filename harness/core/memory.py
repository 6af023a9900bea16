"""Memory: what an engine will need for a model, what this machine has, and a clear stop when it is short.

* :func:`model_info` / :meth:`ModelInfo.from_loaded`: the facts an estimate needs, from the config and
  the GGUF tensor table or the safetensors headers only (no tensor is read).
* :func:`plan` -> :class:`MemoryPlan`: the bytes one engine needs for that model, dtype, weight mode
  and context, term by term, against :func:`available_memory`; :meth:`MemoryPlan.line` says it in one
  line with what to try. ``g4h inspect`` calls :func:`plan` once per engine.
* :func:`require` raises :class:`NotEnoughMemory` (an :class:`~reference.errors.InputError`: one line,
  exit 2) when the plan does not fit; :func:`guarded` turns an allocation failure inside an engine
  method (``MemoryError``, numpy's ``_ArrayMemoryError``, torch's ``OutOfMemoryError`` or CPU
  allocator ``RuntimeError``) into the same kind of line.
* :class:`PeakMemory`: peak ``VmRSS`` and ``RssAnon`` of a process, sampled from ``/proc/<pid>/status``
  by a background thread (benchmarks and the scale measurements).

Units: bytes; ``GB`` = 10^9 bytes in every message.

Test hook: ``G4H_MEMORY_AVAILABLE_GB`` (:data:`AVAILABLE_ENV`), when set, replaces what
:func:`available_memory` measures (CPU and CUDA alike), so a test can make a plan fail or pass on any
machine. It is meant for tests; a user who sets it gets plans against the figure given.
"""

from __future__ import annotations

import functools
import math
import os
import resource
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from gguf import GGML_QUANT_SIZES

from gemma4_harness.reference.config import ModelConfig, cut_layers, expected_tensors
from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.weights import DEFAULT_CACHE_BYTES, READ_ELEMENTS, block_bounds, load_model

from .engine_kinds import KIND, planned_kinds

GB = 10**9

#: Resident bytes of a process that has imported what each engine needs, before any model, rounded up.
#: Measured (``VmRSS`` after ``import harness.engines.<engine>``; CPython 3.11, numpy 2, torch 2.13 CPU,
#: transformers 5.23): reference 0.04 GB, fast 0.23 GB, transformers 0.35 GB. The llama.cpp worker is a
#: second process with llama-cpp-python's libraries: not measured here, taken as 0.3 GB.
RUNTIME_BYTES = {"reference": int(0.1 * GB), "fast": int(0.3 * GB), "transformers": int(0.5 * GB),
                 "llamacpp": int(0.3 * GB)}

#: Address space one more torch intra-op (OpenMP) thread takes: its 8 MiB stack, the 64 MiB malloc arena glibc
#: reserves for it, OpenMP's own. Measured: ``VmSize`` grows by 96 MiB at torch's first parallel op with one
#: thread beside the main one (torch 2.13 CPU, glibc 2.36). Counted only against ``RLIMIT_AS``: an address-space
#: limit that leaves no room for it makes libgomp end the process ("Thread creation failed"), which no
#: ``except`` can catch.
THREAD_ADDRESS_BYTES = 100 * 2**20

#: Bytes per element of the fast engine's compute dtypes.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}

#: GGML types the fast engine keeps packed with ``--weights packed`` (plain float types are not packed).
_UNPACKED = ("F32", "F16", "BF16", "F64")
_BLOCK_TYPES = {t.name: GGML_QUANT_SIZES[t] for t in GGML_QUANT_SIZES}
"""GGUF type name -> (elements, bytes) per block (gguf-py's table)."""

ENGINES = planned_kinds()
"""The engines whose memory is planned: the registry rows with a ``memory_rule`` (:mod:`harness.core.engine_kinds`);
each names its rule in :data:`PLAN_RULES`."""

#: Test hook: GB (10^9 bytes) that :func:`available_memory` reports instead of measuring.
AVAILABLE_ENV = "G4H_MEMORY_AVAILABLE_GB"


class NotEnoughMemory(InputError):
    """The engine would not fit in the memory available (or an allocation failed): one line, exit 2."""


# --------------------------------------------------------------------------- the model's facts


@dataclass(frozen=True)
class TensorFacts:
    """One tensor of the file as the engines will read it: numpy shape, stored type, stored bytes."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    @property
    def elements(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelInfo:
    """What a memory estimate needs to know of a model, read without any tensor data.

    Attributes:
        path: the file or folder.
        form: ``gguf`` or ``hf``.
        cfg: the config (after ``--layers``, when given).
        tensors: canonical name -> :class:`TensorFacts`, the tensors the decoder reads.
        file_bytes: size of the file (GGUF) or of every ``*.safetensors`` (HF folder).
    """

    path: str
    form: str
    cfg: ModelConfig
    tensors: Mapping[str, TensorFacts]
    file_bytes: int

    @classmethod
    def from_loaded(cls, path: str | os.PathLike, cfg: ModelConfig, W: Any) -> "ModelInfo":
        """From an opened model (``reference.weights.load_model``'s ``(cfg, W)``, or shape-only random
        weights): shapes and stored types from ``W``, stored bytes from the GGUF view or the dtype."""
        p = Path(path)
        tensors = {}
        for name in W:
            shape = tuple(W.shape(name))
            stored = W.stored(name) if hasattr(W, "stored") else None
            dtype = W.raw_dtype(name) if hasattr(W, "raw_dtype") else "F32"
            if stored is not None:
                nbytes = int(stored.nbytes)
            elif dtype in _BLOCK_TYPES:  # random packed blocks of a shape-only model (fast.shapes.RandomWeights)
                bs, ts = _BLOCK_TYPES[dtype]
                nbytes = math.prod(shape) // bs * ts
            else:
                nbytes = math.prod(shape) * {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}.get(dtype, 4)
            tensors[name] = TensorFacts(shape, dtype, nbytes)
        if p.is_dir():
            size = sum(f.stat().st_size for f in p.glob("*.safetensors"))
        else:
            size = p.stat().st_size if p.is_file() else 0
        return cls(str(p), "hf" if p.is_dir() else "gguf", cfg, tensors, size)

    def cut(self, n: int) -> "ModelInfo":
        """The same model cut to its first ``n`` layers (:func:`reference.config.cut_layers`), for advice."""
        cfg = cut_layers(self.cfg, n)
        keep = expected_tensors(cfg)
        tensors = {}
        for name, t in self.tensors.items():
            if name in keep or (not name.startswith("blk.") and name not in ("per_layer_token_embd.weight",
                                                                              "per_layer_model_proj.weight")):
                want = keep.get(name, t.shape)
                scale = math.prod(want) / max(1, t.elements)
                tensors[name] = TensorFacts(tuple(want), t.dtype, int(t.nbytes * scale))
        return ModelInfo(self.path, self.form, cfg, tensors, self.file_bytes)


def model_info(path: str | os.PathLike, layers: int | None = None) -> ModelInfo:
    """:class:`ModelInfo` of a GGUF file or HF folder, from its metadata and tensor table only.

    Raises:
        InputError: the loader's errors (bad file, key, tensor; ``layers`` out of range).
    """
    cfg, W = load_model(path, layers=layers, cache_bytes=0)
    return ModelInfo.from_loaded(path, cfg, W)


# --------------------------------------------------------------------------- what is available


def _meminfo(field_name: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _status(field_name: str, pid: int | str = "self") -> int | None:
    """A ``kB`` field of ``/proc/<pid>/status`` in bytes (``VmRSS``, ``RssAnon``, ``VmSize`` ...)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def _cgroup_headroom() -> int | None:
    """Bytes this process's memory cgroup may still grow by (v2 ``memory.max``, v1 ``memory.limit_in_bytes``)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        ctrl, rel = parts[1], parts[2].lstrip("/")
        if ctrl == "":  # v2
            base = Path("/sys/fs/cgroup") / rel
            limit_f, used_f = base / "memory.max", base / "memory.current"
        elif "memory" in ctrl.split(","):  # v1
            base = Path("/sys/fs/cgroup/memory") / rel
            limit_f, used_f = base / "memory.limit_in_bytes", base / "memory.usage_in_bytes"
        else:
            continue
        try:
            limit = limit_f.read_text().strip()
            used = int(used_f.read_text().strip())
        except (OSError, ValueError):
            continue
        if limit != "max" and int(limit) < 1 << 60:
            return max(0, int(limit) - used)
    return None


def available_memory(device: str = "cpu", own_process: bool = True) -> tuple[int | None, str]:
    """Bytes an engine can still allocate, and where that figure comes from.

    CPU: the least of ``MemAvailable`` (``/proc/meminfo``: free memory plus reclaimable caches), the
    memory cgroup's headroom (limit minus usage) and, when ``RLIMIT_AS`` is set, the address space
    left (the limit minus this process's ``VmSize``; for an engine in a fresh worker process,
    ``own_process=False``, the whole limit). CUDA: free device memory (``torch.cuda.mem_get_info``).

    With ``$G4H_MEMORY_AVAILABLE_GB`` set (:data:`AVAILABLE_ENV`, a test hook) that figure is returned
    instead of any measurement.

    Returns:
        ``(bytes or None when nothing can be read, "MemAvailable" | "cgroup limit" | "RLIMIT_AS" |
        "free CUDA memory" | "G4H_MEMORY_AVAILABLE_GB")``.

    Raises:
        InputError: ``$G4H_MEMORY_AVAILABLE_GB`` is not a number >= 0.
    """
    forced = os.environ.get(AVAILABLE_ENV)
    if forced is not None:
        try:
            gb = float(forced)
        except ValueError:
            gb = -1.0
        if not gb >= 0:
            raise InputError(f"${AVAILABLE_ENV} = {forced!r}: expected a number of GB >= 0")
        return int(gb * GB), AVAILABLE_ENV
    if device.startswith("cuda"):
        import torch  # heavy: only for a CUDA plan

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free), "free CUDA memory"
    found: list[tuple[int, str]] = []
    avail = _meminfo("MemAvailable")
    if avail is not None:
        found.append((avail, "MemAvailable"))
    cg = _cgroup_headroom()
    if cg is not None:
        found.append((cg, "cgroup limit"))
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        used = (_status("VmSize") or 0) if own_process else 0
        found.append((max(0, soft - used), "RLIMIT_AS"))
    if not found:
        return None, "unknown"
    return min(found)


# --------------------------------------------------------------------------- the plan


@dataclass
class MemoryPlan:
    """One engine's memory need for one model, against what is available.

    Attributes:
        engine: ``reference`` | ``fast`` | ``transformers`` | ``llamacpp``.
        model: the file or folder.
        options: what the estimate assumed (dtype, weight mode, cache budget, tokens, device ...).
        need_bytes: the sum of ``breakdown``.
        breakdown: term -> bytes (see :func:`plan` for where each comes from).
        already_bytes: the part of ``need_bytes`` in place before the engine allocates: the runtime of
            an engine that runs in this process, and (against ``RLIMIT_AS``) packed GGUF weights,
            which are mapped from the file already.
        available_bytes: what the engine can have: what can still be allocated
            (:func:`available_memory`) plus ``already_bytes`` (None: unknown, then ``fits`` is True).
        available_from: which limit that is (:func:`available_memory`).
        fits: ``need_bytes <= available_bytes``.
        advice: options that would make it fit, most useful first (``--weights packed``,
            ``--dtype bfloat16``, ``--ref-cache-gb X``, ``--layers N``).
    """

    engine: str
    model: str
    options: dict[str, Any]
    need_bytes: int
    breakdown: dict[str, int]
    already_bytes: int = 0
    available_bytes: int | None = None
    available_from: str = "unknown"
    fits: bool = True
    advice: list[str] = field(default_factory=list)

    def line(self) -> str:
        """One line: the need (its two largest terms), what is available, what to try."""
        top = sorted(self.breakdown.items(), key=lambda kv: -kv[1])[:2]
        terms = ", ".join(f"{k} {v / GB:.1f} GB" for k, v in top)
        avail = "unknown" if self.available_bytes is None else f"{self.available_bytes / GB:.1f} GB"
        what = self.engine + "".join(f" {v}" for k, v in self.options.items() if k in ("dtype", "weights") and v)
        text = (f"{self.model}: not enough memory for the {what} engine: it needs about {self.need_bytes / GB:.1f} GB "
                f"({terms}), {avail} available ({self.available_from})")
        if self.advice:
            text += "; try " + " or ".join(self.advice)
        else:
            rule = _rule_of(self.engine)
            knobs = rule.knobs if rule else None
            text += (f"; no {knobs} setting fits either: free memory or use a machine with more" if knobs else
                     "; try a smaller model file (a lower-bit quantization), or free memory")
        return text

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``g4h inspect --json``)."""
        return {"engine": self.engine, "options": self.options, "need_bytes": self.need_bytes,
                "breakdown": dict(self.breakdown), "already_bytes": self.already_bytes,
                "available_bytes": self.available_bytes, "available_from": self.available_from,
                "fits": self.fits, "advice": list(self.advice)}


def _f64(t: TensorFacts) -> int:
    return 8 * t.elements


#: Tables the reference reads in parts (rows of the prompt's tokens; the head in blocks), never whole.
_READ_IN_PARTS = ("token_embd.weight", "per_layer_token_embd.weight", "output.weight")


def _layer_groups(info: ModelInfo) -> list[list[TensorFacts]]:
    """Tensors the reference holds at the same time: each matrix alone (``ffn_block`` reads the FFN's
    three one at a time), a MoE layer's two expert stacks together (``moe_experts`` takes both); tables
    read in parts are not among them."""
    T = info.tensors
    groups: list[list[TensorFacts]] = [[t] for n, t in T.items() if len(t.shape) == 2 and n not in _READ_IN_PARTS]
    for L in info.cfg.layers:
        b = f"blk.{L.index}."
        groups.append([T[b + n + ".weight"] for n in ("ffn_gate_up_exps", "ffn_down_exps") if b + n + ".weight" in T])
    return [g for g in groups if g]


def _in_use(group: list[TensorFacts]) -> int:
    """float64 bytes of a group, plus the float32 temporaries of reading its largest tensor (a matrix is read
    :data:`reference.weights.READ_ELEMENTS` at a time; an expert stack whole)."""
    big = max(group, key=lambda t: t.elements)
    temp = 8 * (big.elements if len(big.shape) > 2 else min(big.elements, READ_ELEMENTS))
    return sum(_f64(t) for t in group) + temp


def _kv_bytes(cfg: ModelConfig, context: int, elem: int, window_bound: bool, batch: int = 1) -> int:
    """K and V of every layer that owns them for ``context`` tokens (sliding layers: at most the window
    when ``window_bound``; one tensor on a layer without V projection)."""
    total = 0
    for L in cfg.layers:
        if not L.has_kv:
            continue
        s = min(context, cfg.sliding_window) if (window_bound and L.is_sliding) else context
        total += s * L.n_kv_head * L.head_dim * (2 if L.has_v_proj else 1) * elem
    return total * batch


def _head_name(cfg: ModelConfig) -> str:
    return "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"


def _layer_sets(info: ModelInfo) -> list[list[TensorFacts]]:
    """Tensors a layer-outer pass (:func:`reference.batch.forward_chains`) holds at once: every tensor of one
    layer, or the tensors read whole outside the layers (the PLE projection)."""
    sets: dict[str, list[TensorFacts]] = {}
    for n, t in info.tensors.items():
        if n in _READ_IN_PARTS:
            continue
        sets.setdefault(n.split(".")[1] if n.startswith("blk.") else "", []).append(t)
    return list(sets.values())


def _reference_terms(info: ModelInfo, tokens: int, context: int, forwards: int, cache_bytes: int,
                     layer_held: bool = False) -> tuple[dict[str, int], int]:
    cfg, T = info.cfg, info.tensors
    h, V = cfg.hidden_size, cfg.vocab_size
    working = max((_in_use(g) for g in (_layer_sets(info) if layer_held else _layer_groups(info))), default=0)
    cacheable = sum(_f64(t) for n, t in T.items() if n != "per_layer_token_embd.weight")
    head = T[_head_name(cfg)]
    block = max(b - a for a, b in block_bounds(head.shape[0], head.shape[1]))
    ple = cfg.ple_dim * cfg.n_layer
    heads = max((L.n_head for L in cfg.layers), default=1)
    terms = {
        "runtime": RUNTIME_BYTES["reference"],
        "weight cache": min(cache_bytes, cacheable) if forwards > 1 else 0,
        "weights in use": working,
        "LM head block": 16 * block * h,  # float64, and gguf's two float32 arrays while it is read
        "logits": 3 * 8 * tokens * V,  # the blocks' products, their concatenation, the softcap
        "KV cache": _kv_bytes(cfg, context, 8, window_bound=False),
        "activations": 8 * tokens * (6 * h + 3 * ple + 3 * heads * context),
    }
    return terms, 0


def _fast_terms(info: ModelInfo, tokens: int, context: int, dtype: str, weights: str, batch: int,
                device: str = "cpu") -> tuple[dict[str, int], int]:
    cfg = info.cfg
    elem = DTYPE_BYTES[dtype]
    dense = packed = 0
    biggest = 0
    ranks = (2, 3) if str(device).startswith("cpu") else (2,)  # expert stacks stay packed on the CPU only
    for t in info.tensors.values():
        keep_packed = weights == "packed" and info.form == "gguf" and len(t.shape) in ranks \
            and t.dtype not in _UNPACKED
        if keep_packed:
            packed += t.nbytes
            continue
        dense += t.elements * (4 if len(t.shape) == 1 else elem)
        # While a tensor is converted (fast.weights.FastWeights): a copy of its GGUF bytes, and its float32
        # form when the target is another dtype (or when a float array is copied before it is cast).
        copied = t.nbytes if info.form == "gguf" and t.dtype != "F32" else 0
        biggest = max(biggest, copied + (4 * t.elements if elem != 4 or copied == 0 else 0))
    terms = {
        "runtime": RUNTIME_BYTES["fast"],
        "weights": dense,
        "packed weights": packed,
        "largest tensor in conversion": biggest,
        "KV cache": _kv_bytes(cfg, context, 4, window_bound=True, batch=batch),
        "logits": (4 + 8) * tokens * batch * cfg.vocab_size,  # float32 on the device, float64 for the caller
        "activations": 4 * tokens * batch * (8 * cfg.hidden_size + 3 * cfg.ple_dim * cfg.n_layer),
    }
    return terms, packed if info.form == "gguf" else 0


def _transformers_terms(info: ModelInfo, tokens: int, context: int) -> tuple[dict[str, int], int]:
    cfg = info.cfg
    params = sum(t.elements for t in info.tensors.values())
    biggest = max((t.nbytes + 4 * t.elements for t in info.tensors.values()), default=0)
    heads = max((L.n_head for L in cfg.layers), default=1)
    terms = {
        "runtime": RUNTIME_BYTES["transformers"],
        "weights": 4 * params,
        "largest tensor in conversion": biggest,
        "KV cache": _kv_bytes(cfg, context, 4, window_bound=True),
        "logits": 2 * 4 * tokens * cfg.vocab_size,
        "activations": 4 * tokens * (8 * cfg.hidden_size + 3 * heads * context + 3 * cfg.ple_dim * cfg.n_layer),
    }
    return terms, 0


def _llamacpp_terms(info: ModelInfo, tokens: int, context: int) -> tuple[dict[str, int], int]:
    cfg = info.cfg
    terms = {
        "runtime": RUNTIME_BYTES["llamacpp"],
        "model file (mapped)": info.file_bytes,
        "KV cache": _kv_bytes(cfg, context, 4, window_bound=False),
        "logits": 4 * tokens * cfg.vocab_size,
        "compute buffer": 4 * min(tokens, 512) * (4 * cfg.hidden_size + max(L.n_ff for L in cfg.layers)
                                                   + cfg.vocab_size),
    }
    return terms, 0


@dataclass(frozen=True)
class PlanRule:
    """How one kind of engine is planned (:data:`PLAN_RULES`; a registry row names its rule: ``memory_rule``).

    Attributes:
        terms: ``(info, options) -> (breakdown, mapped bytes)``, the terms of :func:`plan`'s docstring.
        shown: the options a plan reports (:attr:`MemoryPlan.options`).
        knobs: the options that change the need, for the line that says none of their settings fits (None: the
            engine runs the file as it is).
        oom_advice: what an allocation failure's line suggests when the plan gave no advice.
        torch: the engine runs torch: planned on its device, and it starts torch threads (``RLIMIT_AS``).
        in_process: the engine runs in the harness's own process (its runtime is running already; the llama.cpp
            engine runs in a worker process).
    """

    terms: Callable[[ModelInfo, dict[str, Any]], tuple[dict[str, int], int]]
    shown: tuple[str, ...]
    knobs: str | None = None
    oom_advice: tuple[str, ...] = ("--layers N",)
    torch: bool = False
    in_process: bool = True


PLAN_RULES: dict[str, PlanRule] = {
    "reference": PlanRule(
        lambda info, o: _reference_terms(info, o["tokens"], o["context"], o["forwards"], o["cache_bytes"],
                                         o["layer_held"]),
        ("tokens", "new_tokens", "cache_bytes", "forwards"), "--ref-cache-gb or --layers",
        ("a smaller --ref-cache-gb", "--layers N")),
    "fast": PlanRule(
        lambda info, o: _fast_terms(info, o["tokens"], o["context"], o["dtype"], o["weights"], o["batch"],
                                    o["device"]),
        ("tokens", "new_tokens", "batch", "dtype", "weights", "device"), "--weights, --dtype or --layers",
        ("--weights packed", "--dtype bfloat16", "--layers N"), torch=True),
    "transformers": PlanRule(lambda info, o: _transformers_terms(info, o["tokens"], o["context"]),
                             ("tokens", "new_tokens", "device"), "--layers", torch=True),
    "llamacpp": PlanRule(lambda info, o: _llamacpp_terms(info, o["tokens"], o["context"]), ("tokens", "new_tokens"),
                         in_process=False),
}
"""Memory-plan rule name -> :class:`PlanRule` (the registry rows' ``memory_rule``)."""


def _rule_of(engine: str) -> PlanRule | None:
    """The plan rule of engine kind ``engine`` (its registry row's ``memory_rule``), None for one without."""
    row = KIND.get(engine)
    return PLAN_RULES.get(row.memory_rule) if row is not None and row.memory_rule else None


def _terms(engine: str, info: ModelInfo, o: dict[str, Any]) -> tuple[dict[str, int], int]:
    rule = _rule_of(engine)
    if rule is None:
        raise InputError(f"memory plan: unknown engine {engine!r} (expected one of {', '.join(ENGINES)})")
    return rule.terms(info, o)


def _options(engine: str, info: ModelInfo, options: Mapping[str, Any]) -> dict[str, Any]:
    o = {"tokens": 16, "new_tokens": 0, "batch": 1, "dtype": "float32", "weights": "dequantized",
         "cache_bytes": DEFAULT_CACHE_BYTES, "device": "cpu", "forwards": None, "held": 0,
         "fresh": False, "layer_held": False}
    unknown = set(options) - set(o)
    if unknown:
        raise TypeError(f"plan(): unknown option {sorted(unknown)[0]!r}")
    o.update({k: v for k, v in options.items() if v is not None})
    o["context"] = o["tokens"] + o["new_tokens"]
    o["forwards"] = o["forwards"] or 1 + o["new_tokens"]
    if o["dtype"] not in DTYPE_BYTES:
        raise InputError(f"memory plan: dtype {o['dtype']!r}: expected one of {', '.join(DTYPE_BYTES)}")
    rule = _rule_of(engine)
    o["shown"] = {k: o[k] for k in (rule.shown if rule else ())}
    return o


def _threads_to_start(started: bool) -> int:
    """torch intra-op threads still to start: ``$OMP_NUM_THREADS`` or the CPUs this process may use, less the
    main thread; none once the engine has run torch ops (``started``: it holds built weights)."""
    if started:
        return 0
    try:
        want = int(os.environ.get("OMP_NUM_THREADS") or 0) or len(os.sched_getaffinity(0))
    except ValueError:
        want = os.cpu_count() or 1
    return max(0, want - 1)


def _need(engine: str, info: ModelInfo, o: dict[str, Any]) -> tuple[int, dict[str, int], int]:
    """``(need, breakdown, already)``: ``already`` is the part of the need this process holds or has mapped
    before the engine allocates anything: the runtime of an engine that runs in this process (it is
    running), against ``RLIMIT_AS`` the packed weights mapped from the file, and what the engine says it
    holds already (option ``held``: weights built, a cache filled). A loaded fast engine's ``held`` weights
    include its packed ones, the bytes ``RLIMIT_AS`` counts as mapped: they count once."""
    terms, mapped = _terms(engine, info, o)
    rule = _rule_of(engine)
    if o["source"] == "RLIMIT_AS" and rule.torch:
        terms["threads (address space)"] = THREAD_ADDRESS_BYTES * _threads_to_start(o["held"] > 0)
    in_process = rule.in_process and not o["fresh"]
    mapped = mapped if o["source"] == "RLIMIT_AS" else 0
    already = min(sum(terms.values()), (terms["runtime"] if in_process else 0) + max(mapped, int(o["held"])))
    return sum(terms.values()), terms, already


def _fits(need: int, already: int, avail: int | None) -> bool:
    return avail is None or need - already <= avail


def _advice(engine: str, info: ModelInfo, o: dict[str, Any], avail: int, source: str) -> list[str]:
    """Options that would make the plan fit, each checked with the same estimate."""
    out = []

    def fits_with(**change) -> bool:
        need, _, already = _need(engine, info, {**o, **change})
        return _fits(need, already, avail)

    if engine == "fast" and info.form == "gguf" and o["weights"] == "dequantized" and any(
            len(t.shape) == 2 and t.dtype not in _UNPACKED for t in info.tensors.values()) \
            and fits_with(weights="packed"):
        out.append("--weights packed")
    if engine == "fast" and o["dtype"] == "float32" and fits_with(dtype="bfloat16"):
        out.append("--dtype bfloat16")
    if engine == "reference" and o["forwards"] > 1 and o["cache_bytes"] > 0:
        for gb in (1.0, 0.5, 0.25, 0.0):
            if gb * GB < o["cache_bytes"] and fits_with(cache_bytes=int(gb * GB)):
                out.append(f"--ref-cache-gb {gb:g}")
                break
    if info.cfg.n_layer > 1:
        best = 0
        for n in range(info.cfg.n_layer - 1, 0, -1):
            need, _, already = _need(engine, info.cut(n), o)
            if _fits(need, already, avail):
                best = n
                break
        if best:
            out.append(f"--layers {best}")
    if o["tokens"] + o["new_tokens"] > 16 and fits_with(tokens=16, new_tokens=0):
        out.append("a shorter prompt")
    return out


def plan(engine: str, info: ModelInfo, **options: Any) -> MemoryPlan:
    """Estimate the memory ``engine`` needs for ``info``'s model, and compare it with what is available.

    Args:
        engine: ``reference`` | ``fast`` | ``transformers`` | ``llamacpp``.
        info: the model (:func:`model_info`).
        options: ``tokens`` (prompt length, default 16), ``new_tokens`` (generated, 0), ``batch`` (1),
            ``dtype`` (fast: ``float32``/``bfloat16``/``float16``), ``weights`` (fast:
            ``dequantized``/``packed``), ``cache_bytes`` (reference: ``--ref-cache-gb`` in bytes),
            ``forwards`` (reference: forward passes over the weights; default ``1 + new_tokens``),
            ``layer_held`` (reference: a layer-outer pass, :func:`reference.batch.forward_chains`, which holds
            every tensor of one layer at once; then ``tokens`` counts the tokens of every call),
            ``device`` (``cpu`` or ``cuda[:N]``), ``held`` (bytes of the need the engine holds already:
            a loaded engine that plans its next call passes its built weights, packed ones included, or its
            filled cache, which are then no longer counted as still to allocate), ``fresh`` (True: the
            engine will run in a new process, as ``g4h inspect`` plans it: its runtime is still to allocate,
            and against ``RLIMIT_AS`` the whole limit is its own).

    Returns:
        A :class:`MemoryPlan`. Where each term comes from (``breakdown`` keys):

        * ``runtime``: the interpreter and the libraries the engine imports (:data:`RUNTIME_BYTES`).
        * reference ``weight cache``: ``min(cache_bytes, float64 bytes of every tensor read whole)``
          when the weights are read more than once (a single forward caches nothing: see
          :class:`reference.weights.Weights`); ``weights in use``: the largest set of tensors the
          forward holds at once, in float64 (one matrix; a MoE layer's two expert stacks; with ``layer_held``
          the largest layer's tensors), plus the
          float32 temporaries of reading it; ``LM head block``: one block of vocabulary rows
          (:func:`reference.weights.block_bounds`) in float64 and gguf's two float32 arrays;
          ``logits``: ``[T, V]`` float64 three times; ``KV cache``: float64 K and V of every
          KV-owning layer for the whole context (the reference masks, it does not evict);
          ``activations``: the hidden stream, the PLE inputs and one layer's attention scores.
        * fast ``weights``: every tensor in the compute dtype (1-D tensors float32); ``packed weights``:
          with ``--weights packed`` the GGUF bytes of quantized matrices, and on the CPU of MoE expert stacks
          (mapped from the file:
          RAM, not address space); ``largest tensor in conversion``: what converting one tensor holds
          beside the weights already made (a copy of its GGUF bytes; its float32 form when the
          compute dtype is another, or a float32 copy of a float tensor); ``KV cache``: float32, sliding
          layers at most their window, shared layers none (:mod:`fast.kvcache`); ``logits``:
          float32 on the device and the float64 copy returned.
        * transformers ``weights``: every parameter in fp32 (the oracle's dtype); ``largest tensor in
          conversion``: its stored bytes and fp32 form; ``KV cache``: fp32, sliding layers at most
          their window; ``activations``: eager attention's ``[H, T, S]`` scores among them.
        * fast and transformers against ``RLIMIT_AS`` only: ``threads (address space)``, the torch threads
          still to start (:data:`THREAD_ADDRESS_BYTES` each).
        * llamacpp ``model file (mapped)``: the GGUF, which llama.cpp maps whole; ``KV cache``:
          F32 (the harness's llama.cpp setting) for every KV-owning layer; ``compute buffer``:
          one micro-batch of at most 512 tokens through the widest layer and the head.

        On CUDA the need is the device part and ``available`` is the free device memory.

    Raises:
        InputError: unknown engine or dtype.
        TypeError: an unknown option.
    """
    o = _options(engine, info, options)
    rule = _rule_of(engine)
    avail, source = available_memory(o["device"] if rule and rule.torch else "cpu",
                                     own_process=(rule is None or rule.in_process) and not o["fresh"])
    o["source"] = source
    need, terms, already = _need(engine, info, o)
    fits = _fits(need, already, avail)
    advice = [] if fits or avail is None else _advice(engine, info, o, avail, source)
    return MemoryPlan(engine=engine, model=info.path, options=o["shown"], need_bytes=need, breakdown=terms,
                      already_bytes=already, available_bytes=None if avail is None else avail + already,
                      available_from=source, fits=fits, advice=advice)


def require(engine: str, info: ModelInfo, **options: Any) -> MemoryPlan:
    """:func:`plan`, and stop when it does not fit.

    Raises:
        NotEnoughMemory: one line (:meth:`MemoryPlan.line`).
    """
    p = plan(engine, info, **options)
    if not p.fits:
        raise NotEnoughMemory(p.line())
    return p


# --------------------------------------------------------------------------- allocation failures


def is_out_of_memory(exc: BaseException) -> bool:
    """True for an allocation failure: ``MemoryError`` (numpy's ``_ArrayMemoryError`` is one), torch's
    ``OutOfMemoryError``, or a torch allocator ``RuntimeError`` (``DefaultCPUAllocator: can't allocate
    memory``, ``CUDA out of memory``)."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc)
        return any(s in text for s in ("can't allocate memory", "CUDA out of memory", "not enough memory",
                                       "out of memory"))
    return False


def failure_line(engine: Any, exc: BaseException) -> str:
    """One line for an allocation failure inside ``engine`` (its last plan's figures when it made one)."""
    p: MemoryPlan | None = getattr(engine, "memory_plan", None)
    what = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
    if p is None:
        return (f"out of memory in the {getattr(engine, 'engine', 'engine')} engine ({what}); try --weights packed, "
                "a smaller --ref-cache-gb, --layers N or --dtype bfloat16")
    avail = "unknown" if p.available_bytes is None else f"{p.available_bytes / GB:.1f} GB"
    rule = _rule_of(p.engine)
    advice = p.advice or list(rule.oom_advice if rule else ("--layers N",))
    return (f"{p.model}: out of memory in the {p.engine} engine ({what}): the estimate was "
            f"{p.need_bytes / GB:.1f} GB, {avail} available ({p.available_from}); try " + " or ".join(advice))


def guarded(method: Callable) -> Callable:
    """Decorator for engine methods: an allocation failure becomes :class:`NotEnoughMemory` (one line).

    The engine's ``memory_plan`` attribute (its last :class:`MemoryPlan`), when set, gives the figures.
    """

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - only allocation failures are converted; the rest re-raised
            if not is_out_of_memory(e):
                raise
            line = failure_line(self, e)
        raise NotEnoughMemory(line)  # outside the except block: the failed frames are released first

    return wrapper


# --------------------------------------------------------------------------- measuring


class PeakMemory:
    """Peak resident memory of a process, sampled from ``/proc/<pid>/status`` by a background thread.

    ``peak_rss`` is the largest ``VmRSS`` seen (all resident pages, mapped files included) and
    ``peak_anon`` the largest ``RssAnon`` (private memory: what the process allocated, not the
    page cache of a mapped model file). Both are also read once at start and stop, so a run
    shorter than the interval still has figures. Use as a context manager::

        with PeakMemory() as pm:
            run()
        pm.peak_anon, pm.peak_rss   # bytes

    Args:
        pid: the process (default this one).
        interval: seconds between samples (default 0.01).
    """

    def __init__(self, pid: int | str = "self", interval: float = 0.01):
        self.pid = pid
        self.interval = interval
        self.peak_rss = 0
        self.peak_anon = 0
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def sample(self) -> None:
        """Read the fields once and keep the maxima."""
        rss, anon = _status("VmRSS", self.pid), _status("RssAnon", self.pid)
        self.peak_rss = max(self.peak_rss, rss or 0)
        self.peak_anon = max(self.peak_anon, anon or 0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> "PeakMemory":
        """Start sampling."""
        self._t0 = time.perf_counter()
        self.sample()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> "PeakMemory":
        """Stop sampling (one last sample)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
        self.seconds = time.perf_counter() - self._t0
        return self

    def __enter__(self) -> "PeakMemory":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def as_dict(self) -> dict[str, float]:
        """``{"wall_s", "peak_rss_gb", "peak_anon_gb"}`` (GB = 10^9 bytes)."""
        return {"wall_s": round(self.seconds, 2), "peak_rss_gb": round(self.peak_rss / GB, 3),
                "peak_anon_gb": round(self.peak_anon / GB, 3)}
