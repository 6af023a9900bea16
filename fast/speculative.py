"""Speculative greedy decoding over the fast engine's continuous batching, with any drafter.

Each scheduler step of :class:`SpecEngine` first asks the proposer for drafts for every decoding request (up
to ``k`` each, never more than the request still needs minus one), then runs ONE batched target forward over
every active request: a prefill chunk for a request still reading its prompt, ``[last token, d_1 .. d_n]`` for
a decoding one. Verification is greedy: with ``g_j`` the target's argmax after ``last, d_1 .. d_j``, the
request accepts the longest prefix of drafts with ``d_j = g_{j-1}`` (``a`` of them) and emits
``g_0 .. g_a``: the agreeing drafts plus one target token. The cache then rolls back to the tokens it keeps
(:meth:`fast.kvcache.PagedKVCache.truncate`, ring buffers included: they keep ``k`` slots beyond the window),
and the hidden state that produced ``g_a`` becomes the drafter's next ``h_prev``. Whatever the drafts are, the
output is the target's own greedy output, token for token, as long as a verify forward over ``n + 1`` rows
picks the same argmax as ``n + 1`` one-token decode steps (fp32 rounding differs between the two shapes, so
a near-tie can flip; the parity check reports such flips).

Proposers (:class:`Proposer`): :class:`ModelProposer` (a Gemma 4 assistant, :class:`fast.drafter.FastDrafter`),
and three that exercise the verifier: :class:`OracleProposer` (the target's own greedy tokens: every draft is
accepted), :class:`RandomProposer` (uniform random tokens: almost none is), :class:`PartialProposer` (right
for ``j`` tokens, then wrong: exactly ``min(j, n)`` of ``n`` accepted per round).

Sources: Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding" (greedy case);
transformers ``_assisted_decoding`` (n_matches, one bonus token, cache crop); llama.cpp ``common/speculative.cpp``.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np
import torch

from gemma4_harness.reference.errors import InputError, PromptError
from gemma4_harness.reference.model import check_prompt

from .drafter import FastDrafter
from .engine import Engine, Request, Result
from .kvcache import PagedKVCache
from .model import FastModel, SeqStep


@dataclass
class DraftRow:
    """One request that wants drafts this round.

    Attributes:
        id: the request id.
        slot: its cache slot.
        position: the position of its last token (the cache holds exactly the positions before it).
        token: its last token (not yet read by the target).
        emitted: the tokens it has generated so far (``token`` is the last).
        n: drafts wanted.
        h_prev: [H_t] the target's ``result_norm`` that produced ``token``.
    """

    id: str
    slot: int
    position: int
    token: int
    emitted: list[int]
    n: int
    h_prev: torch.Tensor


class Proposer(Protocol):
    """Proposes draft tokens for the requests of one round."""

    name: str

    def propose(self, cache: PagedKVCache, rows: Sequence[DraftRow]) -> list[list[int]]:
        """``rows[i].n`` draft tokens for each row."""


class ModelProposer:
    """Drafts from a Gemma 4 assistant (:class:`fast.drafter.FastDrafter`), all rows of a round as one batch."""

    def __init__(self, drafter: FastDrafter, name: str = "model"):
        self.drafter = drafter
        self.name = name

    def propose(self, cache: PagedKVCache, rows: Sequence[DraftRow]) -> list[list[int]]:
        """Greedy drafts of the assistant (see :meth:`fast.drafter.FastDrafter.draft`)."""
        if not rows:
            return []
        h = torch.stack([r.h_prev for r in rows])
        return self.drafter.draft(cache, [r.slot for r in rows], [r.token for r in rows], h,
                                  [r.position for r in rows], [r.n for r in rows])


class OracleProposer:
    """Proposes the target's own greedy continuation (from a plain run): 100 % acceptance unless verification
    and decoding disagree.

    Args:
        continuations: request id -> the target's plain greedy tokens (:func:`plain_continuations`).
    """

    name = "oracle"

    def __init__(self, continuations: dict[str, list[int]]):
        self.continuations = continuations

    def _greedy(self, row: DraftRow) -> list[int]:
        cont = self.continuations.get(row.id)
        if cont is None:
            raise InputError(f"oracle drafter: no plain greedy continuation for request {row.id!r}")
        m = len(row.emitted)
        return (cont[m:m + row.n] + [0] * row.n)[:row.n]

    def propose(self, cache: PagedKVCache, rows: Sequence[DraftRow]) -> list[list[int]]:
        """The next ``n`` tokens of each request's plain greedy continuation."""
        return [self._greedy(r) for r in rows]


class PartialProposer(OracleProposer):
    """Right for ``correct`` tokens of every round, then wrong (the greedy token + 1, mod V).

    Per round of ``n`` drafts exactly ``min(correct, n)`` are accepted (the first wrong one stops the prefix).
    """

    def __init__(self, continuations: dict[str, list[int]], correct: int, vocab: int):
        super().__init__(continuations)
        self.correct = correct
        self.vocab = vocab
        self.name = f"partial{correct}"

    def propose(self, cache: PagedKVCache, rows: Sequence[DraftRow]) -> list[list[int]]:
        """The greedy continuation's first ``correct`` tokens, then wrong ones."""
        out = []
        for r in rows:
            g = self._greedy(r)
            out.append([t if j < self.correct else (t + 1) % self.vocab for j, t in enumerate(g)])
        return out


class RandomProposer:
    """Uniform random tokens, seeded by ``(seed, request id, tokens emitted)``: the same drafts whatever the batching."""

    name = "random"

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab = vocab
        self.seed = seed

    def propose(self, cache: PagedKVCache, rows: Sequence[DraftRow]) -> list[list[int]]:
        """``n`` uniform draws from ``[0, vocab)`` per row."""
        out = []
        for r in rows:
            rng = np.random.default_rng([self.seed, zlib.crc32(r.id.encode()), len(r.emitted)])
            out.append([int(t) for t in rng.integers(0, self.vocab, r.n)])
        return out


def plain_continuations(model: FastModel, requests: Sequence[Request], prefill_chunk: int = 64,
                        max_batch: int = 8) -> dict[str, list[int]]:
    """The target's plain greedy tokens of every request (the continuous-batching :class:`fast.engine.Engine`)."""
    longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    res = Engine(model, max_batch=max_batch, prefill_chunk=prefill_chunk, max_tokens=longest).run(requests)
    return {k: v.tokens for k, v in res.items()}


# --------------------------------------------------------------------------- the engine


@dataclass
class SpecStats:
    """One request's speculation figures.

    Attributes:
        drafted: draft tokens proposed to the verifier.
        accepted: drafts the verifier accepted.
        target_forwards: target forwards that produced tokens for the request (the one that finished its prompt,
            then one per verify round).
        rounds: ``(drafted, accepted)`` of every verify round, in order.
    """

    drafted: int = 0
    accepted: int = 0
    target_forwards: int = 0
    rounds: list[tuple[int, int]] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (nan when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    def as_dict(self, n_tokens: int) -> dict:
        """JSON-able figures, with ``tokens_per_forward`` = generated tokens / target forwards."""
        return {"drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": None if not self.drafted else self.acceptance_rate,
                "target_forwards": self.target_forwards,
                "tokens_per_forward": n_tokens / self.target_forwards if self.target_forwards else None}


@dataclass
class SpecResult(Result):
    """A :class:`fast.engine.Result` plus the request's :class:`SpecStats` and its timing (``perf_counter``
    when its first token and its last token were emitted)."""

    stats: SpecStats = field(default_factory=SpecStats)
    t_first: float = 0.0
    t_last: float = 0.0


@dataclass
class _Stream:
    req: Request
    slot: int
    prompt: np.ndarray
    result: SpecResult
    done_prompt: int = 0
    h: torch.Tensor | None = None

    @property
    def position(self) -> int:
        """Position of the last emitted token (the cache holds exactly the positions before it)."""
        return self.done_prompt + len(self.result.tokens) - 1


class SpecEngine:
    """Continuous-batching speculative greedy generator (module docstring).

    Args:
        model: the target.
        proposer: where drafts come from.
        k: the most drafts per request and round (>= 1).
        max_batch, prefill_chunk, max_tokens, keep_logits, page_size: as :class:`fast.engine.Engine`.
        keep_top: record each token's top-5 log-probabilities (a benchmark leaves them out, as the plain ``tg`` does).

    Raises:
        InputError: ``k`` < 1.
    """

    def __init__(self, model: FastModel, proposer: Proposer, k: int, max_batch: int = 8, prefill_chunk: int = 64,
                 max_tokens: int = 4096, keep_logits: bool = False, page_size: int = 16, keep_top: bool = True):
        if k < 1:
            raise InputError(f"--draft-tokens {k}: expected >= 1")
        self.model, self.proposer, self.k = model, proposer, k
        self.max_batch, self.prefill_chunk, self.max_tokens = max_batch, prefill_chunk, max_tokens
        self.keep_logits, self.page_size, self.keep_top = keep_logits, page_size, keep_top
        self.batch_sizes: list[int] = []

    def run(self, requests: Sequence[Request]) -> dict[str, SpecResult]:
        """Serve every request; returns results by id.

        Raises:
            PromptError: a bad prompt or one longer than ``max_tokens``.
        """
        cfg = self.model.cfg
        pending = sorted(requests, key=lambda r: r.arrival)
        for r in pending:
            check_prompt(cfg, r.prompt)
            if len(r.prompt) + r.max_new_tokens > self.max_tokens:
                raise PromptError(f"request {r.id}: {len(r.prompt)} + {r.max_new_tokens} tokens exceed "
                                  f"max_tokens {self.max_tokens}")
        # a verify round writes up to k tokens beyond what the request keeps; rings keep k beyond the window
        cache = self.model.new_cache(self.max_batch, self.max_tokens + self.k, self.page_size, ring_extra=self.k)
        active: list[_Stream] = []
        results: dict[str, SpecResult] = {}
        step = 0
        with torch.inference_mode():
            while pending or active:
                while pending and pending[0].arrival <= step and len(active) < self.max_batch:
                    r = pending.pop(0)
                    active.append(_Stream(r, cache.alloc(), np.asarray(r.prompt, dtype=np.int64), SpecResult(r.id)))
                if not active:
                    step = max(step + 1, pending[0].arrival)
                    continue
                drafts = self._drafts(cache, active)
                active = self._verify(cache, active, drafts, step, results)
                step += 1
        return results

    def _drafts(self, cache: PagedKVCache, active: list[_Stream]) -> dict[str, list[int]]:
        rows = []
        for a in active:
            if a.done_prompt < len(a.prompt):
                continue
            n = min(self.k, a.req.max_new_tokens - len(a.result.tokens) - 1)
            if n > 0:
                rows.append(DraftRow(a.req.id, a.slot, a.position, a.result.tokens[-1], a.result.tokens, n, a.h))
        proposed = self.proposer.propose(cache, rows) if rows else []
        out = {}
        for r, d in zip(rows, proposed):
            if len(d) != r.n:
                raise ValueError(f"proposer {self.proposer.name}: {len(d)} drafts for request {r.id}, asked {r.n}")
            out[r.id] = [int(t) for t in d]
        return out

    def _verify(self, cache: PagedKVCache, active: list[_Stream], drafts: dict[str, list[int]], step: int,
                results: dict[str, SpecResult]) -> list[_Stream]:
        seqs, rows, widths = [], [], []
        offset = 0
        for a in active:
            if a.done_prompt < len(a.prompt):
                chunk = a.prompt[a.done_prompt:a.done_prompt + self.prefill_chunk]
                seqs.append(SeqStep(a.slot, torch.from_numpy(chunk), a.done_prompt))
                rows.append(offset + len(chunk) - 1)
                widths.append(1)
                offset += len(chunk)
            else:
                ids = [a.result.tokens[-1]] + drafts.get(a.req.id, [])
                seqs.append(SeqStep(a.slot, torch.tensor(ids), a.position))
                rows.extend(range(offset, offset + len(ids)))
                widths.append(len(ids))
                offset += len(ids)
        self.batch_sizes.append(len(seqs))
        logits, hidden = self.model.step(cache, seqs, rows=rows, return_hidden=True)
        still, r0 = [], 0
        for a, s, m in zip(active, seqs, widths):
            L, H = logits[r0:r0 + m], hidden[r0:r0 + m]
            r0 += m
            a.result.steps.append(step)
            if a.done_prompt < len(a.prompt):
                a.done_prompt += int(s.ids.numel())
                if a.done_prompt < len(a.prompt):
                    still.append(a)
                    continue
                done, keep_h = self._emit(a, L[:1]), H[0]
            else:
                d = drafts.get(a.req.id, [])
                g = torch.argmax(L, dim=-1).tolist()
                n_acc = 0
                while n_acc < len(d) and d[n_acc] == g[n_acc]:
                    n_acc += 1
                st = a.result.stats
                st.drafted, st.accepted = st.drafted + len(d), st.accepted + n_acc
                st.rounds.append((len(d), n_acc))
                done, keep_h = self._emit(a, L[:n_acc + 1]), H[n_acc]
                if not done:
                    cache.truncate(a.slot, s.start + n_acc + 1)  # keep the last token and the accepted drafts
            a.result.stats.target_forwards += 1
            if done:
                cache.free(a.slot)
                results[a.req.id] = a.result
            else:
                a.h = keep_h
                still.append(a)
        return still

    def _emit(self, a: _Stream, rows: torch.Tensor) -> bool:
        """Emit the argmax of each row in order; True when the request is complete (length or stop token)."""
        res, r = a.result, a.req
        for row in rows:
            tok = int(torch.argmax(row).item())
            res.tokens.append(tok)
            if self.keep_top:
                top = torch.topk(torch.log_softmax(row.float(), dim=-1), 5)
                res.top.append([(int(i), float(v)) for i, v in zip(top.indices.tolist(), top.values.tolist())])
            if self.keep_logits:
                res.logits.append(row.float().cpu().numpy().copy())
            now = time.perf_counter()
            res.t_first = res.t_first or now
            res.t_last = now
            if len(res.tokens) >= r.max_new_tokens or tok in r.stop:
                return True
        return False


def generate_speculative(model: FastModel, proposer: Proposer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                         k: int, batched: bool = True, max_batch: int = 8, prefill_chunk: int = 64) -> list[SpecResult]:
    """Speculative greedy continuations of ``prompts`` (all arriving at step 0), in input order."""
    reqs = [Request(str(i), p, max_new_tokens) for i, p in enumerate(prompts)]
    longest = max(len(p) for p in prompts) + max_new_tokens
    eng = SpecEngine(model, proposer, k, max_batch=max_batch if batched else 1, prefill_chunk=prefill_chunk,
                     max_tokens=longest)
    res = eng.run(reqs)
    return [res[r.id] for r in reqs]
