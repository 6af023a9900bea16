"""Checks of speculative decoding in the fast engine: lossless with every drafter, and acceptance as designed.

Scenarios (every prompt of the set, with lengths shorter and longer than the sliding window, in each):

* ``batched``: a continuous batch of at most 4 with arrivals at steps 0..7 (later ones wait for a slot), one
  request that needs 3 tokens and retires while others run, prefill chunks of ``window + 8``; run with every
  K in :data:`KS`;
* ``solo``: one request at a time, with K = :data:`SOLO_K` (the batched runs already cover every K; a solo run
  of each would double the cost for little).

For every drafter (the case's synthetic assistant, and the three that exercise the verifier: ``oracle``,
``random``, ``partial2``), the speculative run must return the plain run's tokens, token for token. Figures:

* ``speculative.lossless.same_tokens`` per (drafter, K): 1 when every stream of both scenarios equals plain
  greedy; the detail counts the streams and names any flip, with the plain run's top-1 margin there (a margin
  below :data:`harness.core.gates.NEAR_TIE_MARGIN` is a verify-vs-decode near-tie);
* ``speculative.verify~decode.max_abs_logit`` per drafter: the logits each token was chosen from, verify
  forward against one-token decode (before any flip);
* ``speculative.oracle.acceptance`` (all accepted), ``speculative.random.acceptance`` (about 1/V),
  ``speculative.partial.acceptance_error`` (every round accepts exactly ``min(2, drafted)``),
  ``speculative.model.drafted`` (the assistant ran).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from gemma4_harness.fast.engine import Engine, Request, Result
from gemma4_harness.fast.model import FastModel
from gemma4_harness.fast.speculative import OracleProposer, PartialProposer, Proposer, RandomProposer, SpecEngine

from ...core.gates import NEAR_TIE_MARGIN
from ..result import Figure, fig

KS = (1, 2, 4, 7)
"""Draft lengths every drafter is run with."""

SOLO_K = 4
"""The draft length of the solo scenario."""

PARTIAL_CORRECT = 2
"""The partial drafter is right for this many tokens of every round."""

NEW_TOKENS = 12
"""Tokens each request generates (one request of the batched scenario: 3)."""


def scenarios(prompts: Sequence[dict[str, Any]], window: int) -> dict[str, tuple[list[Request], dict[str, int]]]:
    """``name -> (requests, engine options)`` (module docstring)."""
    batched = [Request(str(p["id"]), p["prompt_ids"], 3 if i == 1 else NEW_TOKENS, arrival=i)
               for i, p in enumerate(prompts)]
    solo = [Request(str(p["id"]), p["prompt_ids"], NEW_TOKENS) for p in prompts]
    return {"batched": (batched, {"max_batch": 4, "prefill_chunk": window + 8}),
            "solo": (solo, {"max_batch": 1, "prefill_chunk": 10**6})}


def compare_streams(plain: dict[str, Result], spec: dict[str, Result]) -> dict[str, Any]:
    """Token-for-token comparison of every stream; the verify-vs-decode logit difference before a flip.

    Returns:
        ``streams``, ``mismatched`` (ids), ``flips`` (``[id, index, plain margin, near_tie]``) and
        ``max_abs_logit`` over the positions before each stream's first difference.
    """
    flips, mism, worst = [], [], 0.0
    for rid, pr in plain.items():
        sr = spec[rid]
        n = next((i for i, (a, b) in enumerate(zip(pr.tokens, sr.tokens)) if a != b), None)
        upto = min(len(pr.tokens), len(sr.tokens)) if n is None else n
        if upto:
            worst = max(worst, float(np.max(np.abs(np.array(pr.logits[:upto]) - np.array(sr.logits[:upto])))))
        if n is not None or len(pr.tokens) != len(sr.tokens):
            mism.append(rid)
            if n is not None:
                top = np.sort(pr.logits[n])[-2:]
                margin = float(top[1] - top[0])
                flips.append([rid, n, margin, margin < NEAR_TIE_MARGIN])
    return {"streams": len(plain), "mismatched": mism, "flips": flips, "max_abs_logit": worst}


def speculative_checks(fm: FastModel, prompts: Sequence[dict[str, Any]], info: dict[str, Any], progress, name: str,
                       model_proposer: Callable[[], Proposer] | None = None) -> list[Figure]:
    """Every speculative-decoding figure of one case (module docstring).

    Args:
        fm: the target (fp32).
        model_proposer: builds the case's assistant proposer (None: the case has no drafter spec).
    """
    cfg = fm.cfg
    window = cfg.sliding_window or 16
    plans = scenarios(prompts, window)
    plain: dict[str, dict[str, Result]] = {}
    for sname, (reqs, opts) in plans.items():
        longest = max(len(r.prompt) + r.max_new_tokens for r in reqs)
        plain[sname] = Engine(fm, max_tokens=longest, keep_logits=True, **opts).run(reqs)
    makers: dict[str, Callable[[str], Proposer]] = {
        "oracle": lambda s: OracleProposer({k: v.tokens for k, v in plain[s].items()}),
        "random": lambda s: RandomProposer(cfg.vocab_size, seed=0),
        f"partial{PARTIAL_CORRECT}": lambda s: PartialProposer({k: v.tokens for k, v in plain[s].items()},
                                                               PARTIAL_CORRECT, cfg.vocab_size),
    }
    if model_proposer is not None:
        makers["model"] = lambda s: model_proposer()
    out: list[Figure] = []
    summary: dict[str, Any] = {}
    n_streams = 0
    for pname, make in makers.items():
        progress(f"[{name}] speculative decoding, drafter {pname}, K in {list(KS)}")
        drafted = accepted = 0
        partial_err, dlogit = 0, 0.0
        for k in KS:
            streams, bad, flips = 0, [], []
            for sname, (reqs, opts) in plans.items():
                if sname == "solo" and k != SOLO_K:
                    continue
                longest = max(len(r.prompt) + r.max_new_tokens for r in reqs)
                spec = SpecEngine(fm, make(sname), k, max_tokens=longest, keep_logits=True, **opts).run(reqs)
                cmp = compare_streams(plain[sname], spec)
                streams += cmp["streams"]
                bad += [f"{sname}/{rid}" for rid in cmp["mismatched"]]
                flips += [[sname] + f for f in cmp["flips"]]
                dlogit = max(dlogit, cmp["max_abs_logit"])
                for r in spec.values():
                    drafted, accepted = drafted + r.stats.drafted, accepted + r.stats.accepted
                    if pname.startswith("partial"):
                        partial_err = max([partial_err] + [abs(a - min(PARTIAL_CORRECT, dr)) for dr, a in r.stats.rounds])
            n_streams += streams
            out.append(fig("speculative.lossless.same_tokens", 0.0 if bad else 1.0, f"{pname}/K{k}", streams=streams,
                           mismatched=bad, flips=flips))
        rate = accepted / drafted if drafted else float("nan")
        summary[pname] = {"drafted": drafted, "accepted": accepted, "acceptance": rate}
        out.append(fig("speculative.verify~decode.max_abs_logit", dlogit, pname))
        if pname == "oracle":
            out.append(fig("speculative.oracle.acceptance", rate, None, drafted=drafted))
        elif pname == "random":
            out.append(fig("speculative.random.acceptance", rate, None, drafted=drafted))
        elif pname.startswith("partial"):
            out.append(fig("speculative.partial.acceptance_error", partial_err, None, drafted=drafted,
                           acceptance=rate, correct_per_round=PARTIAL_CORRECT))
        else:
            out.append(fig("speculative.model.drafted", drafted, None, acceptance=rate))
    info["speculative"] = {"streams": n_streams, "ks": list(KS), "scenarios": list(plans), "drafters": summary}
    return out
