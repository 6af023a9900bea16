"""Whether a divergence is in decoding, read from the log-probs an engine reported along its greedy stream
(:mod:`.explain` says when it is asked): what differs at the step where its token parts from the oracle's
(:func:`decoding_difference`), the same for an engine that gives no logits (:func:`decoding_by_logprobs`), and a
stream that is the oracle's token for token while its log-probs are not (:func:`decoding_by_shift`). Pure functions
of log-probs and the oracle's logits: nothing here runs a model.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from ..core.engine_kinds import ORACLE

GENERATION_PATH = "in its generation path"
"""How :meth:`.explain.TextSubject.decoding` starts ``what`` when the engine's generation computes other logits than
its forward (the explanation's ``kind`` is then ``generation``, its line "in generation, not in the logits: ...")."""


def _log_softmax(z: np.ndarray) -> np.ndarray:
    return z - z.max() - np.log(np.sum(np.exp(z - z.max())))


def _untouched_shift(own: Mapping[int, float], lz: np.ndarray, touched: set[int]) -> list[float]:
    """``own[k] - lz[k]`` over the listed ids no decoding rule touches (not in ``touched``) and not at -inf."""
    return [own[k] - lz[k] for k in own if k not in touched and own[k] > -np.inf]


def decoding_difference(own: Mapping[int, float], tok: int, want: int, context: Sequence[int], z: np.ndarray,
                        limit: float) -> str:
    """What differs in decoding at a step where an engine gave ``tok`` and the oracle's logits ``z`` (``[V]``, at the
    engine's context ``context``) give ``want``, read from the log-probs the engine reported there (``own``: id ->
    log-prob, its top-N; empty when it reported none). ``limit``: the pair's ``max_abs_logprob`` limit. One phrase:

    - its token is not the top-1 of its own log-probs, whose top-1 is ``want`` at the log-prob the logits give (up to
      the shift of the normaliser seen on the tokens no rule touches): its log-probs were taken before its decoding
      rules (llama-server's ``n_probs``, vLLM's default ``raw_logprobs``), and ``want`` was passed over after them: a
      repeated token's logit lowered when ``want`` occurs in the context (a repetition penalty), else a token banned
      or a logit bias; sampling looks the same from there, and is named beside them;
    - otherwise not the top-1 of its own log-probs: sampling;
    - the reported log-probs differ from the logits on the tokens no rule touches (outside the context and
      ``want``) by more than one shift of the normaliser: it starts with :data:`GENERATION_PATH` (its generation
      computes other logits than its forward: no decoding rule);
    - ``want`` missing from its top-N or at -inf: banned (or, when it occurs in the context, a repeated token's
      logit lowered); present but lower than the logits give: a repeated token's logit lowered (in the context: a
      repetition penalty), else a logit bias.
    """
    lz = _log_softmax(np.asarray(z, dtype=np.float64))
    repeated = want in context
    where = f"token {want} occurs in the context (position {list(context).index(want)})" if repeated else ""
    if not own:
        return (f"its log-probs at that step were not given; {where}: a repeated token's logit lowered (a "
                "repetition penalty)?" if repeated else
                "its log-probs at that step were not given: a token banned, a logit bias or sampling")
    touched = set(int(c) for c in context) | {want}
    shift = _untouched_shift(own, lz, touched)
    spread = max(shift) - min(shift) if len(shift) >= 2 else 0.0
    theirs = own.get(want)
    if tok not in own or own[tok] < max(own.values()):
        top = max(own, key=lambda k: own[k])
        level = float(np.median(shift)) if shift else 0.0
        if top == want and spread <= limit and abs(theirs - lz[want] - level) <= limit:
            taken = (f"token {want} is the top-1 of its own log-probs at {theirs:.4g}, as the logits give "
                     f"({lz[want]:.4g}): they were taken before its decoding rules; it gave {tok}")
            if repeated:
                return (f"a repeated token's logit lowered after its log-probs were taken: {taken}, and {where} (a "
                        "repetition penalty, or sampling)")
            return (f"token {want} passed over after its log-probs were taken: {taken}, and token {want} is not in "
                    "the context (a token banned, a logit bias, or sampling)")
        return f"sampling: its token {tok} is not the top-1 of its own log-probs (temperature 0 was asked)"
    if spread > limit:
        return (f"{GENERATION_PATH}: the log-probs it reported there differ from its own forward's on tokens no "
                f"decoding rule touches (spread {spread:.3g} over {len(shift)} tokens outside the context): its "
                "generation computes other logits than its forward (its KV cache, its decode path)")
    if theirs is None or not theirs > -np.inf:
        state = f"not among its top-{len(own)} log-probs" if theirs is None else "at log-prob -inf"
        if repeated and theirs is None:
            return (f"a repeated token's logit lowered: token {want} is {state} where the logits give it "
                    f"log-prob {lz[want]:.4g} (their top-1), and {where} (a repetition penalty)")
        return (f"a token banned: token {want} is {state} where the logits give it log-prob {lz[want]:.4g} (their "
                "top-1)")
    if repeated:
        return (f"a repeated token's logit lowered: token {want} at log-prob {theirs:.4g} where the logits give "
                f"log-prob {lz[want]:.4g}, and {where} (a repetition penalty)")
    return (f"token {want}'s log-prob lowered in decoding: {theirs:.4g} where the logits give log-prob "
            f"{lz[want]:.4g} (a logit bias)")


def decoding_by_logprobs(request: str, ids: Sequence[int], stream: Mapping[str, Any], i: int, z: np.ndarray,
                         limit: float, oracle: str = ORACLE,
                         before: Sequence[Mapping[int, float]] = ()) -> dict[str, Any] | None:
    """Whether an engine that gives no logits, only top-N log-probs along its greedy stream, diverges at step ``i``
    in decoding, and what differs there.

    Args:
        request: the prompt's id (named in the line).
        ids: the prompt's token ids.
        stream: the engine's greedy stream (``tokens``, ``logprobs``: per step ``{id: log-prob}``).
        i: the step where its token is not the oracle's greedy token there.
        z: the oracle's logits ``[V]`` at the engine's context of step ``i`` (``ids`` and its tokens before ``i``);
            their top-1 is the oracle's token.
        limit: the pair's ``max_abs_logprob`` limit (with the effect of the declared approximations).
        oracle: the oracle's name in the line (``reference``, ``fast``).
        before: the oracle's top-N log-probs at the steps before ``i`` at the same contexts (where the oracle's
            stream is the engine's), compared too.

    Returns:
        None unless, at step ``i``, its log-probs of at least two tokens no decoding rule touches (neither in the
        context nor the oracle's token) differ from the oracle's by one shift of the normaliser within ``limit``, and
        so at the steps ``before`` on the untouched tokens both list (a rule that lowers the context's tokens moves
        the normaliser at every step): the model computes the oracle's numbers there, and the oracle's token was
        lowered, banned or passed over after them (:func:`decoding_difference`). Else ``{"request", "step", "ours",
        "oracle", "what", "evidence": "log-probs", "spread_before", "spread", "kind": "decoding", "line"}``.
    """
    lps = stream.get("logprobs") or []
    own = lps[i] if i < len(lps) and lps[i] else {}
    if not own:
        return None
    ours = [int(t) for t in stream["tokens"]]
    want, tok = int(np.argmax(z)), ours[i]
    spreads = []  # each earlier step's spread of (its log-prob - the oracle's) over the untouched tokens both list
    for k, (a, b) in enumerate(zip(lps[:i], before)):
        seen = set(int(c) for c in ids) | set(ours[:k])
        d = [a[t] - b[t] for t in set(a or {}) & set(b or {}) if t not in seen and a[t] > -np.inf < b[t]]
        spreads += [max(d) - min(d)] if d else []
    if spreads and not max(spreads) <= limit:
        return None
    context = [int(c) for c in ids] + ours[:i]
    shift = _untouched_shift(own, _log_softmax(np.asarray(z, dtype=np.float64)), set(context) | {want})
    if len(shift) < 2 or not max(shift) - min(shift) <= limit:
        return None
    what = decoding_difference(own, tok, want, context, z, limit)
    if what.startswith(GENERATION_PATH):
        return None
    spread, worst = max(shift) - min(shift), max(spreads, default=0.0)
    line = (f"request {request} step {i}: it gave {tok}, the {oracle}'s greedy token there is {want} "
            f"(no logits were given: its own log-probs agree with the {oracle}'s on the {len(shift)} tokens "
            f"it lists that no decoding rule touches, up to one shift of the normaliser (spread {spread:.3g}), "
            f"and so at the {min(i, len(before))} steps before (spread at most {worst:.3g})); {what}")
    return {"request": request, "step": i, "ours": tok, "oracle": want, "what": what, "evidence": "log-probs",
            "spread_before": worst, "spread": spread, "kind": "decoding", "line": line}


def _lowered(own: Mapping[int, float], z: np.ndarray, context: set[int], limit: float
             ) -> tuple[float, float, int, list[int], list[int]] | None:
    """Whether the log-probs ``own`` (id -> log-prob, an engine's top-N at one step) are the oracle's logits ``z``
    after a decoding rule that only lowers logits: on the listed tokens outside ``context`` one shift ``s >= 0`` of
    the normaliser (spread within ``limit``, at least two tokens), no listed token above its log-prob plus ``s``, and
    the mass the visible lowered tokens lost (the context's tokens listed lower than that; the oracle's tokens that
    rank above a listed one and are missing or at -inf) no more than ``s`` accounts for (``1 - exp(-s)``, within
    ``limit`` in log space). Returns ``(s, spread, untouched tokens, lowered, missing)`` (the two lists may be
    empty: the step agrees up to the shift), or None."""
    lz = _log_softmax(np.asarray(z, dtype=np.float64))
    listed = {int(t): float(v) for t, v in own.items() if int(t) >= 0 and v > -np.inf}
    shift = [listed[t] - lz[t] for t in listed if t not in context]
    if len(shift) < 2 or not listed:
        return None
    s, spread = float(np.median(shift)), float(max(shift) - min(shift))
    if not (spread <= limit and s >= -limit) or any(listed[t] > lz[t] + s + limit for t in listed):
        return None
    floor = min(listed.values())
    lowered = sorted(t for t in listed if listed[t] < lz[t] + s - limit)
    ranked = np.argsort(-lz, kind="stable")[:len(own) + len(lowered)]
    missing = [int(t) for t in ranked if int(t) not in listed and lz[t] + s > floor + limit]
    lost = sum(np.exp(lz[t]) - np.exp(listed[t] - s) for t in lowered)
    lost += sum(max(0.0, np.exp(lz[t]) - np.exp(floor - s)) for t in missing)
    if not lost < 1 or not -np.log1p(-lost) <= max(s, 0.0) + limit:
        return None
    return s, spread, len(shift), lowered, missing


def decoding_by_shift(request: str, ids: Sequence[int], stream: Mapping[str, Any], z: np.ndarray, limit: float,
                      oracle: str = ORACLE) -> dict[str, Any] | None:
    """Whether an engine whose greedy stream is the oracle's token for token, and whose log-probs along it are not
    (``max_abs_logprob`` fails, the tokens agree), diverges in decoding: a rule that lowers some logits (a token
    banned, a repetition penalty, a logit bias) after its forward, before the log-probs it reports, moves the
    normaliser of every step where the lowered tokens had mass, without ever parting the streams.

    Args:
        request: the prompt's id (named in the line).
        ids: the prompt's token ids.
        stream: the engine's greedy stream (``tokens``, ``logprobs``: per step ``{id: log-prob}``).
        z: the oracle's logits ``[n, V]`` at each step's context (the prompt and the stream's tokens before it:
            teacher-forced along the engine's own stream, which is the oracle's).
        limit: the pair's ``max_abs_logprob`` limit (with the effect of the declared approximations).
        oracle: the oracle's name in the line.

    Returns:
        None unless every step with log-probs is, by :func:`_lowered`, the oracle's log-probs after a rule that only
        lowers (at each, the listed tokens outside the context agree with the oracle's up to one shift of the
        normaliser), at least one step differs beyond ``limit``, and what moved the normaliser is named: the lowered
        tokens in sight at a step that differs (the step that differs most among them is quoted), or, with none in
        sight, the one token not listed at any step whose oracle probability ``p``, taken out, gives each step's
        shift ``-log(1 - p)`` within the spread of the log-probs themselves (a ban; none or several: None). Else
        ``{"request", "step", "ours", "oracle" (its token there, both the same), "what", "evidence": "log-probs",
        "shift", "spread", "kind": "decoding", "line"}``.
    """
    lps = stream.get("logprobs") or []
    ours = [int(t) for t in stream["tokens"]]
    steps = []  # (step, max |Δlogprob|, what _lowered found, the oracle's log-probs) of each step with log-probs
    for k, own in enumerate(lps[:len(z)]):
        if not own:
            continue
        lz = _log_softmax(np.asarray(z[k], dtype=np.float64))
        dev = max((abs(v - lz[int(t)]) for t, v in own.items() if int(t) >= 0 and v > -np.inf), default=0.0)
        found = _lowered(own, z[k], set(int(c) for c in ids) | set(ours[:k]), limit)
        if found is None and dev > limit:
            return None  # a step no rule that only lowers logits gives
        steps.append((k, dev, found, lz))
    apart = [st for st in steps if st[1] > limit]
    if not apart or any(st[2] is None for st in apart):
        return None
    k, dev, (s, spread, n, lowered, missing), lz = max(apart, key=lambda st: st[1])
    ctx = [int(c) for c in ids] + ours[:k]
    top = len(lps[k])
    said = []
    seen = [st for st in apart if st[2][3] or st[2][4]]
    if seen:  # the lowered tokens are in sight at the step that differs most (else at another one)
        k, dev, (s, spread, n, lowered, missing), lz = max(seen, key=lambda st: st[1])
        ctx = [int(c) for c in ids] + ours[:k]
        top = len(lps[k])
        for t in missing:
            where = f", in the context (position {ctx.index(t)}): a repeated token's logit lowered" if t in ctx else ""
            said.append(f"token {t} missing from its top-{top} where the logits give it log-prob {lz[t]:.4g}{where}")
        for t in lowered:
            said.append(f"token {t} at log-prob {lps[k][t]:.4g} where the logits give {lz[t]:.4g} (+ the shift), in "
                        f"the context (position {ctx.index(t)}): a repeated token's logit lowered")
        touched = [*missing, *lowered]
        rule = ("a repetition penalty" if all(t in ctx for t in touched) else
                "a token banned or a logit bias" if not any(t in ctx for t in touched) else
                "a token banned or a logit bias, and a repetition penalty")
        what = f"{'; '.join(said)} ({rule})"
    else:  # only the normaliser moved: the one token whose probability, taken out, moves it so at every step
        noise = max(st[2][1] for st in steps if st[2] is not None) + 1e-12  # the log-probs' own spread
        fits = np.ones(len(lz), dtype=bool)
        for kk, _, f, lzk in steps:
            if f is None:
                continue
            p = np.exp(lzk)
            fits &= np.abs(-np.log1p(-np.minimum(p, 1 - 1e-16)) - f[0]) <= noise
            fits[[int(t) for t, v in lps[kk].items() if int(t) >= 0 and v > -np.inf]] = False  # listed: not banned
        if int(fits.sum()) != 1:
            return None
        t = int(np.argmax(fits))
        where = f"; it occurs in the context (position {ctx.index(t)})" if t in ctx else ""
        what = (f"a token banned: token {t}'s probability is taken out at every step (it is never among its top-{top}; "
                f"at step {k} the logits give it {np.exp(lz[t]):.4g}, and the normaliser moved by "
                f"{s:.4g} = -log(1 - {np.exp(lz[t]):.4g}), no other token fitting every step within the spread "
                f"{noise:.3g} of its log-probs){where}")
    line = (f"request {request} step {k}: its tokens are the {oracle}'s, its log-probs are not (max |Δlogprob| "
            f"{dev:.3g}); they agree with the {oracle}'s on the {n} tokens it lists that no decoding rule touches, up "
            f"to one shift of the normaliser ({s:.3g}, spread {spread:.3g}), at every step of its stream; {what}")
    tok = ours[k] if k < len(ours) else None
    return {"request": request, "step": k, "ours": tok, "oracle": tok, "what": what, "evidence": "log-probs",
            "shift": s, "spread": spread, "kind": "decoding", "line": line}
