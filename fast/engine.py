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

from reference.errors import PromptError
from reference.model import check_generation, check_prompt
from reference.multimodal import Injection, check_injection, pad_id

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
        logp = torch.log_softmax(row.float(), dim=-1)
        top = torch.topk(logp, min(self.top_n, logp.numel()))
        tok = int(torch.argmax(row).item())
        a.result.tokens.append(tok)
        a.result.top.append([(int(i), float(v)) for i, v in zip(top.indices.tolist(), top.values.tolist())])
        if self.keep_logits:
            a.result.logits.append(row.float().cpu().numpy().copy())


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
