"""What the server checks (:mod:`.server`) share: their options (:class:`ServerOptions`), the reference's streams they
compare a server with (:class:`OracleStream`, :func:`oracle_streams`), and how a failing request is named and a check the
dialect does not offer is reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from gemma4_harness.reference.errors import InputError

from ...core.gates import NEAR_TIE_MARGIN
from ...core.metrics import log_softmax
from ...core.workers import EngineFailure
from ...engines.base import TOP_N
from ..result import Figure, fig
from .reference_runs import ReferenceRuns


REQUIRABLE = ("server-template", "server-prompt-logprobs")
"""Server checks a dialect may not offer (llama-cpp-python has no chat-template endpoint, llama-server no prompt
log-probs): reported as "not offered by <dialect>" without failing the run, unless ``--require`` names them."""


@dataclass(frozen=True)
class ServerOptions:
    """Options of the server checks (``g4h parity`` flags in brackets).

    Attributes:
        max_new_tokens: tokens generated per request, as in every pair's greedy streams [``--max-new-tokens``].
        batch_requests: requests in the batch-invariance run [``--batch-requests``].
        concurrency: at most this many of them in flight [``--concurrency``].
        stagger_s: seconds between the starts of two batch requests; None: the median time of one request sent
            alone over ``concurrency``.
        skip: checks opted out (:data:`harness.parity.skips.SKIPPABLE`; the greedy and log-prob figures always
            run) [``--skip``].
        require: checks a dialect may not offer that must run all the same (:data:`REQUIRABLE`): one the server does
            not offer then fails instead of being reported as "not offered by <dialect>" [``--require``].
        top_n: vLLM's N: log-probabilities asked per step of every engine and kept by the oracle; a divergent
            token passes the greedy rule when each side's token is in the other's top-N [``--top-n``].
    """

    max_new_tokens: int = 8
    batch_requests: int = 16
    concurrency: int = 8
    stagger_s: float | None = None
    skip: tuple[str, ...] = field(default_factory=tuple)
    top_n: int = TOP_N
    require: tuple[str, ...] = field(default_factory=tuple)

    def check(self) -> None:
        """Refuse values that cannot work.

        Raises:
            InputError: a count that is not positive (the option is named).
        """
        for flag, v in (("--max-new-tokens", self.max_new_tokens), ("--batch-requests", self.batch_requests),
                        ("--concurrency", self.concurrency), ("--top-n", self.top_n)):
            if int(v) < 1:
                raise InputError(f"{flag} {v}: expected >= 1")
        bad = [r for r in self.require if r not in REQUIRABLE]
        if bad:
            raise InputError(f"--require {bad[0]!r}: expected one of {', '.join(REQUIRABLE)}")


# --------------------------------------------------------------------------- the reference's streams


@dataclass
class OracleStream:
    """The reference's greedy continuation of one prompt, as the stop checks read it.

    Attributes:
        tokens: the greedy ids (EOS does not stop it).
        top: per step, the top-5 ``(id, logprob)`` pairs, best first.
        margin: per step, the log-prob margin of the top-1 over the top-2.
        logprobs: per step, id -> logprob of the top-5.
        prompt_eos: ``(position, margin)`` inside the prompt (not its last) where the greedy next token is EOS.
        prompt_lp: per prompt position ``i >= 1``, the log-prob of the prompt's token ``i`` after the ones before it,
            and the top-5 ``{id: logprob}`` there (index 0 is None: nothing precedes the first token).
        prompt_effect: how far the emulated approximations move ``prompt_lp`` (the same entries from the exact
            reference, max |Δ|; 0 without emulation), and where.
        near_tie: the top-1 margin below which a parting from this stream is a near-tie
            (:func:`harness.parity.checks.pair.near_tie_margin` of the pair's log-prob limit).
    """

    tokens: list[int]
    top: list[list[tuple[int, float]]]
    margin: list[float]
    logprobs: list[dict[int, float]]
    prompt_eos: list[tuple[int, float]]
    prompt_lp: list[tuple[float, dict[int, float]] | None] = field(default_factory=list)
    prompt_effect: tuple[float, str | None] = (0.0, None)
    near_tie: float = NEAR_TIE_MARGIN


def oracle_streams(runs: ReferenceRuns, approx: tuple[str, ...], prompts: Sequence[dict[str, Any]], n: int,
                   eos_ids: set[int], top_n: int = TOP_N,
                   near_tie: float = NEAR_TIE_MARGIN) -> dict[str, OracleStream]:
    """The oracle's streams of ``n`` tokens with their top-``top_n`` log-probs (shared with the pair check,
    :meth:`ReferenceRuns.generations`) and, from one forward over each prompt, the prompt positions whose greedy
    next token is EOS and the prompt's log-probs; under the emulations ``approx``, whose effect on the prompt's
    log-probs is measured against one more forward without them."""
    gens = runs.generations(approx, prompts, n, top_n)
    prefixes = [list(p["prompt_ids"])[:-1] for p in prompts if len(p["prompt_ids"]) > 1]
    with_approx = iter(runs.raw_logits_many(approx, prefixes))  # one pass over the weights for all prompts
    without = iter(runs.raw_logits_many((), prefixes) if approx else [])
    out = {}
    for p in prompts:
        g = gens[str(p["id"])]
        top = [sorted(d.items(), key=lambda kv: -kv[1]) for d in g["logprobs"]]
        margin = [t[0][1] - t[1][1] if len(t) > 1 else float("inf") for t in top]
        ids = list(p["prompt_ids"])
        sites, plp, effect = [], [None], (0.0, None)
        if len(ids) > 1:
            lp = log_softmax(next(with_approx))
            exact = log_softmax(next(without)) if approx else lp
            for j in np.nonzero(np.isin(np.argmax(lp, axis=1), list(eos_ids)))[0] if eos_ids else ():
                srt = np.sort(lp[j])
                sites.append((int(j), float(srt[-1] - srt[-2])))
            for i in range(1, len(ids)):
                row = lp[i - 1]
                best = np.argsort(-row, kind="stable")[:top_n]
                plp.append((float(row[ids[i]]), {int(k): float(row[k]) for k in best}))
                for k in (ids[i], *best):
                    d = abs(float(row[k] - exact[i - 1][k]))
                    if d > effect[0]:
                        effect = (d, f"request {p['id']} position {i} token {int(k)}: {row[k]:.6g} with, "
                                     f"{exact[i - 1][k]:.6g} without")
        out[str(p["id"])] = OracleStream(list(g["tokens"]), top, margin, list(g["logprobs"]), sites, plp, effect,
                                         near_tie)
    return out


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def named(request: Any, call: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """``call(*args, **kw)``; an engine failure in it names ``request`` (the request as the report shows it)."""
    try:
        return call(*args, **kw)
    except EngineFailure as e:
        raise e.at(request=request)


def not_offered(gate: str, dialect: str, what: str, name: str, required: bool) -> Figure:
    """A check the dialect does not offer: informational ("not offered by <dialect>"), or, when the user required it
    (``--require NAME``), a failing figure saying so."""
    got = f"not offered by {dialect}: {what}"
    if required:
        return fig(gate, float("nan"), None, got=f"{got} (required with --require {name})",
                   why=f"{got}; --require {name} makes that a failure")
    return fig(gate, float("nan"), None, got=got, informational_reason=f"{got} (--require {name} makes it fail)")
