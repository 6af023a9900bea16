"""The ``fast`` engine: the torch twin of the reference (:mod:`fast`), on any device and dtype."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch

from gemma4_harness.fast import cpu_kernels
from gemma4_harness.fast.drafter import FastDrafter
from gemma4_harness.fast.engine import PromptRun, Request, all_finite, generate, prompt_runs
from gemma4_harness.fast.model import FastModel, SeqStep
from gemma4_harness.fast.q8_compute import COMPUTE_MODES, dense_types, q8_compute
from gemma4_harness.fast.speculative import (
                              ModelProposer,
                              OracleProposer,
                              PartialProposer,
                              Proposer,
                              RandomProposer,
                              SpecEngine,
                              SpecResult,
                              plain_continuations,
)
from gemma4_harness.fast.static_decode import StaticDecoder
from gemma4_harness.reference.drafter import bind
from gemma4_harness.reference.drafter_weights import load_drafter
from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.model import check_prompt
from gemma4_harness.reference.weights import load_model

from ..core import memory
from ..core.engine_kinds import KIND
from ..core.workers import EngineOutputError
from .base import DTYPE_BYTES, TOP_N, TraceFn, bench_ids
from .numerics import Numerics

WEIGHT_MODES = KIND["fast"].weights
"""``--weights``: GGUF quantized matrices kept packed (dequantized on the fly), or dequantized at load (the
registry row's :attr:`~harness.core.engine_kinds.EngineKind.weights`)."""

DENSE_TYPES = ("F32", "F16", "BF16")
"""GGUF tensor types that are not block-quantized: nothing to keep packed."""


def default_weight_mode(W) -> str:
    """The weight mode when ``--weights`` is not given: ``packed`` for a GGUF that holds block-quantized
    matrices (Q8_0, Q4_K ...), ``dequantized`` for anything else (F32/F16/BF16 GGUFs, HF safetensors,
    a shape-only model's float random weights), where there is nothing to keep packed.

    Args:
        W: the loader's weights (:class:`reference.weights.Weights`) or :class:`fast.shapes.RandomWeights`.
    """
    if hasattr(W, "torch_tensor"):  # a shape-only model: packed when drawn as GGUF blocks (--quant)
        return "packed" if getattr(W, "qtype", None) else "dequantized"
    if not hasattr(W, "stored"):
        return "dequantized"
    for name in W:
        if len(W.shape(name)) == 2 and W.raw_dtype(name) not in DENSE_TYPES and W.stored(name) is not None:
            return "packed"
    return "dequantized"


class FastEngine:
    """The torch fast path (:mod:`fast`), on a chosen device and dtype.

    Args:
        path: ``.gguf`` file or HF folder (same loader as the reference).
        device: ``cpu`` / ``cuda`` / None (cuda when present).
        dtype: ``float32`` / ``bfloat16`` / ``float16``.
        batched: ``generate`` serves all prompts through one continuous batch (else one at a time).
        weights: ``packed`` keeps GGUF quantized matrices packed on the device and dequantizes them
            on the fly (on the CPU: views of the memory-mapped file, multiplied and gathered by the packed
            kernels of :mod:`fast.quant_kernels`); ``dequantized`` decodes them once at load
            (:data:`WEIGHT_MODES`); None: :func:`default_weight_mode` (packed for a quantized GGUF).
        layers: ``--layers N``: only the first N layers (:func:`reference.config.cut_layers`).
        compute: ``--compute``: ``exact`` (the default: fp32 products of the exact weights) or ``q8``
            (llama.cpp's CPU arithmetic: every product with a quantized or 16-bit weight takes its input rounded to
            the weight type's dot-product type, Q8_0/Q4_0/Q5_0 products as int8 integer dot products in C;
            :mod:`fast.q8_compute`). In ``q8`` the engine declares ``quantized_activations`` (:attr:`numerics`),
            so the harness judges it against the emulating reference, as it judges llama.cpp.

    The weights are planned before they are built (:func:`harness.core.memory.require`); a plan that
    does not fit, or an allocation that fails anyway, stops with one line
    (:class:`harness.core.memory.NotEnoughMemory`).

    Raises:
        InputError: bad model file, device, dtype, weight mode or ``layers``.
        NotEnoughMemory: the model cannot run in the memory available (one line).
    """

    engine = "fast"
    check_output = True  # False: the bench engine fast-unchecked (the cost of the output check, measured)
    static = False  # True: the bench engine fast-graph (from_model(static=True))
    _decoder = None  # fast-graph: ((batch, max_len), StaticDecoder) kept between repetitions
    max_batch = None
    kv_elem = 4.0
    memory_plan: memory.MemoryPlan | None = None

    @memory.guarded
    def __init__(self, path: str | Path, device: str | None = None, dtype: str = "float32", batched: bool = False,
                 weights: str | None = None, layers: int | None = None, compute: str | None = None):
        cfg, W = load_model(path, layers=layers, cache_bytes=0)
        self._init(cfg, W, device, dtype, batched, weights, compute=compute)

    @classmethod
    def from_model(cls, cfg, W, device: str | None = None, dtype: str = "float32", batched: bool = False,
                   weights: str | None = None, static: bool = False, share: "FastEngine | None" = None,
                   compute: str | None = None) -> "FastEngine":
        """An engine over an already loaded ``(cfg, W)``: a file's (:func:`reference.weights.load_model`)
        or a shape-only model's random weights (:class:`fast.shapes.RandomWeights`).

        ``static``: the bench engine ``fast-graph``: its ``tg`` runs through
        :class:`fast.static_decode.StaticDecoder` (one CUDA graph a step on a GPU); it times ``tg`` only.
        ``share``: an engine over the same ``(cfg, W)`` whose built weights this one uses too (the bench's ``fast``
        beside ``fast-graph``: one copy of a 31B model on the device, not two, and both read the same bytes);
        its device, dtype and weight mode must be this engine's."""
        eng = cls.__new__(cls)
        memory.guarded(cls._init)(eng, cfg, W, device, dtype, batched, weights, share, compute)  # as __init__: one line
        if static:
            eng.engine, eng.tests, eng.static = "fast-graph", ("tg",), True
        return eng

    def _init(self, cfg, W, device, dtype, batched, weights, share: "FastEngine | None" = None,
              compute: str | None = None) -> None:
        compute = compute or "exact"
        if compute not in COMPUTE_MODES:
            raise InputError(f"--compute {compute!r}: expected one of {', '.join(COMPUTE_MODES)}")
        if compute == "q8" and dtype != "float32":
            raise InputError(f"--compute q8 with --dtype {dtype}: llama.cpp's arithmetic keeps float32 activations "
                             "(leave out --dtype, or --compute exact)")
        if weights is None:
            weights = default_weight_mode(W)
        if weights not in WEIGHT_MODES:
            raise InputError(f"--weights {weights!r}: expected one of {', '.join(WEIGHT_MODES)}")
        if dtype not in memory.DTYPE_BYTES:
            raise InputError(f"--dtype {dtype!r}: expected float32, bfloat16 or float16")
        self._info = memory.ModelInfo.from_loaded(getattr(W, "source", cfg.source), cfg, W)
        self._device_name = str(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self._held = 0
        if share is not None:
            if (share.dtype, share.weights, share._device_name) != (dtype, weights, self._device_name):
                raise ValueError(f"share: an engine of {share.dtype}/{share.weights}/{share._device_name}, expected "
                                 f"{dtype}/{weights}/{self._device_name}")
            self._held = share._held
        self._plan(1, 0, 1, dtype, weights)
        self.model = share.model if share is not None else FastModel(cfg, W, device, dtype,
                                                                     keep_quantized=weights == "packed")
        built = self.memory_plan.breakdown
        self._held = built["weights"] + built["packed weights"]  # built now: later plans ask only for what is new
        self.cfg = cfg
        self.batched = batched
        self.dtype = dtype
        self.weights = weights
        self.compute = compute
        self._loaded = W  # the loader's weights: their stored types, read when a forward first computes in q8
        self._q8_dense = dense_types(self.model, W) if compute == "q8" else None
        self.name = f"fast-{self.model.device.type}-{dtype}" + ("-q8" if compute == "q8" else "") + (
            "-batched" if batched else "")

    @property
    def numerics(self) -> Numerics | None:
        """What it declares (:func:`harness.engines.numerics.engine_numerics`): under ``--compute q8``, llama.cpp's
        ``quantized_activations`` with llama.cpp's dot-product types (the emulating reference judges it, as it judges
        the ``llamacpp`` engine); None otherwise (exact in its dtype)."""
        if self.compute != "q8":
            return None
        return Numerics("float32", None, ("quantized_activations",), "the fast engine, --compute q8", "llama.cpp")

    def _arith(self):
        """The context its forwards run in: :func:`fast.q8_compute.q8_compute` under ``--compute q8``."""
        return self.computing(self.compute)

    def computing(self, compute: str) -> contextlib.AbstractContextManager:
        """The context in which this engine's forwards compute as ``compute`` (:data:`COMPUTE_MODES`) whatever its own
        ``--compute``: for ``q8``, :func:`fast.q8_compute.q8_compute` with the types of this model's dense matrices
        (:func:`fast.q8_compute.dense_types`, read once); for ``exact``, nothing (an engine built with ``q8`` still
        computes in q8 inside its own calls). ``g4h parity --oracle fast`` runs its oracle's forwards of an
        emulation that holds ``quantized_activations`` in it (:meth:`harness.parity.checks.reference_runs.
        ReferenceRuns.numerics`): llama.cpp's arithmetic, the emulation the reference makes in float64.

        Raises:
            InputError: an unknown mode.
        """
        if compute not in COMPUTE_MODES:
            raise InputError(f"--compute {compute!r}: expected one of {', '.join(COMPUTE_MODES)}")
        if compute != "q8":
            return contextlib.nullcontext()
        if self._q8_dense is None:
            self._q8_dense = dense_types(self.model, self._loaded)
        return q8_compute(self._q8_dense)

    def _plan(self, tokens: int, new_tokens: int, batch: int, dtype: str | None = None,
              weights: str | None = None) -> None:
        """Plan the weights and one step of ``batch`` x ``tokens`` (+ ``new_tokens``); stop when it cannot fit."""
        self.memory_plan = memory.require("fast", self._info, tokens=tokens, new_tokens=new_tokens, batch=batch,
                                          dtype=dtype or self.dtype, weights=weights or self.weights,
                                          device=self._device_name, held=self._held)

    def plan_ahead(self, tokens: int) -> None:
        """Plan now the largest call a job will make, a prefill of ``tokens`` positions with its greedy or forced
        tokens counted in (:meth:`prompt_runs` plans the same), so that a job that cannot make it stops before
        its work rather than after (:class:`harness.core.memory.NotEnoughMemory`, one line)."""
        self._plan(max(tokens, 1), 0, 1)

    @memory.guarded
    def logits(self, ids: Sequence[int], trace: TraceFn | None = None, chunk: int | None = None,
               layer_inputs: Mapping[int, np.ndarray] | None = None) -> np.ndarray:
        """float32 logits as float64 ``[T, V]`` (one-shot prefill, or in chunks of ``chunk``). ``layer_inputs``: a
        re-seeded forward (:meth:`fast.model.FastModel.step`; ``--oracle fast``'s per-layer gate)."""
        self._plan(len(ids), 0, 1)
        with self._arith():
            return self.model.logits(ids, chunk=chunk, trace=trace,
                                     layer_inputs=layer_inputs).double().cpu().numpy()

    @memory.guarded
    def logits_cached(self, ids: Sequence[int], prefill: int) -> np.ndarray:
        """float32 logits as float64 ``[len(ids), V]`` computed as an engine computes a stream: a prefill of the first
        ``prefill`` ids, then one decode step per id over the KV cache (llama.cpp's flash attention takes another
        kernel for a call of fewer than 64 query rows: ``harness.engines.llamacpp.numerics.attention_flash_fp16``).
        The reference's :meth:`harness.engines.reference.ReferenceEngine.logits_cached`; ``--oracle fast``'s
        ``ReferenceRuns.decoded_logits``.

        Raises:
            PromptError: see :func:`reference.model.check_prompt`.
        """
        ids_np = np.asarray(list(ids), dtype=np.int64)
        check_prompt(self.cfg, ids_np)
        self._plan(len(ids_np), 0, 1)
        m, prefill = self.model, max(1, min(int(prefill), len(ids_np)))
        cache = m.new_cache(1, len(ids_np), bounded=True)  # rings as long as the stream, not the window
        slot = cache.alloc()
        out = []
        with self._arith(), torch.inference_mode():
            out.append(m.step(cache, [SeqStep(slot, torch.from_numpy(ids_np[:prefill]), 0)], all_logits=True))
            for i in range(prefill, len(ids_np)):
                out.append(m.step(cache, [SeqStep(slot, torch.from_numpy(ids_np[i:i + 1]), i)], all_logits=True))
        return torch.cat(out).double().cpu().numpy()

    @memory.guarded
    def prompt_runs(self, prompts: Sequence[Sequence[int]], traces: Sequence[TraceFn | None] | None = None,
                    new_tokens: int = 0, forced: Sequence[Sequence[int]] | None = None,
                    top_n: int = TOP_N) -> list[PromptRun]:
        """Each prompt's logits (traced), then a greedy stream or teacher-forced logits from the same cache
        (:func:`fast.engine.prompt_runs`: a job's oracle work without a second prefill; streams of 8 prompts
        decode together). The memory plan is the largest prefill's (its ``[T, V]`` logits dwarf the group's
        KV cache)."""
        longest = max((len(p) + max(new_tokens, len(forced[k]) if forced else 0) for k, p in enumerate(prompts)),
                      default=1)
        self._plan(longest, 0, 1)
        with self._arith():
            return prompt_runs(self.model, prompts, traces, new_tokens, forced, top_n, check_finite=self.check_output)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuations; one continuous batch when ``batched``."""
        return [r.tokens for r in self.generate_full(prompts, max_new_tokens)]

    @memory.guarded
    def generate_full(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, top_n: int = TOP_N):
        """Like :meth:`generate` but returns :class:`fast.engine.Result` (tokens and the top-``top_n`` logprobs)."""
        self._plan(max((len(p) for p in prompts), default=1), max_new_tokens, len(prompts) if self.batched else 1)
        with self._arith():
            return generate(self.model, prompts, max_new_tokens, batched=self.batched, top_n=top_n,
                            check_finite=self.check_output)

    # ------------------------------------------------------------------ speculative decoding

    def proposer(self, draft: str, requests: Sequence[Request]) -> Proposer:
        """The drafter named by ``--draft-model``: ``oracle`` (the target's own greedy tokens, from a plain run of
        ``requests``), ``random``, ``partial:J`` (right for J tokens of every round, then wrong), or the path of a
        Gemma 4 assistant (HF folder or ``gemma4-assistant`` GGUF), bound to this engine's model.

        Raises:
            InputError: a bad ``partial:J``; a drafter file that cannot be read or does not fit the target (one line).
        """
        if draft == "oracle":
            return OracleProposer(plain_continuations(self.model, requests))
        if draft == "random":
            return RandomProposer(self.cfg.vocab_size)
        if draft.startswith("partial:"):
            try:
                j = int(draft.split(":", 1)[1])
            except ValueError:
                j = -1
            if j < 0:
                raise InputError(f"--draft-model {draft!r}: expected partial:J with J >= 0 correct tokens per round")
            return PartialProposer(plain_continuations(self.model, requests), j, self.cfg.vocab_size)
        d, DW = load_drafter(draft)
        return ModelProposer(FastDrafter(bind(d, self.cfg), DW, self.model), Path(draft).name)

    def generate_speculative(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, draft: str,
                             k: int = 4) -> list[SpecResult]:
        """Speculative greedy continuations (:class:`fast.speculative.SpecEngine`; one continuous batch when
        ``batched``): the same tokens as :meth:`generate_full`, plus each request's ``stats``.

        Raises:
            InputError: see :meth:`proposer`; ``k`` < 1.
        """
        reqs = [Request(str(i), list(p), max_new_tokens) for i, p in enumerate(prompts)]
        proposer = self.proposer(draft, reqs)
        longest = max(len(p) for p in prompts) + max_new_tokens
        eng = SpecEngine(self.model, proposer, k, max_batch=8 if self.batched else 1, max_tokens=longest)
        res = eng.run(reqs)
        return [res[r.id] for r in reqs]

    # ------------------------------------------------------------------ bench (harness.engines.base.Benchable)

    def elem_bytes(self, name: str) -> float:
        """Bytes per element of ``name`` as held: the dtype's size, or a packed tensor's bytes per element."""
        t = self.model.w[name] if name in self.model.w else None
        if t is None:
            return float(DTYPE_BYTES[self.dtype])
        if isinstance(t, torch.Tensor):
            return float(t.element_size())
        return float(t.nbytes) / float(np.prod(t.shape))

    def _sync(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()

    def _prepare(self, depth: int, batch: int, extra: int):
        cache = self.model.new_cache(batch, depth + extra + 1)
        slots = [cache.alloc() for _ in range(batch)]
        ctx = bench_ids(self.cfg.vocab_size, depth, 1) if depth else []
        chunk = 512
        with torch.inference_mode():
            for s0 in range(0, depth, chunk):
                part = torch.tensor(ctx[s0:s0 + chunk])
                self.model.step(cache, [SeqStep(s, part, s0) for s in slots])
        self._sync()
        return cache, slots

    def _static_time(self, n: int, depth: int, batch: int) -> float:
        """One ``tg`` repetition of ``fast-graph``: the context (``depth`` tokens a row) prefilled untimed, then
        ``n`` steps, each row's argmax fed back on the device (no host read between steps). The decoder, and on
        CUDA its captured graph, is kept for the next repetition of the same shape (the warm-up captures it)."""
        key = (batch, depth + n + 1)
        if self._decoder is None or self._decoder[0] != key:
            self._decoder = None  # free the old cache before the new one is made
            self._plan(depth + n, n, batch)
            self._decoder = (key, StaticDecoder(self.model, batch, depth + n + 1))
        dec = self._decoder[1]
        with torch.no_grad():
            if depth:
                logits = dec.prefill([bench_ids(self.cfg.vocab_size, depth, 1)] * batch)
            else:
                dec.reset()
            toks = torch.tensor(bench_ids(self.cfg.vocab_size, batch, 7), device=self.model.device)
            ok = torch.ones((), dtype=torch.bool, device=self.model.device)
            self._sync()
            t = time.perf_counter()
            for _ in range(n):
                logits = dec.decode(toks)
                if self.check_output:  # on the device, read back once: no host sync between steps
                    ok &= all_finite(logits)
                toks = logits.argmax(-1)
            self._sync()
            secs = time.perf_counter() - t
            self._check_bench(ok, "tg", n, depth, batch)
            return secs

    def _check_bench(self, ok: torch.Tensor, test: str, n: int, depth: int, batch: int) -> None:
        """A timed run whose logits were not all finite is no figure: :class:`EngineOutputError`."""
        if not bool(ok):
            raise EngineOutputError(f"{self.name}: non-finite logits in {test}{n} at depth {depth}, batch {batch}")

    def bench_time(self, test: str, n: int, depth: int, batch: int) -> float:
        """One ``pp``/``tg`` repetition over the paged KV cache (see :class:`harness.engines.base.Benchable`);
        ``fast-graph``'s ``tg`` over the static decoder (:meth:`_static_time`)."""
        if self.static and test == "tg":
            return self._static_time(n, depth, batch)
        with self._arith():
            return self._bench_time(test, n, depth, batch)

    def _bench_time(self, test: str, n: int, depth: int, batch: int) -> float:
        cache, slots = self._prepare(depth, batch, n)
        with torch.inference_mode():
            if test == "pp":
                seqs = [SeqStep(s, torch.tensor(bench_ids(self.cfg.vocab_size, n, 100 + i)), depth)
                        for i, s in enumerate(slots)]
                t = time.perf_counter()
                self.model.step(cache, seqs)
                self._sync()
                return time.perf_counter() - t
            toks = torch.tensor(bench_ids(self.cfg.vocab_size, batch, 7))
            ok = torch.ones((), dtype=torch.bool, device=self.model.device)
            t = time.perf_counter()
            for k in range(n):
                logits = self.model.step(cache, [SeqStep(s, toks[i:i + 1], depth + k) for i, s in enumerate(slots)])
                both = cpu_kernels.argmax_f32(logits)  # on the CPU: the pick and the check in one pass
                if both is not None:  # (fast-unchecked takes the same pass and ignores the check)
                    toks, fin = both
                    if self.check_output:
                        ok &= fin
                    continue
                if self.check_output:  # the decode loop's output check (fast.engine), as generation runs it
                    ok &= all_finite(logits)
                toks = logits.argmax(-1).cpu()
            self._sync()
            secs = time.perf_counter() - t
            self._check_bench(ok, "tg", n, depth, batch)
            return secs

    def close(self) -> None:
        """Drop the model (and a ``fast-graph`` decoder's cache and graph)."""
        self.model = None
        self._decoder = None
