"""The oracle's outputs on one model, computed once and shared by every pair (:class:`ReferenceRuns`).

The reference (or the fast engine in fp32 under ``--oracle fast``) under each approximation set a pair asks for: logits
and traces per prompt, greedy streams, the cached-vs-uncached logits, the teacher-forced logits of the log-prob effect,
and the reference re-seeded from an engine's own trace with the per-point errors against it (:func:`local_errors`, which
``local_median`` pools: :func:`.quantized.local_figure`). :meth:`ReferenceRuns.prefetch` computes what the pairs will
ask in as few passes over the weights as it can (:func:`.oracle_pass.reference_pass`); :mod:`.pair` measures the engines
against it.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Sequence

import numpy as np

from gemma4_harness.reference import batch
from gemma4_harness.reference.model import KVCache

from ...core.metrics import log_softmax
from ...core.engine_kinds import ORACLE
from ...engines.base import TOP_N
from ...engines.numerics import Numerics, emulable_types, emulate, effective
from ...engines.reference import ReferenceEngine
from ...traces.format import Trace, TraceWriter
from ...traces.store import default_store
from ..compare import as_streams
from .oracle_pass import reference_pass

Progress = Callable[[str], None]

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


class PassingCache(KVCache):
    """A KV cache (:class:`reference.model.KVCache`) for one forward that is not continued: a layer's K/V are kept
    only while a later layer may read them (itself, or a KV-shared layer whose donor it is), and dropped when a layer
    past the last such reader appends its own. The values read are the same; what goes is memory: in a layer-outer
    pass of many prompts (:meth:`ReferenceRuns.reseeded_many`) every chain's cache lives until the pass ends, on the
    26B-A4B shape about 0.9 MB a token over its 30 layers (3 GB for 8 prompts of 217 tokens, twice). Not for a cache
    that a later call continues (the dropped layers would be missing)."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.last_reader: dict[int, int] = {}  # layer index -> the last layer that reads its K/V
        for layer in cfg.layers:
            self.last_reader[layer.kv_donor] = max(self.last_reader.get(layer.kv_donor, -1), layer.index)

    def append(self, il: int, k: np.ndarray, v: np.ndarray) -> None:
        """:meth:`reference.model.KVCache.append`, then drop the K/V of the layers no layer from ``il`` on reads
        (every layer before ``il`` has run: a forward runs its layers in order)."""
        super().append(il, k, v)
        for j in [j for j in self.k if self.last_reader.get(j, j) < il]:
            del self.k[j], self.v[j]


class ReferenceRuns:
    """The oracle's outputs on one model, computed once per approximation set and shared by every pair.

    Args:
        ref: the reference engine of the model (its config and stored weight types are read from it).
        oracle: the engine whose outputs are the oracle side: None for ``ref`` itself, or a fast engine in fp32
            (``--oracle fast``); it makes the emulations of :data:`harness.engines.numerics.EMULATED` too (the
            GELU table and the attention's by the fast twins of the reference's emulations, ``quantized_activations``
            by its own ``--compute q8``: :meth:`numerics`), and re-seeds its forward from an engine's stream
            (:meth:`reseeded`). Its ``engine`` attribute names the pairs.

    Attributes:
        name: the oracle's name in pair names (``reference``, or the oracle engine's ``engine``: ``fast``).
    """

    def __init__(self, ref: ReferenceEngine, oracle: Any = None) -> None:
        self.ref = ref
        self.oracle = ref if oracle is None else oracle
        self.name = ORACLE if oracle is None else oracle.engine
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
                    # float32 as computed, in the job's tensor store (spilled past its budget): half the bytes of a
                    # float64 copy; logits() widens it when read, exactly
                    self._logits[(a, str(p["id"]))] = (default_store().keep(run.logits.float().cpu().numpy()),
                                                       w.trace())
                    if how == "forced":
                        self._forced[(along, new_tokens, str(p["id"]))] = torch_rows(
                            [run.logits[-1:]] + ([] if run.forced is None else [run.forced]))
                if how == "stream":
                    self._gens[(a, new_tokens, top_n)] = as_streams(part, [run.stream for run in runs])

    def cached_logits(self, prompt: dict[str, Any]) -> tuple[int, np.ndarray] | None:
        """``(prefill, float64 [T, V])``: the prompt's cached-vs-uncached logits when :meth:`prefetch` computed
        them (a prefill of ``prefill`` tokens, then one token per forward), else None."""
        return self._cached.get(str(prompt["id"]))

    def numerics(self, approx: Sequence[str], jitter_rng: np.random.Generator | None = None) -> ContextManager:
        """The oracle under the emulations ``approx`` (:meth:`harness.engines.numerics.Numerics.emulation`): the
        reference's (:func:`harness.engines.numerics.emulate`); with the fast oracle (``--oracle fast``) and
        ``quantized_activations`` in ``approx``, its forwards compute as llama.cpp does too (``--compute q8``:
        :meth:`harness.engines.fast.FastEngine.computing`, :mod:`fast.q8_compute`). ``jitter_rng``: the stream the
        ``jitter_sums`` null draws from across entries (:meth:`reseeded_many`); None: a fresh one per entry."""
        return emulate(approx, fast_q8=self._fast_q8(), jitter_rng=jitter_rng)

    def _fast_q8(self) -> Callable[[], ContextManager] | None:
        """The fast oracle's q8 compute (:meth:`harness.engines.fast.FastEngine.computing`), or None (the reference
        as the oracle, or an oracle that cannot)."""
        computing = getattr(self.oracle, "computing", None) if self.oracle is not self.ref else None
        return None if computing is None else (lambda: computing("q8"))

    def emulation_gap(self, numerics: Numerics, types: Sequence[str]) -> str | None:
        """Why the oracle cannot emulate the quantized activations of an engine with ``numerics`` on matrices of
        ``types`` (:meth:`unemulated_types`), or None when it can (the reference as the oracle, or the fast oracle,
        which computes them as llama.cpp does: :meth:`numerics`; the engine's dot-product types llama.cpp's, every
        type in llama.cpp's table)."""
        if self.name != ORACLE and self._fast_q8() is None:
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
        """The oracle's logits ``[T, V]`` as float64 and the trace (tensors kept) of one prompt, under ``approx``
        (a fast oracle's are kept as float32, as it computed them, and widened here)."""
        z, trace = self._run(approx, prompt)
        return np.asarray(z, dtype=np.float64), trace

    def trace(self, approx: tuple[str, ...], prompt: dict[str, Any]) -> Trace:
        """The trace of :meth:`logits` alone: the logits are not widened (a ``[T, V]`` float64 copy of a fast oracle's,
        455 MB at 217 positions of a 262,144-token vocabulary, for a caller that reads only the trace)."""
        return self._run(approx, prompt)[1]

    def _run(self, approx: tuple[str, ...], prompt: dict[str, Any]) -> tuple[np.ndarray, Trace]:
        key = (approx, str(prompt["id"]))
        if key not in self._logits:
            w = TraceWriter(self.name, prompt["prompt_ids"], dtype="float64" if self.name == ORACLE else "float32",
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
        fp32 output jittered in its last bits (``(*approx, "jitter_sums")``, :data:`.quantized.NULL`: what an engine
        summing in fp32 in another order leaves, the null of ``local_median``). The first layer enters with the
        engine's ``inp_scaled`` where it traced it. Two forwards, not kept (another engine's trace is another seed).
        The fast oracle (``--oracle fast``) re-seeds its own forward the same way (:meth:`fast.model.FastModel.step`'s
        ``layer_inputs``), in q8 compute (:meth:`numerics`). None when the oracle can do neither, or the engine's
        trace lacks an ``l_out`` tensor of the prompt's shape. Many prompts at once: :meth:`reseeded_many`."""
        fast = self.oracle is not self.ref
        if fast and self._fast_q8() is None:
            return None
        seeds = self._seeds(prompt, engine)
        if seeds is None:
            return None
        out = []
        for a in (approx, (*approx, "jitter_sums")):
            w = TraceWriter(self.name, prompt["prompt_ids"], dtype="float32" if fast else "float64",
                            keep_tensors=True)
            with self.numerics(a):
                self.oracle.logits(prompt["prompt_ids"], trace=w, layer_inputs=seeds)
            out.append(w.trace())
        return out[0], out[1]

    def _seeds(self, prompt: dict[str, Any], engine: Trace) -> dict[int, np.ndarray] | None:
        """The re-seeded forward's ``layer_inputs`` from the engine's trace (:meth:`reseeded`): layer 0 its
        ``inp_scaled`` where traced in the prompt's shape, layer L + 1 its ``l_out`` of layer L; None when an
        ``l_out`` is missing or not ``[T, h]``."""
        T, h = len(prompt["prompt_ids"]), self.ref.cfg.hidden_size
        first = engine.tensor("inp_scaled", -1)  # the first layer's input too, where traced: its fp32 bits
        seeds = {0: first} if first is not None and first.shape == (T, h) else {}
        for il in range(self.ref.cfg.n_layer):
            t = engine.tensor("l_out", il)
            if t is None or t.shape != (T, h):
                return None
            seeds[il + 1] = t
        return seeds

    def reseeded_many(self, approx: tuple[str, ...], prompts: Sequence[dict[str, Any]], engines: Sequence[Trace],
                      progress: Progress = lambda m: None) -> list[tuple[Trace, Trace] | None]:
        """:meth:`reseeded` of every prompt of ``prompts`` from the engine's trace of it (``engines[i]``), with the
        reference as the oracle in one pass over the weights, layer-outer (:func:`reference.batch.forward_chains`,
        a chain of one re-seeded call per prompt and set): each layer's weights read and dequantized once for every
        prompt and both sets, where one by one each forward read them again (on the 26B-A4B shape, every expert
        16 times for 8 prompts).

        The same traces as :meth:`reseeded`, bit for bit, the null's too: the emulating forward's values are the
        one-by-one path's (:mod:`reference.batch`); the null's random draws (``jitter_sums``,
        :func:`harness.engines.llamacpp.numerics.jitter_sums_numerics`) come from one ``numpy.random.Generator``
        of seed 0 per prompt, kept across its chain's operations (``jitter_rng`` of :meth:`numerics`), and a chain
        of one call runs its products in :func:`reference.model.forward`'s order with the same output shapes, so it
        draws the numbers the one-by-one forward draws, where they land there (``tests/test_local_gate.py``). Each
        chain's KV cache keeps a layer's K/V only while a later layer reads them (:class:`PassingCache`).

        One by one (:meth:`reseeded` per prompt) with the fast oracle (``--oracle fast``), where ``approx`` holds
        the input jitter (``jitter``: its product input and offset are paired per call, which the many-forwards path
        does not keep), or where a ``--spec`` variant replaces a function that path does the work of
        (:func:`reference.batch.replaced`). ``progress``: told the pass's layers as they finish. Returns, per
        prompt, what :meth:`reseeded` returns."""
        prompts, engines = list(prompts), list(engines)
        if (self.oracle is not self.ref or "jitter" in approx or batch.replaced()
                or not hasattr(self.ref, "logits_chains")):
            return [self.reseeded(approx, p, e) for p, e in zip(prompts, engines)]
        seeds = [self._seeds(p, e) for p, e in zip(prompts, engines)]
        chains, writers = [], []
        for p, s in zip(prompts, seeds):
            if s is None:
                continue
            for a, rng in ((approx, None), ((*approx, "jitter_sums"), np.random.default_rng(0))):
                w = TraceWriter(self.name, p["prompt_ids"], dtype="float64", keep_tensors=True)
                chains.append(batch.Chain([list(p["prompt_ids"])], cache=PassingCache(self.ref.cfg), traces=[w],
                                          layer_inputs=[s],
                                          numerics=lambda a=a, rng=rng: self.numerics(a, jitter_rng=rng)))
                writers.append(w)
        if chains:
            self.passes += 1
            progress(f"{self.name} re-seeded from the engine's stream: {len(chains) // 2} prompt(s), both sets, "
                     "one pass over the weights")
            self.ref.logits_chains(chains, on_layer=lambda i, n: progress(f"re-seeded pass: layer {i}/{n}"))
        traces = iter(w.trace() for w in writers)
        return [None if s is None else (next(traces), next(traces)) for s in seeds]

    def local_errors(self, approx: tuple[str, ...], prompt: dict[str, Any], engine: Trace
                     ) -> dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] | None:
        """:func:`local_errors` of the engine's trace ``engine`` of ``prompt`` against the reference re-seeded from
        it under ``approx`` (:meth:`reseeded`): what ``<pair>_q8.local_median`` pools, in the pair and in its
        explanation's trials. None when ``approx`` does not round activations (no such figure) or the trace cannot
        re-seed the reference."""
        return self.local_errors_many(approx, [prompt], [engine])[0]

    def local_errors_many(self, approx: tuple[str, ...], prompts: Sequence[dict[str, Any]], engines: Sequence[Trace],
                          progress: Progress = lambda m: None
                          ) -> list[dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] | None]:
        """:meth:`local_errors` of every prompt of ``prompts`` and the engine's trace of it (``engines[i]``), the
        re-seeded forwards of all of them in one pass over the weights (:meth:`reseeded_many`): the pair's
        ``local_median`` (``harness/parity/checks/pair.py``)."""
        if "quantized_activations" not in approx:
            return [None] * len(prompts)
        seeded = self.reseeded_many(approx, prompts, engines, progress)
        return [None if s is None else local_errors(e, *s, self.ref.cfg.n_layer) for e, s in zip(engines, seeded)]

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
        would not be what the engine ran). With the reference as the oracle, in one pass over the weights
        (:func:`reference.batch.forward_chains`) unless ``approx`` jitters (``jitter``, ``jitter_sums``: its random
        stream is the one-by-one path's) or a ``--spec`` variant replaces what that path does; with the fast oracle
        (``--oracle fast``), its own prefill and decode steps (:meth:`harness.engines.fast.FastEngine.logits_cached`)."""
        fast = self.oracle is not self.ref
        if fast or any(a.startswith("jitter") for a in approx) or batch.replaced() or not prompts:
            side = self.oracle if fast else self.ref
            out = []
            for ids, toks in zip(prompts, tokens):
                with self.numerics(approx):
                    out.append(np.asarray(side.logits_cached(list(ids) + list(toks), len(ids)), dtype=np.float64))
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

