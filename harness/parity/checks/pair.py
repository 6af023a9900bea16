"""The reference against one engine on a user's model (``g4h parity --model M --against NAME``).

Any engine can be the other side: ``fast``, ``transformers``, ``llamacpp``, ``cmd:...`` and every scheme of
:data:`harness.engines.ENGINE_SCHEMES`. The pair is named ``reference~<kind>`` (:func:`pair_name`; a 16-bit
engine gets ``reference~<kind>_bf16``) and its gates are ``<pair>.<metric>`` in :mod:`harness.core.gates`.
With ``--oracle fast`` the fast engine in fp32 stands in for the reference (:data:`ORACLES`, for speed on a big
model): the pairs are ``fast~<kind>``, judged by the same bounds (:func:`harness.core.gates.oracle_pair_gates`).
What is measured depends on what the engine answers:

* ``<pair>.runs``: 1 when the engine loaded the model and answered as its protocol says; 0 with the reason when
  it could not run (not installed, cannot read this model form), with ``engine_failure`` when the engine failed
  (:class:`~harness.core.workers.EngineFailure`: it crashed, broke its protocol, answered a request wrongly or
  not at all, returned a stream shorter than asked or a token that is not the top-1 of its own log-probs; the
  figure names the request, the step and the engine's last error line; exit 1, "ENGINE FAILED"), or with
  ``bad_input`` when the engine cannot be used as given (a command that cannot be started, a server that is
  down: exit 2);
* logits, per prompt (:func:`harness.parity.compare.logit_figures`): ``.max_abs_logit`` (with the position
  and token of the worst difference), ``.mean_kld``, ``.same_top1_decisive`` (near-ties reported, not failed);
* trace points, per prompt, when the engine traces (a callback in-process, a trace file for ``cmd:``):
  ``.layer_rel_l2``, the worst point, and the first point beyond the gate (:func:`harness.traces.compare.compare`);
* greedy streams of :data:`GREEDY_NEW_TOKENS` tokens (:func:`harness.parity.compare.generation_figures`):
  ``.greedy`` by vLLM's rule, each divergence classified, and ``.max_abs_logprob`` on the agreed prefix.

An engine that declares known approximations (llama.cpp's fp16 GELU table, a 16-bit KV cache, flash attention:
:func:`engine_numerics`, from a ``cmd:`` engine's ``hello``, a server's dialect defaults or ``--declare``) is gated
against a reference that makes the same approximations (:func:`harness.engines.numerics.emulate`); the figures
against the exact reference are kept beside (``vs_exact_reference``).
:data:`EXTRA_CHECKS` lets an engine kind add checks of its own on the same engine (a server's batch
invariance, for instance).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any, Callable, ContextManager, Mapping, Sequence

import numpy as np

from gemma4_harness.reference import batch
from gemma4_harness.reference.errors import InputError

from ...core.gates import DEFAULT_GATES, EFFECT_FACTOR, NEAR_TIE_MARGIN, Q8_LOCAL_ALPHA, effect_limit, pair_name
from ...core.kld import kld_stats
from ...core.metrics import log_softmax
from ...core.workers import EngineFailure, EngineProtocolError, temp_folder
from ...engines import EngineUnavailable, engine_kind, make_engine
from ...engines.base import TOP_N
from ...engines.numerics import KIND_NUMERICS, Numerics, emulable_types, emulate, engine_numerics, effective
from ...engines.openai.http import SERVER_CONTEXT_HINT, ServerContextExceeded
from ...engines.reference import ReferenceEngine
from ...traces.compare import DivergenceRule, compare
from ...traces.format import Trace, TraceWriter, read_trace
from ..compare import generation_figures, logit_figures
from ..explain import decoding_by_logprobs
from ..result import Figure, fig, one_line
from ..skips import skipped
from .oracle_pass import reference_pass

GREEDY_NEW_TOKENS = 8
"""Tokens each greedy stream runs for the ``.greedy`` check (prompts with room for them in the context)."""

QUANTIZED_ACTIVATIONS = (
    "{engine} rounds the activations of matrix products with {types} weights to their dot-product type "
    "(quantized_activations), which the reference cannot emulate here: {why}. Reported, not gated; the pair's mean "
    "KLD is gated instead, at 2 x the KLD an 8-bit rounding of every such product's input causes on this model "
    "(the yardstick, {pair}_q8x.mean_kld)")
"""The reason a pair's figures (all but its mean KLD) are informational when the engine declares
``quantized_activations``, the file holds quantized or 16-bit matrices, and the rounding cannot be emulated
(:meth:`ReferenceRuns.emulation_gap`)."""

YARDSTICK = ("quantized_activations_q8",)
"""The emulation key of the yardstick: every quantized product's input rounded to 8 bits
(:func:`harness.engines.llamacpp.numerics.coarse_q8_numerics`)."""

Q8_REPORTED = ("max_abs_logit", "mean_kld", "max_abs_logprob", "layer_rel_l2")
"""The figures of an emulated pair that are reported, not gated (:data:`Q8_REPORTED_WHY`)."""

Q8_REPORTED_WHY = (
    "reported, not gated: with the quantized activations emulated, what is left is fp32 accumulation (~1e-6) and, "
    "sporadically, an int8 rounding that the engine's fp32 activation takes the other way (an activation within fp32 "
    "noise of a rounding midpoint); one such flip moves everything after it by as much as the rounding itself does "
    "(measured: e2b Q8_0 max |dlogit| 0.35, Gemma 3 270M Q4_K_M 8.4), so the worst figure says nothing about a fault. "
    "Gated instead: local_median where the engine gives its tensors (each layer re-seeded from the engine's stream), "
    "else agreeing_positions (a fault moves every position; a flip only those after it)")

Q8_METRICS = ("max_abs_logit", "mean_kld", "same_top1_decisive", "greedy", "max_abs_logprob", "layer_rel_l2")
"""The metrics judged by ``<pair>_q8.*`` when the engine's quantized activations are emulated on a quantized file."""

LOCAL_POINTS = (("inp_scaled", "inp_per_layer"), ("attn_out", "ffn_mlp", "ffn_moe", "ffn_out", "per_layer_embd_out",
                                                   "l_out"), ("result_norm", "result_output"))
"""The trace points ``local_median`` compares: before the layers (layer -1), in every layer, after them (layer -1)."""


def local_errors(ours: Trace, seeded: Trace, null: Trace, n_layer: int) -> dict[tuple[str, int], tuple[np.ndarray,
                                                                                                      np.ndarray]]:
    """Per trace point ``(point, layer)`` in trace order: the per-position relative L2 of the engine's tensor against
    the re-seeded reference's (:meth:`ReferenceRuns.reseeded`), and of the jittered re-seeded reference's (the null)
    against the same, each float64 ``[T]`` (``||a_t - b_t|| / ||b_t||``; a row of zeros on the reference side: 0
    when the other row is zeros too, else inf). Points that either side lacks, or holds in another shape, are left
    out."""
    before, every, after = LOCAL_POINTS
    keys = ([(p, -1) for p in before] + [(p, il) for il in range(n_layer) for p in every]
            + [(p, -1) for p in after])
    out = {}
    for point, layer in keys:
        a, b, j = ours.tensor(point, layer), seeded.tensor(point, layer), null.tensor(point, layer)
        if a is None or b is None or j is None or a.shape != b.shape or not a.ndim:
            continue
        a, b, j = (np.asarray(x, dtype=np.float64).reshape(x.shape[0], -1) for x in (a, b, j))
        nb = np.linalg.norm(b, axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            errs = [np.where(nb > 0, np.linalg.norm(x - b, axis=1) / nb,
                             np.where(np.linalg.norm(x, axis=1) > 0, np.inf, 0.0)) for x in (a, j)]
        out[(point, layer)] = (np.nan_to_num(errs[0], nan=np.inf), np.nan_to_num(errs[1], nan=np.inf))
    return out


SIXTEEN_BIT = ("bfloat16", "float16")

Progress = Callable[[str], None]

EXTRA_CHECKS: dict[str, Callable[..., list[Figure]]] = {}
"""Engine kind -> ``fn(engine, ref_runs, prompts, pair, progress, extra) -> figures``: more checks on the same
engine, run after the common ones (their gates must exist); ``extra`` is :func:`pair_checks`' ``extra``. Filled by
the module of those checks (:mod:`.server` registers ``openai``)."""

ON_MEASURED: list[Callable[..., None]] = []
"""Called once a pair's figures are measured, with the engine still open: ``fn(runs, eng, kind, pair, prompts,
figures, progress, case)`` may add detail to ``figures`` (:mod:`.explain_pair` names the spec variant that explains a
failing pair). Filled by the module of the hook."""


ORACLES = ("reference", "fast")
"""What ``g4h parity --oracle`` may name: the float64 reference (the default), or the fast engine in fp32 (much
faster on a big model; itself held to the reference by the ``reference~fast`` gates)."""




class ReferenceRuns:
    """The oracle's outputs on one model, computed once per approximation set and shared by every pair.

    Args:
        ref: the reference engine of the model (its config and stored weight types are read from it).
        oracle: the engine whose outputs are the oracle side: None for ``ref`` itself, or a fast engine in fp32
            (``--oracle fast``); it makes the emulations of :data:`harness.engines.numerics.EMULATED` too. Its
            ``engine`` attribute names the pairs.

    Attributes:
        name: the oracle's name in pair names (``reference``, or the oracle engine's ``engine``: ``fast``).
    """

    def __init__(self, ref: ReferenceEngine, oracle: Any = None) -> None:
        self.ref = ref
        self.oracle = ref if oracle is None else oracle
        self.name = "reference" if oracle is None else oracle.engine
        self._logits: dict[tuple[tuple[str, ...], str], tuple[np.ndarray, Trace]] = {}
        self._gens: dict[tuple[tuple[str, ...], int, int], dict[str, dict[str, Any]]] = {}
        self._cached: dict[str, tuple[int, np.ndarray]] = {}
        self._forced: dict[tuple[tuple[str, ...], int, str], np.ndarray] = {}
        self.passes = 0
        #: what runs :meth:`prefetch`'s passes: here, or on a Ray cluster (``--address``: :mod:`..remote`)
        self.pass_work: Callable[..., Any] = reference_pass

    def prefetch(self, sets: Sequence[tuple[str, ...]], prompts: Sequence[dict[str, Any]], new_tokens: int,
                 top_n: int = TOP_N, cached: bool = False, progress: Progress = lambda m: None,
                 greedy: bool = True) -> None:
        """Compute ahead, in as few passes over the weights as the checks allow
        (:func:`.oracle_pass.reference_pass`), what the pairs will ask: the logits and traces of every prompt under
        each approximation set in ``sets`` and exact (the figures against the exact reference beside an emulated
        pair's), the greedy streams of ``new_tokens`` under each set in ``sets``, and with ``cached`` the
        cached-vs-uncached logits (:meth:`cached_logits`); ``greedy=False``: no streams. What is already there is
        not computed again (a set whose streams are asked runs its prompts' forwards again: the streams continue
        them). Later calls of
        :meth:`logits` and :meth:`generations` read them; what was not prefetched is computed when asked, as
        before. Nothing is done when the oracle is not the reference (``--oracle fast``), or when a ``--spec``
        variant replaces a function the many-forwards path does the work of (:func:`reference.batch.replaced`).

        The values are the ones the one-by-one path gives, bit for bit (:mod:`reference.batch`).
        """
        if self.oracle is not self.ref and not hasattr(self.oracle, "prompt_runs"):
            return
        if self.oracle is self.ref and batch.replaced():  # a --spec variant overrides what the many-forwards path does
            progress(f"reference: forwards one by one ({', '.join(batch.replaced())} replaced by --spec)")
            return
        context = self.ref.cfg.context_length
        gen_prompts = [p for p in prompts if len(p["prompt_ids"]) + new_tokens <= context]
        asked = list(dict.fromkeys(self.effective(tuple(a)) for a in sets))
        gen_sets = [a for a in asked if (a, new_tokens, top_n) not in self._gens] if gen_prompts and greedy else []
        need = [a for a in dict.fromkeys([(), *asked])
                if a in gen_sets or any((a, str(p["id"])) not in self._logits for p in prompts)]
        if self.oracle is not self.ref:
            self._prefetch_oracle(need, prompts, gen_sets, gen_prompts, new_tokens, top_n)
            return
        cached = cached and any(str(p["id"]) not in self._cached for p in prompts if len(p["prompt_ids"]) > 1)
        if not need and not cached:
            return
        res = self.pass_work(self.ref, need, prompts, gen_sets, gen_prompts, new_tokens, top_n, cached, self.numerics,
                             progress)
        self._logits.update(res.logits)
        self._cached.update(res.cached)
        for approx, gens in res.generations.items():
            self._gens[(approx, new_tokens, top_n)] = as_streams(gen_prompts, gens)
        self.passes += res.passes

    def _prefetch_oracle(self, need: Sequence[tuple[str, ...]], prompts: Sequence[dict[str, Any]],
                         gen_sets: Sequence[tuple[str, ...]], gen_prompts: Sequence[dict[str, Any]], new_tokens: int,
                         top_n: int) -> None:
        """:meth:`prefetch` with an oracle that is not the reference (``--oracle fast``), through its
        ``prompt_runs`` (one prefill per prompt and set): the traced logits of each set of ``need``; from the same
        caches the greedy streams of a set of ``gen_sets``; and from the exact prompts' caches the log-prob
        effect's teacher-forced logits along the first emulated set's streams (:meth:`logprob_effect`). The
        emulated sets run first, so that the exact one can follow their streams. One by one, the same work took
        four prefills of each prompt, a head over every prompt position of the forced forward, and a decode step
        per prompt and token."""
        gen_ids = {str(p["id"]) for p in gen_prompts}
        along = next((a for a in gen_sets if a), None)
        for a in [a for a in need if a] + [a for a in need if not a]:
            streaming, forcing = a in gen_sets, not a and along is not None and a not in gen_sets
            todo = [p for p in prompts if streaming or forcing or (a, str(p["id"])) not in self._logits]
            follow = self._gens.get((along, new_tokens, top_n), {}) if forcing else {}
            parts = {"stream": [p for p in todo if streaming and str(p["id"]) in gen_ids],
                     "forced": [p for p in todo if str(p["id"]) in follow],
                     "plain": [p for p in todo if not (streaming and str(p["id"]) in gen_ids)
                               and str(p["id"]) not in follow]}
            for how, part in parts.items():
                if not part:
                    continue
                tokens = [follow[str(p["id"])]["tokens"][:-1] for p in part] if how == "forced" else None
                traces = [TraceWriter(self.name, p["prompt_ids"], dtype="float32", keep_tensors=True) for p in part]
                with self.numerics(a):
                    runs = self.oracle.prompt_runs([list(p["prompt_ids"]) for p in part], traces=traces,
                                                   new_tokens=new_tokens if how == "stream" else 0, forced=tokens,
                                                   top_n=top_n)
                for p, w, run in zip(part, traces, runs):
                    self._logits[(a, str(p["id"]))] = (run.logits.double().cpu().numpy(), w.trace())
                    if how == "forced":
                        self._forced[(along, new_tokens, str(p["id"]))] = torch_rows(
                            [run.logits[-1:]] + ([] if run.forced is None else [run.forced]))
                if how == "stream":
                    self._gens[(a, new_tokens, top_n)] = as_streams(part, [run.stream for run in runs])

    def cached_logits(self, prompt: dict[str, Any]) -> tuple[int, np.ndarray] | None:
        """``(prefill, float64 [T, V])``: the prompt's cached-vs-uncached logits when :meth:`prefetch` computed
        them (a prefill of ``prefill`` tokens, then one token per forward), else None."""
        return self._cached.get(str(prompt["id"]))

    def numerics(self, approx: Sequence[str]) -> ContextManager:
        """The reference under the emulations ``approx`` (:meth:`harness.engines.numerics.Numerics.emulation`)."""
        return emulate(approx)

    def emulation_gap(self, numerics: Numerics, types: Sequence[str]) -> str | None:
        """Why the oracle cannot emulate the quantized activations of an engine with ``numerics`` on matrices of
        ``types`` (:meth:`unemulated_types`), or None when it can (the reference as the oracle, the engine's
        dot-product types llama.cpp's, every type in llama.cpp's table)."""
        if self.name != "reference":
            return f"the {self.name} oracle does not emulate it (the default oracle, the reference, does)"
        if numerics.vec_dot_types is None:
            return "the engine does not say whose dot-product types it rounds to (vec_dot_types)"
        unknown = emulable_types(types)
        if unknown:
            return f"no dot-product type is known for {'/'.join(unknown)}"
        return None

    def effective(self, approx: tuple[str, ...]) -> tuple[str, ...]:
        """``approx`` (an emulation key, :meth:`harness.engines.numerics.Numerics.emulation`) as it acts on this
        model: ``quantized_activations`` rounds the inputs of quantized and 16-bit matrices only, so on a file with
        none (:meth:`unemulated_types` empty: an F32 file) it is left out. Kept, it would change nothing but the
        RMSNorms (llama.cpp's float32 steps, there for the int8 ties), and those fp32 roundings move the fp16 GELU
        table's and KV cache's roundings off the ones the other emulations were judged with (measured: llama-cpp-python
        on the F32 odd-h88-v515-gqa shape, max |dlogprob| 0.0062 -> 0.021 against a limit that fell 0.047 -> 0.020)."""
        return effective(approx, self.unemulated_types())  # shared with g4h sweep (harness/sweep/tasks.py)

    def unemulated_types(self) -> list[str]:
        """The stored types of the model's matrices that are neither F32 nor float64 (``Q8_0``, ``F16`` ...):
        where an engine with ``quantized_activations`` rounds its activations."""
        w = self.ref.weights
        raw = getattr(w, "raw_dtype", None)
        if raw is None:
            return []
        return sorted({raw(n) for n in w if len(w.shape(n)) >= 2} - {"F32", "float32", "float64"})

    def logits(self, approx: tuple[str, ...], prompt: dict[str, Any]) -> tuple[np.ndarray, Trace]:
        """The oracle's logits ``[T, V]`` as float64 and the trace (tensors kept) of one prompt, under ``approx``."""
        key = (approx, str(prompt["id"]))
        if key not in self._logits:
            w = TraceWriter(self.name, prompt["prompt_ids"], dtype="float64" if self.name == "reference" else "float32",
                            keep_tensors=True)
            with self.numerics(approx):
                z = self.oracle.logits(prompt["prompt_ids"], trace=w)
            self._logits[key] = (z, w.trace())
        return self._logits[key]

    def reseeded(self, approx: tuple[str, ...], prompt: dict[str, Any], engine: Trace) -> tuple[Trace, Trace] | None:
        """The reference's traces (tensors kept) of one prompt under ``approx``, re-seeded from the engine's trace:
        each layer L > 0 enters with the engine's ``l_out`` of layer L - 1, and the final norm with its last layer's
        (``layer_inputs`` of :func:`reference.model.forward`), so that each layer is computed from what the engine's
        own layer took and a difference cannot carry from one layer to the next; then the same with every product's
        input jittered in its last bits (``(*approx, "jitter")``: what the int8 rounding flips alone leave, the null
        of ``local_rel_l2``). The first layer enters with the engine's ``inp_scaled`` where it traced it. Two
        forwards, not kept (another engine's trace is another seed). None when the oracle
        is not the reference or the engine's trace lacks an ``l_out`` tensor of the prompt's shape."""
        if self.oracle is not self.ref:
            return None
        n, T, h = self.ref.cfg.n_layer, len(prompt["prompt_ids"]), self.ref.cfg.hidden_size
        first = engine.tensor("inp_scaled", -1)  # the first layer's input too, where traced: its fp32 bits
        seeds = {0: first} if first is not None and first.shape == (T, h) else {}
        for il in range(n):
            t = engine.tensor("l_out", il)
            if t is None or t.shape != (T, h):
                return None
            seeds[il + 1] = t
        out = []
        for a in (approx, (*approx, "jitter_sums")):
            w = TraceWriter(self.name, prompt["prompt_ids"], dtype="float64", keep_tensors=True)
            with self.numerics(a):
                self.ref.logits(prompt["prompt_ids"], trace=w, layer_inputs=seeds)
            out.append(w.trace())
        return out[0], out[1]

    def local_errors(self, approx: tuple[str, ...], prompt: dict[str, Any], engine: Trace
                     ) -> dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] | None:
        """:func:`local_errors` of the engine's trace ``engine`` of ``prompt`` against the reference re-seeded from
        it under ``approx`` (:meth:`reseeded`): what ``<pair>_q8.local_median`` pools, in the pair and in its
        explanation's trials. None when ``approx`` does not round activations (no such figure) or the trace cannot
        re-seed the reference."""
        seeded = self.reseeded(approx, prompt, engine) if "quantized_activations" in approx else None
        return None if seeded is None else local_errors(engine, *seeded, self.ref.cfg.n_layer)

    def raw_logits(self, approx: tuple[str, ...], ids: Sequence[int]) -> np.ndarray:
        """The oracle's logits ``[T, V]`` (float64) of ``ids``, not kept, under ``approx``."""
        with self.numerics(approx):
            return np.asarray(self.oracle.logits(list(ids)), dtype=np.float64)

    def raw_logits_many(self, approx: tuple[str, ...], seqs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """:meth:`raw_logits` of every sequence of ``seqs``: with the reference as the oracle, in one pass over
        the weights (:func:`reference.batch.forward_chains`, bit for bit the same), else one forward each."""
        if self.oracle is not self.ref or not hasattr(self.ref, "logits_chains") or batch.replaced() or not seqs:
            return [self.raw_logits(approx, ids) for ids in seqs]
        chains = [batch.Chain([list(ids)], numerics=lambda: self.numerics(approx)) for ids in seqs]
        self.passes += 1
        return [np.asarray(z[0], dtype=np.float64) for z in self.ref.logits_chains(chains)]

    def decoded_logits(self, approx: tuple[str, ...], prompts: Sequence[Sequence[int]],
                       tokens: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """The reference's logits (float64 ``[len(prompt) + len(tokens), V]``) of each prompt and its tokens computed
        as an engine computes a stream: a prefill of the prompt, then one decode step per token, under ``approx``
        (llama.cpp's flash attention takes another kernel below 64 query rows: one forward over the whole sequence
        would not be what the engine ran). With the reference as the oracle only; in one pass over the weights
        (:func:`reference.batch.forward_chains`) unless ``approx`` jitters (its random stream is the one-by-one
        path's) or a ``--spec`` variant replaces what that path does."""
        if "jitter" in approx or batch.replaced() or not prompts:
            out = []
            for ids, toks in zip(prompts, tokens):
                with self.numerics(approx):
                    out.append(np.asarray(self.ref.logits_cached(list(ids) + list(toks), len(ids)), dtype=np.float64))
            return out
        chains = [batch.Chain([list(ids)] + [[int(t)] for t in toks], numerics=lambda: self.numerics(approx))
                  for ids, toks in zip(prompts, tokens)]
        self.passes += 1
        return [np.concatenate([np.asarray(z, dtype=np.float64) for z in calls])
                for calls in self.ref.logits_chains(chains)]

    def generations(self, approx: tuple[str, ...], prompts: Sequence[dict[str, Any]], n: int,
                    top_n: int = TOP_N) -> dict[str, dict]:
        """The oracle's greedy streams of ``n`` tokens with the top-``top_n`` log-probs of every step, as
        :func:`harness.parity.compare.load_generations` returns them, under ``approx``."""
        key = (approx, n, top_n)
        if key not in self._gens:
            with self.numerics(approx):
                gens = self.oracle.generate_full([p["prompt_ids"] for p in prompts], n, top_n=top_n)
            self._gens[key] = as_streams(prompts, gens)
        return self._gens[key]

    def logprob_effect(self, approx: tuple[str, ...], prompts: Sequence[dict[str, Any]], n: int,
                       top_n: int = TOP_N) -> tuple[float, str | None]:
        """How far the emulations ``approx`` move the oracle's greedy log-probs: for each prompt, the stream under
        ``approx`` (:meth:`generations`) and the exact oracle's log-probs of the same tokens in the same contexts
        (one forward over the prompt and the stream, teacher-forced), max |Δ| over every step's top-``top_n``.
        Returns ``(effect, where)``; ``(0, None)`` without emulations."""
        if not approx:
            return 0.0, None
        key = ("effect", approx, n, top_n, tuple(str(p["id"]) for p in prompts))
        if key not in self._gens:
            gens = self.generations(approx, prompts, n, top_n)
            worst, where = 0.0, None
            streams = [(p, gens[str(p["id"])]) for p in prompts if gens[str(p["id"])]["tokens"]]
            for (p, g), z in zip(streams, self._forced_rows(approx, n, streams)):
                lp = log_softmax(z)
                for i, d in enumerate(g["logprobs"]):
                    row = lp[i]
                    for t, v in d.items():
                        if abs(v - row[t]) > worst:
                            worst = abs(v - row[t])
                            where = f"request {p['id']} step {i} token {t}: {v:.6g} with, {row[t]:.6g} without"
            self._gens[key] = (worst, where)
        return self._gens[key]


    def _forced_rows(self, approx: tuple[str, ...], n: int,
                     streams: Sequence[tuple[dict[str, Any], dict[str, Any]]]) -> list[np.ndarray]:
        """The exact oracle's logits (float64 ``[len(tokens), V]``) of each stream's steps, teacher-forced: the
        prompt's last position, then one position per stream token but the last. What :meth:`prefetch` computed,
        else a forward of the prompt and the stream (the reference: in one pass over the weights,
        :meth:`raw_logits_many`; an oracle with ``prompt_runs``: from one prefill each, no trace)."""
        out: list[np.ndarray | None] = [self._forced.get((approx, n, str(p["id"]))) for p, _ in streams]
        missing = [k for k, z in enumerate(out) if z is None]
        if hasattr(self.oracle, "prompt_runs") and self.oracle is not self.ref:
            runs = self.oracle.prompt_runs([list(streams[k][0]["prompt_ids"]) for k in missing],
                                           forced=[streams[k][1]["tokens"][:-1] for k in missing])
            for k, run in zip(missing, runs):
                out[k] = torch_rows([run.logits[-1:]] + ([] if run.forced is None else [run.forced]))
            return out
        full = self.raw_logits_many((), [list(streams[k][0]["prompt_ids"]) + streams[k][1]["tokens"][:-1]
                                         for k in missing])
        for k, z in zip(missing, full):
            out[k] = z[len(streams[k][0]["prompt_ids"]) - 1:]
        return out


def torch_rows(parts: Sequence[Any]) -> np.ndarray:
    """Row blocks of an oracle's torch logits, stacked as one float64 array."""
    return np.concatenate([t.double().cpu().numpy() for t in parts])


def as_streams(prompts: Sequence[dict[str, Any]], gens: Sequence[Any]) -> dict[str, dict[str, Any]]:
    """Generated objects (``tokens``, ``top``) keyed by prompt id, in the form the greedy rule reads."""
    return {str(p["id"]): {"tokens": list(g.tokens), "top": [[i for i, _ in s] for s in g.top],
                           "logprobs": [dict(s) for s in g.top]} for p, g in zip(prompts, gens)}


def _runs(pair: str, ok: bool, **detail: Any) -> Figure:
    return fig(f"{pair}.runs", 1.0 if ok else 0.0, None, **detail)


def failure_place(request: Any, step: int | None) -> str | None:
    """``request R step S`` (either part when known), or None."""
    parts = ([f"request {request}"] if request is not None else []) + ([f"step {step}"] if step is not None else [])
    return " ".join(parts) or None


def engine_failed(pair: str, e: EngineFailure) -> Figure:
    """The failing ``<pair>.runs`` figure of an engine failure: its one line, the request, the step and the engine's
    own last error line where known (``first_divergence`` is ``request R step S``); a stream that is not greedy
    where that is a fault in decoding (the failure's ``decoding``, :func:`_not_greedy_failure`) also gives the pair
    its ``explanation``, in the form :mod:`.explain_pair` gives one."""
    where = failure_place(e.request, e.step)
    line = one_line(e)
    found = e.decoding
    said = {} if found is None else {"explanation": {
        "status": "decoding", "line": f"in decoding, not in the logits: {found['line']}", "decoding": found,
        "first_point": f"request {found['request']} step {found['step']}"}}
    return _runs(pair, False, got=line, engine_failure=True, request=e.request, step=e.step,
                 last_error=e.last_error, first_divergence=where,
                 why=f"ENGINE FAILED{' at ' + where if where else ''}: {line}", **said)


def pair_checks(runs: ReferenceRuns, name: str, path: str | Path, prompts: Sequence[dict[str, Any]],
                progress: Progress, case: str, opted_out: str | None = None, options: dict[str, Any] | None = None,
                extra: Any = None, number: int = 1) -> list[Figure]:
    """The reference against engine ``name`` on the model at ``path`` (see the module docstring).

    Args:
        runs: the reference's shared outputs.
        name: the engine name (``fast``, ``llamacpp``, ``cmd:'./eng'`` ...).
        prompts: prompt records within the model's vocabulary.
        opted_out: the ``--skip`` name that opts this engine out, when the user gave it (informational).
        options: keywords for :func:`harness.engines.make_engine` (each engine takes its own).
        extra: options of the kind's :data:`EXTRA_CHECKS` (a server's :class:`.server.ServerOptions`); its
            ``max_new_tokens``, when it has one, sets the length of the greedy streams (default
            :data:`GREEDY_NEW_TOKENS`), and its ``top_n`` vLLM's N (log-probs per step; default
            :data:`harness.engines.base.TOP_N`).
            ``layers`` (``--layers N``): an engine that cannot cut a model fails its ``.runs``.
        number: this engine's place among the engines of its kind in the run: from 2 on, its pair and its own
            checks' gates carry the number (``reference~openai#2.greedy``, ``server#2.stop.eos``), judged by the
            unnumbered gates (:func:`harness.core.gates.gate_for`).

    Returns:
        Figures for the gates ``<oracle>~<kind>.*`` (``runs.name``: ``reference~<kind>``, or ``fast~<kind>``
        with ``--oracle fast``); never raises for a failing engine (that is a ``.runs`` figure of 0).
    """
    kind = engine_kind(name)
    figures = _pair_checks(runs, name, kind, path, prompts, progress, case, opted_out, options, extra)
    return figures if number == 1 else [_numbered(f, number) for f in figures]


def _too_long_for_server(e: InputError, prompts: Sequence[dict[str, Any]]) -> str:
    """The line of ``e``; for a request a server refused as longer than its context
    (:class:`harness.engines.openai.ServerContextExceeded`, a server that does not say its context up front), the
    prompt named by its file and line and its token count before the server's own message, and what to do."""
    if not isinstance(e, ServerContextExceeded):
        return str(e)
    sent = e.prompt_ids
    p = next((p for p in prompts if sent is not None and list(p["prompt_ids"]) == sent), None)
    if p is None and sent is not None:  # a request built from a prompt (a prefix of it): the longest such prompt
        p = max((p for p in prompts if list(p["prompt_ids"][:len(sent)]) == sent), default=None,
                key=lambda p: len(p["prompt_ids"]))
    what = "a request" if sent is None else f"a request of {len(sent)} prompt tokens"
    if p is not None:
        what = (f"{p['where'] + ': ' if p.get('where') else ''}prompt {p['id']!r} ({len(p['prompt_ids'])} tokens"
                f"{', its text tokenized' if 'text' in p else ''})")
    return f"{what} does not fit the server's context: the server refused it: {e}; {SERVER_CONTEXT_HINT}"


def _numbered(f: Figure, number: int) -> Figure:
    """``f`` under its gate's numbered name: ``#N`` after the pair (``reference~cmd#2.runs``) or after the first
    part of an engine's own check (``server#2.stop.eos``)."""
    head, _, rest = f.gate.partition(".")
    return Figure(f"{head}#{number}.{rest}", f.measured, f.prompt, dict(f.detail, engine_number=number))


def _pair_checks(runs: ReferenceRuns, name: str, kind: str, path: str | Path, prompts: Sequence[dict[str, Any]],
                 progress: Progress, case: str, opted_out: str | None, options: dict[str, Any] | None,
                 extra: Any) -> list[Figure]:
    pair = pair_name(kind, oracle=runs.name)
    if opted_out:
        return [_runs(pair, False, got="opted out", informational_reason=f"opted out with --skip {opted_out}")]
    progress(f"[{case}] {runs.name} vs {name}")
    try:
        eng = make_engine(name, path, **(options or {}))
    except EngineUnavailable as e:
        hint = "; or opt out: g4h parity --skip llamacpp" if kind == "llamacpp" else ""
        return [_runs(pair, False, got=f"not run: {e}{hint}")]
    except EngineFailure as e:  # it crashed loading the model, or broke its protocol at its handshake
        return [engine_failed(pair, e)]
    except InputError as e:  # it cannot be used as given: a command that cannot start, a server that is down
        return [_runs(pair, False, got=str(e), bad_input=True)]
    pair = pair_name(kind, engine_numerics(eng, kind).dtype, runs.name)
    out: list[Figure] = []  # the figures measured so far: kept when the engine fails later
    try:
        _measure(runs, eng, kind, pair, prompts, progress, case,
                 int(getattr(extra, "max_new_tokens", GREEDY_NEW_TOKENS)), int(getattr(extra, "top_n", TOP_N)), out)
        for hook in ON_MEASURED:
            hook(runs, eng, kind, pair, prompts, out, progress, case)
        if kind in EXTRA_CHECKS:
            out += EXTRA_CHECKS[kind](eng, runs, prompts, pair, progress, extra)
    except EngineUnavailable as e:
        return [_runs(pair, False, got=f"not run: {e}")] + out
    except EngineFailure as e:
        return [engine_failed(pair, e)] + out
    except InputError as e:  # a server's context exceeded: the prompt named (:func:`_too_long_for_server`)
        return [_runs(pair, False, got=_too_long_for_server(e, prompts), bad_input=True)] + out
    finally:
        close = getattr(eng, "close", None)
        if close is not None:
            close()
    about = {"engine": eng.engine, "ops": list(eng.ops)} if kind == "cmd" else {"engine": getattr(eng, "name", kind)}
    numerics = engine_numerics(eng, kind)
    return [_runs(pair, True, approximations=list(numerics.approximations), numerics=numerics.as_dict(),
                  **about)] + out


def numerics_lines(checks: Sequence[dict[str, Any]]) -> list[str]:
    """Report lines: for every pair whose ``.runs`` check carries the engine's ``numerics``, what it declared, what
    the reference emulated, and each figure whose limit the declaration raised (the largest effect per gate)."""
    lines: list[str] = []
    for c in checks:
        n = c.get("numerics")
        if not c["gate"].endswith(".runs") or not isinstance(n, dict):
            continue
        pair = c["gate"][:-len(".runs")]
        said = ", ".join(n.get("approximations") or []) or "none"
        lines += [f"Numerics of `{pair}` ({n.get('source') or 'declared'}): {n.get('dtype')}, KV cache "
                  f"{n.get('kv_cache')}, approximations: {said}; the reference emulates: "
                  f"{', '.join(n.get('emulated') or []) or 'nothing'}. Each figure is gated at max(fp32 bound, 2 x "
                  "the effect of these approximations on the same figure here: the reference with them against "
                  "the reference without them).", ""]
        worst: dict[str, dict[str, Any]] = {}
        for k in checks:
            if k["gate"].startswith(pair + ".") and k.get("effect") is not None:
                if k["gate"] not in worst or k["effect"] > worst[k["gate"]]["effect"]:
                    worst[k["gate"]] = k
        if worst:
            lines += ["| gate | largest effect of the declared approximations | its limit | worst measured |",
                      "|---|---:|---:|---:|"]
            for g, k in worst.items():
                top = max((x["measured"] for x in checks if x["gate"] == g and x["measured"] == x["measured"]),
                          default=float("nan"))
                lines.append(f"| `{g}` | {k['effect']:.3g} | {k['limit']:.3g} | {top:.3g} |")
            lines.append("")
    return lines


def near_tie_margin(logprob_limit: float) -> float:
    """The top-1 margin below which two engines may order the best tokens differently: twice the bound on a
    log-prob difference (each side within it), at least :data:`harness.core.gates.NEAR_TIE_MARGIN`."""
    return max(NEAR_TIE_MARGIN, 2.0 * logprob_limit)


def pair_near_tie(pair: str, effects: Mapping[tuple[str, str | None], tuple[float, int]]) -> float | None:
    """The near-tie margin an explanation of ``pair`` judges greedy streams with: :func:`near_tie_margin` of the
    pair's ``max_abs_logprob`` limit raised by the effect of the declared approximations on the log-probs
    (``effects``, :func:`declared_effects`); None when the pair has no such gate. The parity job's explanation
    (:mod:`.explain_pair`) and ``g4h explain`` (``harness/cli/explain.py``) both take it from here."""
    lp_gate = DEFAULT_GATES.get(f"{pair}.max_abs_logprob")
    if lp_gate is None:
        return None
    return near_tie_margin(effect_limit(lp_gate, effects.get(("max_abs_logprob", None), (0.0, 1))[0]))


def logit_effect(runs: ReferenceRuns, approx: tuple[str, ...], p: dict[str, Any]) -> tuple[float, float]:
    """How far the emulations ``approx`` move the oracle's logits of prompt ``p``: ``(max |Δlogit|, mean KLD)`` of
    the oracle with them against the oracle without them; ``(0, 0)`` without emulations. The effect that raises the
    pair's ``max_abs_logit`` and ``mean_kld`` gates (:func:`harness.core.gates.effect_limit`)."""
    if not approx:
        return 0.0, 0.0
    base, exact = runs.logits(approx, p)[0], runs.logits((), p)[0]
    return float(np.max(np.abs(base - exact))), float(kld_stats(exact, base).mean_kld)


def trace_effect(base: Trace, exact: Trace, tol: float) -> float:
    """How far the emulations move the oracle's trace points: the worst relative L2 (or checksum bound) of the
    oracle's trace with them (``base``) against without them (``exact``); ``tol``: the comparison's tolerance (the
    pair's ``layer_rel_l2`` limit). The effect that raises that gate."""
    moved = compare(base, exact, DivergenceRule(tol=tol)).rows
    return max((r.err for r in moved if r.err == r.err), default=0.0)


def declared_effects(runs: ReferenceRuns, approx: tuple[str, ...], pair: str, prompts: Sequence[dict[str, Any]],
                     traced: Sequence[str] = (), streams: Sequence[dict[str, Any]] = (),
                     new_tokens: int = GREEDY_NEW_TOKENS, top_n: int = TOP_N
                     ) -> dict[tuple[str, str | None], tuple[float, int]]:
    """``(metric, prompt id or None) -> (effect, power)``: the effects of the emulations ``approx`` that the
    pair's figures carry (as :func:`.explain_pair.effects` reads them back), without measuring the engine: per prompt
    of ``prompts`` (the engine gives logits) on ``max_abs_logit`` and ``mean_kld`` (:func:`logit_effect`), per prompt
    id in ``traced`` (the engine gives a trace) on ``layer_rel_l2`` (:func:`trace_effect`), and over the greedy
    streams of ``new_tokens`` of ``streams`` (the prompts the engine generates on) on ``max_abs_logprob``
    (:meth:`ReferenceRuns.logprob_effect`). Empty without emulations. ``g4h explain`` judges at the pair's limits
    with them."""
    if not approx:
        return {}
    out: dict[tuple[str, str | None], tuple[float, int]] = {}
    layer_limit = DEFAULT_GATES[f"{pair}.layer_rel_l2"].limit if f"{pair}.layer_rel_l2" in DEFAULT_GATES else 1e-3
    for p in prompts:
        pid = str(p["id"])
        logit, kld = logit_effect(runs, approx, p)
        out[("max_abs_logit", pid)], out[("mean_kld", pid)] = (logit, 1), (kld, 2)
        if pid in set(map(str, traced)):
            out[("layer_rel_l2", pid)] = (trace_effect(runs.logits(approx, p)[1], runs.logits((), p)[1],
                                                       layer_limit), 1)
    if streams:
        out[("max_abs_logprob", None)] = (runs.logprob_effect(approx, streams, new_tokens, top_n)[0], 1)
    return out


def expected_sets(names: Sequence[str], skip: Sequence[str] = ()) -> list[tuple[str, ...]]:
    """The emulation keys (:meth:`harness.engines.numerics.Numerics.emulation`) the pairs of ``names`` will ask the
    reference for, as far as the engines' kinds tell before they start (:data:`harness.engines.numerics.KIND_NUMERICS`;
    a ``cmd:`` engine declares its own at its handshake, a server its dialect's, and what no kind predicts is
    computed when asked); kinds in ``skip`` are left out."""
    kinds = [engine_kind(n) for n in names]
    return sorted({KIND_NUMERICS[k].emulation() if k in KIND_NUMERICS else () for k in kinds
                   if not (k == "llamacpp" and skipped(skip, "llamacpp"))})


def _can(eng: Any, op: str) -> bool:
    """Whether the engine answers ``op`` (``logits``, ``generate``, ``trace``)."""
    ops = getattr(eng, "ops", None)
    if ops is not None:
        return op in ops
    return op == "trace" or hasattr(eng, "generate_full" if op == "generate" else op)


def _measure(runs: ReferenceRuns, eng: Any, kind: str, pair: str, prompts: Sequence[dict[str, Any]],
             progress: Progress, case: str, new_tokens: int = GREEDY_NEW_TOKENS, top_n: int = TOP_N,
             out: list[Figure] | None = None) -> list[Figure]:
    """The pair's figures, appended to ``out`` as they are measured (so that an engine failure keeps them)."""
    out = [] if out is None else out
    numerics = engine_numerics(eng, kind)
    approx = runs.effective(numerics.emulation())
    types = runs.unemulated_types() if "quantized_activations" in numerics.approximations else []
    gap = runs.emulation_gap(numerics, types) if types else None
    if gap is not None:
        approx = tuple(a for a in approx if a != "quantized_activations")
    try:
        _measure_figures(runs, eng, kind, pair, prompts, progress, case, approx, new_tokens, top_n, out)
    finally:
        if types:
            _quantized_gates(runs, out, pair, kind, types, gap, prompts, approx)
    return out


def _quantized_gates(runs: ReferenceRuns, figures: list[Figure], pair: str, kind: str, types: Sequence[str],
                     gap: str | None, prompts: Sequence[dict[str, Any]], approx: tuple[str, ...] = ()) -> None:
    """Judge the figures of an engine that rounds its activations (``quantized_activations``) on a file with
    quantized or 16-bit matrices (``types``).

    Emulated with the engine's tensors (its traces: the ``<pair>_q8.local_median`` figures of each prompt, with
    ``_errors``): they are pooled into the one gate of the pair (:func:`local_figure`: each layer judged on its own
    against the reference re-seeded from the engine's stream), and ``agreeing_positions`` is reported
    (:data:`LOCAL_JUDGES`; its jittered count is not computed).

    Emulated (``gap`` None): each figure is judged by ``<pair>_q8.<metric>`` (``harness/core/gates.py``), not by the
    effect of the emulations (kept in the detail as ``effect_not_applied``: the rounding moves the figures by far
    more than a fault does). What the emulation leaves is fp32 accumulation and sporadic int8 rounding flips; the
    worst-value figures are reported, and ``<pair>_q8.agreeing_positions`` is gated: the positions in each prompt's
    leading run within the fp32 bound, over those of the emulating reference against itself with its inputs
    perturbed in their last bits (``jitter``: what the flips alone do on this model and prompt). When that reference
    agrees on fewer positions than one per prompt (flips too dense: no resolution), the figure is reported and the
    mean KLD is gated as below. An engine
    without logits (a server) is counted on its greedy streams' log-probs instead (:func:`stream_agreement`, in the
    ``max_abs_logprob`` figure's detail): the same gate, the same ratio; flips too dense there leave the greedy
    streams to gate alone (no logits, no KLD).

    Not emulated (``gap`` says why): every figure is informational with the reason
    (:data:`QUANTIZED_ACTIVATIONS`), except the mean KLD, judged by ``<pair>_q8x.mean_kld`` at 2 x the KLD the
    yardstick rounding (:data:`YARDSTICK`) causes on the same prompt, so a fault larger than an 8-bit rounding
    still fails."""
    head = pair + "."
    by_id = {str(p["id"]): p for p in prompts}
    dense = None
    seeded = [f for f in figures if f.gate == f"{pair}_q8.local_median" and "_errors" in f.detail]
    if seeded:  # the engine's tensor traces, each layer judged on its own: the gate of the emulated pair
        figures[:] = [f for f in figures if not any(f is g for g in seeded)]
        figures.append(local_figure(pair, seeded))
    if gap is None:
        logit = [f for f in figures if f.gate == head + "max_abs_logit" and "agreeing_prefix" in f.detail]
        streams = [f for f in figures if f.gate == head + "max_abs_logprob" and "agreeing_prefix" in f.detail]
        detail: dict[str, Any] | None = None
        if logit:
            own = DEFAULT_GATES[head + "max_abs_logit"].limit
            agree, total = sum(f.detail["agreeing_prefix"] for f in logit), sum(f.detail["positions"] for f in logit)
            itself = 0  # the emulating reference against itself with its inputs perturbed in their last bits
            for f in (() if seeded else logit):  # reported beside local_median: not worth a forward per prompt
                p = by_id[str(f.prompt)]
                base = runs.logits(approx, p)[0]
                moved = np.max(np.abs(runs.raw_logits((*approx, "jitter"), p["prompt_ids"]) - base), axis=1)
                apart = np.nonzero(~(moved <= own))[0]
                itself += int(apart[0]) if apart.size else int(moved.size)
            detail = dict(positions=total, agreeing=agree, reference_agreeing=itself, on="logits",
                          per_prompt={str(f.prompt): [f.detail["agreeing_prefix"], f.detail["positions"]]
                                      for f in logit})
            instead = "the mean KLD is gated against the 8-bit yardstick instead"
            # a count of leading runs under one position per prompt has no resolution (as for streams below):
            # measured, e2b F16 through the llamacpp engine, the jittered reference 2 over 6 prompts and the correct
            # engine 0 (a false alarm)
            floor = len(logit)
        elif streams:  # an engine without logits: its greedy streams' log-probs (stream_agreement)
            f = streams[0]
            own = DEFAULT_GATES[head + "max_abs_logprob"].limit
            agree, itself = f.detail["agreeing_prefix"], f.detail["reference_agreeing"]
            detail = dict(positions=f.detail["positions"], agreeing=agree, reference_agreeing=itself,
                          on=("log-probs along the greedy streams (prompt positions where offered or probed by "
                              "prefix, then each step)"),
                          per_prompt=f.detail["per_prompt"])
            instead = "the greedy streams gate alone"
            # a count of leading runs under one position per stream has no resolution: measured, the e2b F16 file
            # on llama-server, the jittered reference 2 over 6 streams and the correct server 0 (a false alarm)
            floor = len(f.detail["per_prompt"])
        if detail is not None and seeded:  # reported: the per-layer figure judges
            detail["reference_agreeing"] = None
            figures.append(fig(f"{pair}_q8.agreeing_positions", float("nan"), None, **detail,
                               informational_reason=LOCAL_JUDGES))
        elif detail is not None:
            if itself < floor:
                dense = (f"{'no position' if itself == 0 else f'{itself} position(s) over {floor} streams'} of the "
                         f"emulating reference agree(s) with itself within {own:g} once its inputs move in their last "
                         "bits: int8 rounding flips are too dense on this model to judge by positions; "
                         f"{instead}")
                figures.append(fig(f"{pair}_q8.agreeing_positions", float("nan"), None, **detail,
                                   informational_reason=dense, no_resolution=instead))
            else:
                figures.append(fig(f"{pair}_q8.agreeing_positions", agree / itself, None, **detail))
    for f in figures:
        if not f.gate.startswith(head) or f.gate[len(head):] not in Q8_METRICS:
            continue
        metric = f.gate[len(head):]
        if gap is None and dense is not None and metric == "mean_kld" and str(f.prompt) in by_id:
            p = by_id[str(f.prompt)]
            yard = float(kld_stats(runs.logits((), p)[0], runs.logits(YARDSTICK, p)[0]).mean_kld)
            f.gate = f"{pair}_q8x.mean_kld"
            f.detail.pop("effect", None)
            f.detail.update(effect=yard, effect_power=1, yardstick=yard, quantized_activations=f"emulated; {dense}")
            continue
        if gap is None:
            f.gate = f"{pair}_q8.{metric}"
            if "effect" in f.detail:
                f.detail["effect_not_applied"] = f.detail.pop("effect")
                f.detail.pop("effect_power", None)
            f.detail["quantized_activations"] = f"emulated ({'/'.join(types)})"
            if metric in Q8_REPORTED:
                f.detail["informational_reason"] = Q8_REPORTED_WHY
            continue
        why = QUANTIZED_ACTIVATIONS.format(engine=kind, types="/".join(types), why=gap, pair=pair)
        p = by_id.get(str(f.prompt))
        if metric == "mean_kld" and p is not None:
            exact = runs.logits((), p)[0]
            yard = float(kld_stats(exact, runs.logits(YARDSTICK, p)[0]).mean_kld)
            f.gate = f"{pair}_q8x.mean_kld"
            f.detail.update(effect=yard + float(f.detail.get("effect") or 0.0), effect_power=1, yardstick=yard,
                            quantized_activations=f"not emulated: {gap}")
        else:
            f.detail["informational_reason"] = why


LOCAL_JUDGES = ("reported, not gated: the engine gave its tensors, and local_median judges each layer on its own "
                "(re-seeded from the engine's stream, so that an int8 rounding flip cannot carry into the layers after "
                "it)")
"""Why ``agreeing_positions`` is reported where ``local_median`` gates the pair."""


def _poisson_cdf(k: int, lam: float) -> float:
    """P(X <= k) for X Poisson of mean ``lam`` (0 for k < 0)."""
    if k < 0:
        return 0.0
    if lam <= 0:
        return 1.0
    return min(1.0, sum(math.exp(-lam + i * math.log(lam) - math.lgamma(i + 1)) for i in range(k + 1)))


@functools.lru_cache(maxsize=None)
def flips_explained(n_null: int, alpha: float = Q8_LOCAL_ALPHA) -> int:
    """The most positions of a trace point that int8 rounding flips explain in the engine's errors, given that the
    null (the jittered re-seeded reference) has ``n_null`` beyond the same limit: the upper bound ``u`` of a Poisson
    rate that gives at most ``n_null`` with probability ``alpha``, then the least ``m`` that a Poisson count of mean
    ``EFFECT_FACTOR * u`` exceeds with probability at most ``alpha`` (Q8_LOCAL_WHY in harness/core/gates.py).
    0 -> 36, 1 -> 44, 5 -> 64 at alpha 1e-4."""
    lo, hi = 0.0, n_null + 10.0 * math.sqrt(n_null + 1) + 50.0
    for _ in range(100):  # bisection: the cdf falls as the rate grows
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _poisson_cdf(n_null, mid) > alpha else (lo, mid)
    lam = EFFECT_FACTOR * hi
    m, cdf = 0, math.exp(-lam)
    while 1.0 - cdf > alpha:  # the cdf summed term by term
        m += 1
        cdf += math.exp(-lam + m * math.log(lam) - math.lgamma(m + 1))
    return m


def local_figure(pair: str, per_prompt: Sequence[Figure]) -> Figure:
    """``<pair>_q8.local_median``: for each trace point (point, layer), the per-position relative L2 of the engine
    against the emulating reference re-seeded from the engine's own stream (:meth:`ReferenceRuns.reseeded`,
    :func:`local_errors`, in each figure of ``per_prompt`` as ``_errors``), over every position of every prompt,
    taken at the rank flips allow. The limit is ``max(floor, 2 x effect)``, the effect the worst point's median of
    the null (the jittered re-seeded reference against the re-seeded one: what the emulation leaves). Per point,
    the null's positions beyond that limit give ``m`` (:func:`flips_explained`: the most that int8 rounding flips
    explain), and the point's figure is its (m+1)-th largest error, at most the median's rank: beyond the limit
    exactly when more than ``m`` positions are. A fault in a matrix moves every position that uses it by a like
    relative amount: most positions, or for one MoE expert the minority routed to it; a flip moves one position
    (and, through its keys and values, the later ones by less), and flips are rare. The figure is the worst
    point's; names the first point in trace order beyond the limit (``first_divergence``, ``point@layer``)."""
    pooled: dict[tuple[str, int], tuple[list, list]] = {}
    for f in per_prompt:
        for k, (e, j) in f.detail["_errors"].items():
            pooled.setdefault(k, ([], []))
            pooled[k][0].append(e)
            pooled[k][1].append(j)
    pooled_e = {k: (np.concatenate(e), np.concatenate(j)) for k, (e, j) in pooled.items()}
    null = max(float(np.median(j)) for _, j in pooled_e.values())
    limit = effect_limit(DEFAULT_GATES[f"{pair}_q8.local_median"], null)
    rows = []  # (key, figure, null median, positions, beyond, null beyond, flips explained)
    for k, (e, j) in pooled_e.items():
        beyond, null_beyond = int(np.sum(~(e <= limit))), int(np.sum(~(j <= limit)))
        m = min(flips_explained(null_beyond), (e.size - 1) // 2)
        value = float(-np.sort(-np.nan_to_num(e, nan=np.inf))[m])  # the (m+1)-th largest
        rows.append((k, value, float(np.median(j)), int(e.size), beyond, null_beyond, m))
    worst = max(rows, key=lambda r: r[1] if r[1] == r[1] else float("inf"))
    first = next((r for r in rows if not r[1] <= limit), None)
    where = None if first is None else f"{first[0][0]}@{first[0][1]}"
    said = {} if first is None else {"why": (
        f"first diverging layer {first[0][1]} ({where}): {first[4]} of {first[3]} positions beyond {limit:.3g}, "
        f"where rounding flips explain at most {first[6]} (the emulation itself leaves {first[5]} beyond it, a "
        f"median of {first[2]:.3g}); the relative L2 of rank {first[6] + 1} from the top is {first[1]:.3g}")}
    return fig(f"{pair}_q8.local_median", worst[1], None, worst_point=f"{worst[0][0]}@{worst[0][1]}",
               first_divergence=where, first_layer=None if first is None else first[0][1], effect=null,
               null=null, prompts=len(per_prompt), points=len(rows), **said,
               per_point=[[k[0], k[1], v] for k, v, *_ in rows],  # [point, layer, rel_l2] as every figure's
               null_per_point=[[k[0], k[1], j] for k, _, j, *_ in rows],
               # [point, layer, positions beyond the limit, the null's, flips explained] where any moved
               moved_per_point=[[k[0], k[1], b, nb, m] for k, _, _, _, b, nb, m in rows if b or nb])


def _naming(e: EngineFailure, prompts: Sequence[dict[str, Any]], oracle: dict[str, dict] | None = None,
            oracle_name: str = "reference") -> EngineFailure:
    """``e`` with its request named: the prompt at its ``index`` in ``prompts`` (the one prompt when there is one).
    With the ``oracle``'s streams and the tokens the engine returned (``partial``), the step is where they part
    (a dropped token shows there, not at the end of a short stream), said in the line."""
    if e.index is not None and 0 <= e.index < len(prompts):
        e.at(request=prompts[e.index]["id"])
    elif len(prompts) == 1:
        e.at(request=prompts[0]["id"])
    if oracle is not None and e.partial is not None and e.request is not None and str(e.request) in oracle:
        want = oracle[str(e.request)]["tokens"]
        got = list(e.partial)
        i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if i is not None:
            note = f"; its tokens part from the {oracle_name}'s at step {i}: {got[i]}, {oracle_name} {want[i]}"
        else:
            i = min(len(got), len(want))
            note = f"; its tokens agree with the {oracle_name}'s up to step {i}, then end"
        named = type(e)(f"{one_line(e)}{note}")
        named.__dict__.update(e.__dict__)
        named.step = i
        return named
    return e


def not_greedy(streams: dict[str, dict[str, Any]]) -> tuple[str, int, int, int, float] | None:
    """The first (request, step) whose token is not the top-1 of the engine's own log-probs there (a tie with it is
    greedy): ``(request, step, token, top-1 id, top-1 log-prob)``; None when every step is greedy (steps without
    log-probs are not judged)."""
    for rid, g in streams.items():
        for i, (tok, own) in enumerate(zip(g["tokens"], g["logprobs"])):
            if not own:
                continue
            best = max(own, key=lambda t: own[t])
            mine = own.get(tok)
            if mine is None or mine < own[best]:
                return rid, i, int(tok), int(best), float(own[best])
    return None


def _not_greedy_failure(runs: ReferenceRuns, eng: Any, kind: str, approx: tuple[str, ...],
                        prompts: Sequence[dict[str, Any]], ours: dict[str, dict[str, Any]],
                        oracle: dict[str, dict[str, Any]], bad: tuple[str, int, int, int, float], limit: float
                        ) -> EngineProtocolError:
    """The engine failure of a stream whose token is not the top-1 of the engine's own log-probs (``bad``, from
    :func:`not_greedy`): it did not decode greedily as asked (exit 1), said with what differs in decoding there, as
    the explanation says it (:func:`harness.parity.explain.decoding_by_logprobs`, on the oracle's logits at its
    context and its log-probs at the steps before where the streams are the same; ``limit``: the pair's
    ``max_abs_logprob`` limit): when its log-probs are the oracle's, the failure carries that finding as
    ``decoding`` (:func:`engine_failed` makes it the pair's explanation). A server that applies a repetition
    penalty, a ban or a logit bias after taking its log-probs (llama-server's ``n_probs``, vLLM's default
    ``raw_logprobs``) lands here."""
    rid, i, tok, best, lp = bad
    p = next(p for p in prompts if str(p["id"]) == rid)
    stream, theirs = ours[rid], oracle[rid]
    context = [int(t) for t in p["prompt_ids"]] + [int(t) for t in stream["tokens"][:i]]
    z = runs.raw_logits(approx, context)[-1]
    same = next((k for k, (a, b) in enumerate(zip(stream["tokens"], theirs["tokens"])) if a != b), i)
    found = decoding_by_logprobs(rid, p["prompt_ids"], stream, i, z, limit, runs.name,
                                 theirs["logprobs"][:min(i, same)])
    line = (f"{getattr(eng, 'name', kind)}: token {tok} is not the top-1 of its own log-probs ({best} at {lp:.6g}): "
            "not greedy decoding (temperature 0), which was asked")
    e = EngineProtocolError(line if found is None else f"{line}; in decoding, not in the logits: {found['what']}")
    e.decoding = found
    return e.at(request=rid, step=i)


def _measure_figures(runs: ReferenceRuns, eng: Any, kind: str, pair: str, prompts: Sequence[dict[str, Any]],
                     progress: Progress, case: str, approx: tuple[str, ...],
                     new_tokens: int = GREEDY_NEW_TOKENS, top_n: int = TOP_N,
                     out: list[Figure] | None = None) -> list[Figure]:
    out = [] if out is None else out
    # what this pair asks of the reference that the job's prefetch could not foresee (a server's or a cmd: engine's
    # declared emulations), in one set of passes over the weights rather than a forward per prompt and step
    runs.prefetch([approx], prompts, new_tokens, top_n, progress=lambda m: progress(f"[{case}] {m}"),
                  greedy=_can(eng, "generate"))
    layer_limit = DEFAULT_GATES[f"{pair}.layer_rel_l2"].limit
    logit_limit = DEFAULT_GATES[f"{pair}.max_abs_logit"].limit
    file_trace = hasattr(eng, "trace_file")
    try:
        batch = _logits_many(eng, kind, prompts) if _can(eng, "logits") else {}
    except EngineFailure as e:
        raise _naming(e, prompts)
    with temp_folder("g4h-pair-") as tmp:
        for p in prompts if _can(eng, "logits") else ():
            base, base_trace = runs.logits(approx, p)
            ours_trace = None
            try:
                if str(p["id"]) in batch:
                    ours, ours_trace = batch[str(p["id"])]
                elif _can(eng, "trace") and not file_trace:
                    w = TraceWriter(kind, p["prompt_ids"], keep_tensors=True)
                    ours = eng.logits(p["prompt_ids"], trace=w)
                    ours_trace = w.trace()
                else:
                    ours = eng.logits(p["prompt_ids"])
                if file_trace and _can(eng, "trace"):
                    ours_trace = _read_engine_trace(eng, p, Path(tmp))
            except EngineFailure as e:
                raise _naming(e, [p])
            out += _logit_figures(runs, ours, base, approx, pair, p, logit_limit)
            if ours_trace is not None:
                exact_trace = runs.logits((), p)[1] if approx else None
                out.append(_layer_figure(ours_trace, base_trace, pair, p, layer_limit, exact_trace))
                errors = runs.local_errors(approx, p, ours_trace)
                if errors:  # pooled over the prompts by _quantized_gates
                    out.append(fig(f"{pair}_q8.local_median", float("nan"), p["id"], _errors=errors))
        if _can(eng, "generate"):
            context = runs.ref.cfg.context_length
            gen_prompts = [p for p in prompts if len(p["prompt_ids"]) + new_tokens <= context]
            if gen_prompts:
                progress(f"[{case}] {runs.name} vs {kind}: greedy streams of {new_tokens} tokens, top-{top_n}")
                base_g = runs.generations(approx, gen_prompts, new_tokens, top_n)
                effect, effect_at = runs.logprob_effect(approx, gen_prompts, new_tokens, top_n)
                lp_limit = effect_limit(DEFAULT_GATES[f"{pair}.max_abs_logprob"], effect)
                hints = getattr(eng, "hints", None)
                if isinstance(hints, dict):  # a server that names some tokens by text only (llama-cpp-python)
                    hints.update({tuple(int(t) for t in p["prompt_ids"]): (list(base_g[str(p["id"])]["tokens"]),
                                                                           list(base_g[str(p["id"])]["logprobs"]))
                                  for p in gen_prompts})
                try:
                    ours_g = as_streams(gen_prompts, eng.generate_full([p["prompt_ids"] for p in gen_prompts],
                                                                       new_tokens, top_n=top_n))
                except EngineFailure as e:
                    raise _naming(e, gen_prompts, base_g, runs.name)
                figs = generation_figures(ours_g, base_g, pair, top_n, logprob_limit=lp_limit,
                                          near_tie=near_tie_margin(lp_limit))
                if approx:
                    figs[1].detail.update(effect=effect, effect_at=effect_at, emulated=list(approx))
                if getattr(eng, "no_logprobs", None):  # a server that gives tokens only: said, not failed
                    figs[1].detail["not_measured"] = eng.no_logprobs
                elif "quantized_activations" in approx and not _can(eng, "logits"):  # its log-probs stand for logits
                    try:
                        figs[1].detail.update(stream_agreement(
                            runs, eng, approx, gen_prompts, ours_g, DEFAULT_GATES[f"{pair}.max_abs_logprob"].limit,
                            top_n))
                    except EngineFailure as e:
                        raise _naming(e, gen_prompts)
                out += figs
                bad = not_greedy(ours_g)
                if bad is not None:  # a greedy engine never picks a token below its own top-1: it samples, or lies
                    raise _not_greedy_failure(runs, eng, kind, approx, gen_prompts, ours_g, base_g, bad, lp_limit)
    return out


def _agreeing_run(diffs: Sequence[float | None], bound: float) -> tuple[int, int]:
    """``(leading run, positions)`` of per-position differences: the positions before the first one above ``bound``,
    and the positions counted; None (a position one side left without log-probs) is neither."""
    run, seen, apart = 0, 0, False
    for d in diffs:
        if d is None:
            continue
        seen += 1
        apart = apart or not d <= bound
        run += not apart
    return run, seen


def stream_agreement(runs: ReferenceRuns, eng: Any, approx: tuple[str, ...], prompts: Sequence[dict[str, Any]],
                     streams: dict[str, dict[str, Any]], bound: float, top_n: int = TOP_N) -> dict[str, Any]:
    """For an engine that gives log-probs, not logits (a server, a ``cmd:`` engine without ``logits``) and rounds its
    activations (``quantized_activations`` in ``approx``, emulated): per greedy stream, the leading run of positions
    whose returned log-probs agree with the emulating oracle's for the same ids within ``bound`` (the fp32 bound of
    ``max_abs_logprob``), and the same run for the emulating oracle against itself jittered
    (``(*approx, "jitter")``, :func:`harness.engines.llamacpp.numerics.jitter_numerics`) on the same tokens, positions
    and ids. The positions: the prompt's where the engine reports prompt log-probs (``offers_prompt_logprobs``,
    :meth:`harness.engines.openai.OpenAIEngine.prompt_logprobs`: the prompt token and the top-N) or where it
    gives them for one token after each prefix (``probes_prompt_logprobs``, llama-server: the top-N; without the
    prompt's positions its streams start where an int8 flip has had a whole prompt to spread, and the jittered
    reference agreed on none of them on e2b Q8_0), then every generated step with log-probs (the engine's top-N)
    up to the first step whose token it left unnamed (-1); the oracle runs teacher-forced on the prompt and the
    engine's own tokens, a prefill of the prompt then a decode step per token as the engine ran them
    (:meth:`ReferenceRuns.decoded_logits`), so a stream that parts from the oracle's or stops at EOS is still
    compared where it went. Only ids the engine returned are compared (the oracle has every id); ``top_n``: the
    log-probs asked per prompt position.

    Returns:
        ``agreeing_prefix``, ``positions`` and ``reference_agreeing`` summed over the streams, ``per_prompt``
        ``{id: [agreeing, positions, reference_agreeing]}``, ``agreement_on`` (``log-probs``: what
        :func:`_quantized_gates` reads).

    Raises:
        EngineFailure: the engine failed a prompt log-probs request (its ``index`` in ``prompts``).
    """
    ids = {str(p["id"]): [int(t) for t in p["prompt_ids"]] for p in prompts}
    rids = [rid for rid in ids if streams.get(rid, {}).get("tokens")]
    prompt_lp: dict[str, list] = {}
    ask = (eng.prompt_logprobs if getattr(eng, "offers_prompt_logprobs", False)
           else eng.prefix_logprobs if getattr(eng, "probes_prompt_logprobs", False) else None)
    if ask is not None:
        for k, rid in ((k, rid) for k, rid in enumerate(ids) if rid in rids):
            try:
                prompt_lp[rid] = ask(ids[rid], top_n)
            except EngineFailure as e:
                raise e.at(index=k)
    # a step whose token the engine left unnamed (-1: llama-server's gaps, a text the oracle cannot name) ends
    # what can be followed: its log-probs still count, the context after it is unknown
    last = {}
    for rid in rids:
        toks = list(streams[rid]["tokens"])
        last[rid] = toks.index(-1) if -1 in toks else len(toks) - 1
    forced = [list(streams[rid]["tokens"][:last[rid]]) for rid in rids]
    emulated = runs.decoded_logits(approx, [ids[rid] for rid in rids], forced)
    jittered = runs.decoded_logits((*approx, "jitter"), [ids[rid] for rid in rids], forced)
    out = {"agreeing_prefix": 0, "positions": 0, "reference_agreeing": 0, "per_prompt": {},
           "agreement_on": "log-probs"}
    for rid, z, zj in zip(rids, emulated, jittered):
        lp, jit = log_softmax(z), log_softmax(zj)
        compared: list[tuple[int, dict[int, float]]] = []  # (row of the oracle's logits, the engine's log-probs)
        for i, entry in enumerate(prompt_lp.get(rid, [])):
            if entry is not None and 0 < i < len(ids[rid]):
                given = {} if entry[0] is None else {ids[rid][i]: float(entry[0])}
                compared.append((i - 1, {**dict(entry[1]), **given}))
        start = len(ids[rid]) - 1
        compared += [(start + s, {int(k): float(v) for k, v in d.items() if int(k) >= 0})
                     for s, d in enumerate(streams[rid]["logprobs"][:last[rid] + 1])]
        theirs = [max((abs(v - lp[row, k]) for k, v in d.items()), default=None) for row, d in compared]
        itself = [max((abs(jit[row, k] - lp[row, k]) for k in d), default=None) for row, d in compared]
        agree, seen = _agreeing_run(theirs, bound)
        own, _ = _agreeing_run(itself, bound)
        out["per_prompt"][rid] = [agree, seen, own]
        out["agreeing_prefix"] += agree
        out["positions"] += seen
        out["reference_agreeing"] += own
    return out


def _logits_many(eng: Any, kind: str, prompts: Sequence[dict[str, Any]]) -> dict[str, tuple[np.ndarray, Trace]]:
    """Logits and traces of every prompt in one call, for an engine that has ``logits_many`` (llama.cpp: one
    worker process instead of one per prompt); empty for the others."""
    many = getattr(eng, "logits_many", None)
    if many is None or not prompts:
        return {}
    out = {}
    for p, (z, points) in zip(prompts, many([p["prompt_ids"] for p in prompts], trace=True)):
        w = TraceWriter(kind, p["prompt_ids"], keep_tensors=True)
        for point, layer, arr in points:
            w(point, layer, arr)
        out[str(p["id"])] = (z, w.trace())
    return out


def _read_engine_trace(eng: Any, p: dict[str, Any], tmp: Path) -> Trace:
    """A ``cmd:`` engine's trace of one prompt, read and checked; a file that is not a trace of this prompt is
    the engine's fault (:class:`EngineProtocolError` naming the engine, the request and the file)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(p["id"]))
    path = eng.trace_file(p["prompt_ids"], tmp / f"{safe}.jsonl", dump_dir=tmp / "tensors")
    try:
        tr = read_trace(path)
    except InputError as e:
        raise EngineProtocolError(f"{eng.name} trace of prompt {p['id']}: {e}").at(request=p["id"]) from None
    if tr.prompt_ids != list(p["prompt_ids"]):
        raise EngineProtocolError(f"{eng.name} trace of prompt {p['id']}: {path} traces another prompt "
                                  f"({len(tr.prompt_ids)} ids, expected {len(p['prompt_ids'])})").at(request=p["id"])
    return tr


def _logit_figures(runs: ReferenceRuns, ours: np.ndarray, base: np.ndarray, approx: tuple[str, ...], pair: str,
                   p: dict[str, Any], limit: float) -> list[Figure]:
    """:func:`logit_figures` of one prompt, with the worst position named and the first position whose
    max |Δlogit| is above the gate's limit (``logits@position N``), and, under emulations, the *effect*: how far
    they move the oracle's logits and KLD (the oracle with them against the oracle without them), which raises the
    gates (:func:`harness.core.gates.effect_limit`), and the same figures against the exact oracle beside
    (``vs_exact_reference``). ``limit``: the max |Δlogit| gate's base limit."""
    effect = e_kld = 0.0
    exact = None
    own = limit  # the gate's limit before any effect raises it
    if approx:  # the oracle (reference or fast) without the emulation
        exact, _ = runs.logits((), p)
        effect, e_kld = logit_effect(runs, approx, p)
        limit = max(limit, effect_limit(DEFAULT_GATES[f"{pair}.max_abs_logit"], effect))
    figs = logit_figures(ours, base, pair, p["id"], near_tie=near_tie_margin(limit))
    pos, tok = figs[0].detail["max_abs_logit_at"]
    figs[0].detail["why"] = (f"worst at position {pos} (token {tok}): {ours[pos, tok]:.6g} vs {runs.name} "
                             f"{base[pos, tok]:.6g}")
    per_position = np.max(np.abs(ours - base), axis=1)
    beyond = np.nonzero(~(per_position <= limit))[0]
    figs[0].detail["first_divergence"] = f"logits@position {int(beyond[0])}" if beyond.size else None
    apart = np.nonzero(~(per_position <= own))[0]  # the leading positions within the fp32 bound itself
    figs[0].detail.update(agreeing_prefix=int(apart[0]) if apart.size else int(per_position.size),
                          positions=int(per_position.size))
    if exact is not None:
        figs[0].detail.update(effect=effect, emulated=list(approx))
        figs[1].detail.update(effect=e_kld, effect_power=2, emulated=list(approx))
        for f, e in zip(figs, logit_figures(ours, exact, pair, p["id"])):
            f.detail["vs_exact_reference"] = e.measured
    return figs


def _layer_figure(ours: Trace, base: Trace, pair: str, p: dict[str, Any], limit: float,
                  exact: Trace | None = None) -> Figure:
    """``<pair>.layer_rel_l2`` of one prompt: the worst trace point and the first beyond the gate's limit
    (relative L2 with tensors on both sides, else the checksum lower bound). With ``exact`` (the oracle's trace
    without the emulations that ``base`` makes), the effect of the emulations on the trace points raises the limit
    (:func:`harness.core.gates.effect_limit`)."""
    effect = None
    if exact is not None:
        effect = trace_effect(base, exact, limit)
        limit = max(limit, effect_limit(DEFAULT_GATES[f"{pair}.layer_rel_l2"], effect))
    res = compare(ours, base, DivergenceRule(tol=limit))
    if not res.rows:
        return fig(f"{pair}.layer_rel_l2", float("nan"), p["id"], got="no trace point in common with the reference",
                   only_engine=res.only_a[:10])
    worst = max(res.rows, key=lambda r: r.err if r.err == r.err else float("inf"))
    first = res.first
    return fig(f"{pair}.layer_rel_l2", worst.err, p["id"], worst_point=worst.where,
               first_divergence=None if first is None else first.where,
               basis=sorted({r.basis for r in res.rows}),
               **({"why": f"first divergence {first.where}: {first.why}"} if first else {}),
               **({"effect": effect} if effect is not None else {}),
               missing=res.only_b[:20], per_point=[[r.point, r.layer, r.err] for r in res.rows])
