"""Memory: what an engine will need for a model, against what this machine has, and a clear stop when it is short.

* :func:`model_info` / :meth:`~.memory_facts.ModelInfo.from_loaded`: the facts an estimate needs, from the config
  and the GGUF tensor table or the safetensors headers only (no tensor is read: :mod:`.memory_facts`).
* :func:`plan` -> :class:`MemoryPlan`: the bytes one engine needs for that model, dtype, weight mode
  and context, term by term (its rule in :data:`.memory_rules.PLAN_RULES`), against
  :func:`.memory_machine.available_memory`; :meth:`MemoryPlan.line` says it in one line with what to try.
  ``g4h inspect`` calls :func:`plan` once per engine.
* :func:`require` raises :class:`NotEnoughMemory` (an :class:`~reference.errors.InputError`: one line,
  exit 2) when the plan does not fit; :func:`guarded` turns an allocation failure inside an engine
  method (``MemoryError``, numpy's ``_ArrayMemoryError``, torch's ``OutOfMemoryError`` or CPU
  allocator ``RuntimeError``) into the same kind of line.
* What the machine has and the peak a process used (:class:`~.memory_machine.PeakMemory`, benchmarks and the scale
  measurements): :mod:`.memory_machine`.

Units: bytes; ``GB`` = 10^9 bytes in every message.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.weights import DEFAULT_CACHE_BYTES, load_model

from .engine_kinds import KIND, planned_kinds
from .memory_facts import GB, ModelInfo
from .memory_machine import available_memory
from .memory_rules import DTYPE_BYTES, PLAN_RULES, UNPACKED, PlanRule

#: Address space one more torch intra-op (OpenMP) thread takes: its 8 MiB stack, the 64 MiB malloc arena glibc
#: reserves for it, OpenMP's own. Measured: ``VmSize`` grows by 96 MiB at torch's first parallel op with one
#: thread beside the main one (torch 2.13 CPU, glibc 2.36). Counted only against ``RLIMIT_AS``: an address-space
#: limit that leaves no room for it makes libgomp end the process ("Thread creation failed"), which no
#: ``except`` can catch.
THREAD_ADDRESS_BYTES = 100 * 2**20


ENGINES = planned_kinds()
"""The engines whose memory is planned: the registry rows with a ``memory_rule`` (:mod:`harness.core.engine_kinds`);
each names its rule in :data:`PLAN_RULES`."""


class NotEnoughMemory(InputError):
    """The engine would not fit in the memory available (or an allocation failed): one line, exit 2."""


def model_info(path: str | os.PathLike, layers: int | None = None) -> ModelInfo:
    """:class:`ModelInfo` of a GGUF file or HF folder, from its metadata and tensor table only.

    Raises:
        InputError: the loader's errors (bad file, key, tensor; ``layers`` out of range).
    """
    cfg, W = load_model(path, layers=layers, cache_bytes=0)
    return ModelInfo.from_loaded(path, cfg, W)


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

    row = KIND[engine]  # the options it takes (its registry row): the settings worth trying
    if "packed" in row.weights and info.form == "gguf" and o["weights"] == "dequantized" and any(
            len(t.shape) == 2 and t.dtype not in UNPACKED for t in info.tensors.values()) \
            and fits_with(weights="packed"):
        out.append("--weights packed")
    if "bfloat16" in row.dtypes and "dtype" in row.options and o["dtype"] == "float32" \
            and fits_with(dtype="bfloat16"):
        out.append("--dtype bfloat16")
    if "cache_gb" in row.options and o["forwards"] > 1 and o["cache_bytes"] > 0:
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
            every tensor of one layer at once, of its expert stacks one expert each; then ``tokens`` counts the
            tokens of every call),
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
          the largest layer's tensors, of its expert stacks one expert each), plus the
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

