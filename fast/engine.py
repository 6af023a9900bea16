"""Greedy generation with continuous batching over the paged cache.

Each scheduler step runs one batched forward (:meth:`fast.model.FastModel.step`)
over every active request: a prefill chunk for a request still reading its
prompt, one token for a request that is decoding. Requests arrive at any step
(``Request.arrival``) and take a free cache slot; they retire as soon as they
have their tokens, freeing the slot mid-batch for the next arrival. The solo
path is the same loop with one slot.

A request may carry soft tokens (:class:`reference.multimodal.Injection`: image and audio rows
and ``mm_token_type_ids``); each prefill chunk takes its own rows and types, and a chunk never
ends inside an image block (:func:`fast.multimodal.chunk_end`, where the reason is given).
Decode steps are text.

Every step's logits are checked (:func:`all_finite`): a NaN or Inf in any row stops the run with
:class:`NonFiniteLogits` naming the request and the sequence it was computing (the harness turns it into one line
naming the first layer and trace point, :mod:`harness.core.finite`). The check is one ``aminmax`` pass over
``[B, V]`` on the device, read back with the step's greedy tokens (:func:`all_finite`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from gemma4_harness.reference.errors import PromptError
from gemma4_harness.reference.model import check_generation, check_prompt
from gemma4_harness.reference.multimodal import Injection, check_injection, pad_id

from . import cpu_kernels
from .model import FastModel, SeqStep
from .multimodal import chunk_end


class NonFiniteLogits(ArithmeticError):
    """A step's logits hold NaN or Inf.

    Attributes:
        request: the request's id.
        ids: the sequence those logits were computed for (its prompt, or prompt chunk, and the tokens so far).
        step: tokens the request had generated before that step (0: its prompt).
        what: the first bad value and how many, as :func:`describe_nonfinite` gives them.
    """

    def __init__(self, request: str, ids: list[int], step: int, what: str) -> None:
        super().__init__(f"request {request}: step {step}: logits {what}")
        self.request, self.ids, self.step, self.what = request, ids, step, what


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """True (a 0-d bool tensor on ``t``'s device, not read back) when every value of ``t`` is finite.

    One ``aminmax`` pass (NaN propagates into both, +Inf is the max, -Inf the min): on a CPU decode step's
    ``[8, 262144]`` logits 0.36 ms, where ``isfinite(t).all()`` (a bool tensor, then a reduction) took 7.5 ms. On the
    CPU it runs on one thread, as a decode step's own small ops do (:func:`fast.cpu_kernels.small_step_threads`: on
    a busy 2-core machine an OpenMP region on 2 threads cost 7 ms here, the barrier waiting for a descheduled
    thread)."""
    with cpu_kernels.small_step_threads() if t.device.type == "cpu" else contextlib.nullcontext():
        lo, hi = torch.aminmax(t)
        return torch.isfinite(lo) & torch.isfinite(hi)


def describe_nonfinite(row: torch.Tensor) -> str:
    """``NaN at [i] (k of V values NaN/Inf)`` of a 1-D tensor that holds one."""
    bad = ~torch.isfinite(row)
    i = int(torch.argmax(bad.to(torch.uint8)))
    v = float(row[i])
    what = "NaN" if v != v else ("+Inf" if v > 0 else "-Inf")
    return f"{what} at [{i}] ({int(bad.sum())} of {row.numel()} values NaN/Inf)"


@dataclass
class Request:
    """One generation request.

    Attributes:
        id: caller's identifier.
        prompt: token ids.
        max_new_tokens: tokens to generate.
        arrival: scheduler step at which the request arrives (0 = at once).
        stop: ids that end the request early (kept in the output).
        mm: the prompt's soft tokens and types, or None for a text-only prompt.
    """

    id: str
    prompt: Sequence[int]
    max_new_tokens: int
    arrival: int = 0
    stop: tuple[int, ...] = ()
    mm: Injection | None = None


@dataclass
class Result:
    """Output of one request: greedy tokens, the top-N ``(id, logprob)`` per step (``top``), and optionally
    the float32 logits ``[V]`` each token was chosen from; ``steps`` = scheduler steps it was active."""

    id: str
    tokens: list[int] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)


@dataclass
class _Active:
    req: Request
    slot: int
    prompt: np.ndarray
    done_prompt: int = 0
    result: Result | None = None

    @property
    def cached(self) -> int:
        return self.done_prompt + max(0, len(self.result.tokens) - 1)


class Engine:
    """Continuous-batching greedy generator.

    Args:
        model: the fast model.
        max_batch: cache slots (1 = the solo path).
        prefill_chunk: prompt tokens per request per step.
        max_tokens: longest sequence (prompt + new tokens); sizes the page pool.
        keep_logits: store each step's logits in the results (for comparisons).
        top_n: ``(id, logprob)`` pairs kept per step (best first).
        check_finite: stop at the first step whose logits hold NaN or Inf (:class:`NonFiniteLogits`); off only to
            measure what the check costs (``g4h bench --engines fast-unchecked``).
    """

    def __init__(self, model: FastModel, max_batch: int = 8, prefill_chunk: int = 64, max_tokens: int = 4096,
                 keep_logits: bool = False, page_size: int = 16, top_n: int = 5, check_finite: bool = True):
        self.model = model
        self.check_finite = check_finite
        self.top_n = int(top_n)
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.max_tokens = max_tokens
        self.keep_logits = keep_logits
        self.page_size = page_size
        self.batch_sizes: list[int] = []

    def run(self, requests: Sequence[Request]) -> dict[str, Result]:
        """Serve every request; returns results by id.

        Raises:
            PromptError: a bad prompt or one longer than ``max_tokens``.
            NonFiniteLogits: a step's logits hold NaN or Inf (with ``check_finite``).
        """
        cfg = self.model.cfg
        pending = sorted(requests, key=lambda r: r.arrival)
        for r in pending:
            ids = np.asarray(r.prompt, dtype=np.int64).reshape(-1)
            if r.mm is not None:
                check_injection(cfg, r.mm, ids.shape[0])
                ids = np.where(r.mm.placeholder, pad_id(cfg), ids)
            check_prompt(cfg, ids)
            if len(r.prompt) + r.max_new_tokens > self.max_tokens:
                raise PromptError(f"request {r.id}: {len(r.prompt)} + {r.max_new_tokens} tokens exceed "
                                  f"max_tokens {self.max_tokens}")
        cache = self.model.new_cache(self.max_batch, self.max_tokens, self.page_size)
        active: list[_Active] = []
        results: dict[str, Result] = {}
        step = 0
        with torch.inference_mode():
            while pending or active:
                while pending and pending[0].arrival <= step and len(active) < self.max_batch:
                    r = pending.pop(0)
                    a = _Active(r, cache.alloc(), np.asarray(r.prompt, dtype=np.int64), result=Result(r.id))
                    active.append(a)
                if not active:
                    step = max(step + 1, pending[0].arrival)
                    continue
                seqs = []
                for a in active:
                    if a.done_prompt < len(a.prompt):
                        lo, mm = a.done_prompt, a.req.mm
                        hi = chunk_end(cfg, mm, lo, self.prefill_chunk, len(a.prompt))
                        seqs.append(SeqStep(a.slot, torch.from_numpy(a.prompt[lo:hi]), lo,
                                            None if mm is None else mm.part(lo, hi)))
                    else:
                        seqs.append(SeqStep(a.slot, torch.tensor([a.result.tokens[-1]]), a.cached))
                self.batch_sizes.append(len(seqs))
                logits = self.model.step(cache, seqs)  # [B, V] float32
                if self.check_finite and not bool(all_finite(logits)):
                    self._nonfinite(active, seqs, logits)
                still = []
                for a, s, row in zip(active, seqs, logits):
                    a.result.steps.append(step)
                    if a.done_prompt < len(a.prompt):
                        a.done_prompt += int(s.ids.numel())
                        if a.done_prompt < len(a.prompt):
                            still.append(a)
                            continue
                    self._emit(a, row)
                    r = a.req
                    if len(a.result.tokens) >= r.max_new_tokens or a.result.tokens[-1] in r.stop:
                        cache.free(a.slot)
                        results[r.id] = a.result
                    else:
                        still.append(a)
                active = still
                step += 1
        return results

    @staticmethod
    def _nonfinite(active: list[_Active], seqs: list[SeqStep], logits: torch.Tensor) -> None:
        """Raise :class:`NonFiniteLogits` for the first row of ``logits`` that holds a NaN or Inf."""
        for a, s, row in zip(active, seqs, logits):
            if not bool(all_finite(row)):
                ids = [int(t) for t in a.prompt[:s.start + int(s.ids.numel())]] if a.done_prompt < len(a.prompt) \
                    else [int(t) for t in a.prompt] + list(a.result.tokens)
                raise NonFiniteLogits(a.req.id, ids, len(a.result.tokens), describe_nonfinite(row))

    def _emit(self, a: _Active, row: torch.Tensor) -> None:
        pick(a.result, row, self.top_n, self.keep_logits)


def pick(result: Result, row: torch.Tensor, top_n: int, keep_logits: bool = False) -> int:
    """The greedy token of one step's logits ``row`` ``[V]``, appended to ``result`` with the step's top-``top_n``
    ``(id, logprob)`` (log-softmax in float32); ``keep_logits``: the row too. Returns the token."""
    logp = torch.log_softmax(row.float(), dim=-1)
    top = torch.topk(logp, min(top_n, logp.numel()))
    tok = int(torch.argmax(row).item())
    result.tokens.append(tok)
    result.top.append([(int(i), float(v)) for i, v in zip(top.indices.tolist(), top.values.tolist())])
    if keep_logits:
        result.logits.append(row.float().cpu().numpy().copy())
    return tok


@dataclass
class PromptRun:
    """What :func:`prompt_runs` computed from one prompt's cache.

    Attributes:
        logits: float32 ``[T, V]``, every position of the prompt.
        stream: the greedy continuation (tokens and top-N log-probs) when asked, else None.
        forced: float32 ``[len(forced), V]``: the logits after each teacher-forced token, when asked, else None.
    """

    logits: torch.Tensor
    stream: Result | None = None
    forced: torch.Tensor | None = None


def prompt_runs(model: FastModel, prompts: Sequence[Sequence[int]], traces: Sequence | None = None,
                new_tokens: int = 0, forced: Sequence[Sequence[int]] | None = None, top_n: int = 5,
                check_finite: bool = True, max_batch: int = 8) -> list[PromptRun]:
    """Each prompt's logits at every position (a one-shot prefill of that prompt alone, traced with its entry of
    ``traces``), then from the same cache either a greedy stream of ``new_tokens`` tokens or the logits after
    each token of its ``forced`` list (one step over all of them: teacher forcing). What a job asks of an oracle,
    without a second prefill: :meth:`fast.model.FastModel.logits` and :func:`generate` computed each prompt twice
    (the latter in chunks of 64).

    The streams of up to ``max_batch`` prompts decode together, one step for all of them: an eighth of the passes
    over the weights. A prompt's stream is then its stream alone within fp32 rounding, not always bit for bit
    (the batched~solo bound, ``tests/test_fast.py``: on the CPU the packed kernels give each row the same bits at
    any batch up to :data:`fast.cpu_kernels.MAX_ROWS` rows, but on models with per-layer embeddings some small
    operations do not).

    Args:
        model: the fast model.
        prompts: token id sequences (text).
        traces: one callback ``(point, layer, array)`` or None per prompt, for its prefill; None: no traces.
        new_tokens: tokens to generate per prompt (0: none).
        forced: per prompt, the tokens fed after it (not with ``new_tokens``); None: none.
        top_n: ``(id, logprob)`` pairs kept per generated step.
        check_finite: a generated step's logits holding NaN or Inf raise :class:`NonFiniteLogits`.
        max_batch: prompts whose caches are held at once.

    Returns:
        One :class:`PromptRun` per prompt, in order; ``stream.tokens[0]`` is the greedy token of ``logits[-1]``.

    Raises:
        ValueError: both ``new_tokens`` and ``forced``; ``traces`` or ``forced`` not one per prompt.
        PromptError: see :func:`reference.model.check_generation` (with ``new_tokens``) and ``check_prompt``.
        NonFiniteLogits: see ``check_finite`` (the request is the prompt's index).
    """
    n_forced = [list(f) for f in forced] if forced is not None else [[] for _ in prompts]
    traces = list(traces) if traces is not None else [None] * len(prompts)
    if len(n_forced) != len(prompts) or len(traces) != len(prompts):
        raise ValueError("prompt_runs: traces and forced hold one entry per prompt")
    if new_tokens and any(n_forced):
        raise ValueError("prompt_runs: a greedy stream or teacher-forced tokens, not both")
    seqs = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
    if new_tokens:
        check_generation(model.cfg, [s.tolist() for s in seqs], new_tokens)
    for s, f in zip(seqs, n_forced):
        check_prompt(model.cfg, np.concatenate([s, np.asarray(f, dtype=np.int64)]))
    out: list[PromptRun] = []
    for lo in range(0, len(seqs), max_batch):
        group = range(lo, min(lo + max_batch, len(seqs)))
        longest = max(len(seqs[k]) + max(new_tokens, len(n_forced[k])) for k in group)
        cache = model.new_cache(len(group), longest, bounded=True)
        slots = [cache.alloc() for _ in group]
        with torch.inference_mode():
            runs = []
            for k, slot in zip(group, slots):
                run = PromptRun(model.step(cache, [SeqStep(slot, torch.from_numpy(seqs[k]), 0)], all_logits=True,
                                           trace=traces[k]))
                if n_forced[k]:
                    f = torch.as_tensor(np.asarray(n_forced[k], dtype=np.int64))
                    run.forced = model.step(cache, [SeqStep(slot, f, len(seqs[k]))], all_logits=True)
                runs.append(run)
            if new_tokens:
                _streams(model, cache, slots, [seqs[k] for k in group], runs, group.start, new_tokens, top_n,
                         check_finite)
        out += runs
    return out


def _streams(model: FastModel, cache, slots: list[int], seqs: list[np.ndarray], runs: list[PromptRun], first: int,
             new_tokens: int, top_n: int, check_finite: bool) -> None:
    """:func:`prompt_runs`' greedy streams of one group, every sequence one token per step."""
    for run in runs:
        run.stream = Result("0")
    rows = [run.logits[-1] for run in runs]
    for i in range(new_tokens):
        for k, (run, row) in enumerate(zip(runs, rows)):
            if check_finite and not bool(all_finite(row)):
                raise NonFiniteLogits(str(first + k), seqs[k].tolist() + run.stream.tokens, i,
                                      describe_nonfinite(row))
            pick(run.stream, row, top_n)
        if i + 1 < new_tokens:
            rows = list(model.step(cache, [SeqStep(slot, torch.tensor([run.stream.tokens[-1]]), len(s) + i)
                                           for slot, s, run in zip(slots, seqs, runs)]))


def generate(model: FastModel, prompts: Sequence[Sequence[int]], max_new_tokens: int, batched: bool = True,
             max_batch: int = 8, prefill_chunk: int = 64,
             mm: Sequence[Injection | None] | None = None, top_n: int = 5, check_finite: bool = True) -> list[Result]:
    """Greedy continuations of ``prompts`` (all arriving at step 0), batched or solo, in input order;
    ``mm``: each prompt's soft tokens and types (None entries: text only); ``top_n`` log-probs kept per step;
    ``check_finite``: see :class:`Engine`.

    Raises:
        PromptError: see :func:`reference.model.check_generation` (checked before the KV cache is sized, so
            nothing huge is allocated).
        NonFiniteLogits: a step's logits hold NaN or Inf.
    """
    check_generation(model.cfg, prompts, max_new_tokens)
    mm = list(mm) if mm is not None else [None] * len(prompts)
    reqs = [Request(str(i), p, max_new_tokens, mm=m) for i, (p, m) in enumerate(zip(prompts, mm))]
    longest = max(len(p) for p in prompts) + max_new_tokens
    eng = Engine(model, max_batch=max_batch if batched else 1, prefill_chunk=prefill_chunk, max_tokens=longest,
                 top_n=top_n, check_finite=check_finite)
    res = eng.run(reqs)
    return [res[r.id] for r in reqs]
