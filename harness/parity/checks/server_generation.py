"""The server checks of how a server generates (:mod:`.server`, items 2 to 4): the same prompts sent as a staggered
batch against each sent alone (:func:`batch_figures`), streamed against not streamed (:func:`stream_figures`), and
stopped by ``max_tokens``, by a stop string and by EOS where the reference's greedy token is EOS
(:func:`stop_figures`).
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Any, Sequence

import numpy as np

from gemma4_harness.reference.tokenizer import BYTE, NORMAL, GGUFTokenizer

from ...core.gates import NEAR_TIE_MARGIN
from ...core.progress import counter
from ...engines.openai import OpenAIEngine, ServerContextExceeded, ServerError, ServerGenerated
from ..compare import generation_figures
from ..result import Figure, fig
from .server_base import OracleStream, ServerOptions, first_difference, named


MAX_EOS_PREFIX_SITES = 4
"""At most this many prompt prefixes whose next greedy token (the reference's) is EOS are sent."""

NO_EOS_PROMPTS = 2
"""This many prompts whose continuation never reaches EOS are sent with EOS not ignored (no early stop)."""

STOP_STRING_REQUESTS = 3
"""At most this many stop-string requests (each on another prompt)."""

MAX_TOKENS_PROBES = (1, 3)
"""``max_tokens`` values tried on the first prompt, besides the full ``max_new_tokens`` of every request."""


def _token_bytes(tok: GGUFTokenizer, tid: int) -> bytes | None:
    """The bytes a server's text holds for token ``tid``: a byte token's byte, a normal piece with ``▁`` as a space;
    None for the other kinds (control, user-defined, unknown: servers render those differently)."""
    ty = tok.types[tid]
    piece = tok.tokens[tid]
    if ty == BYTE and piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
        return bytes([int(piece[3:5], 16)])
    if ty == NORMAL:
        return piece.replace("\u2581", " ").encode("utf-8")
    return None


def _as_gen(tokens: Sequence[int], top: Sequence[Sequence[tuple[int, float]]]) -> dict[str, Any]:
    """A stream in :func:`harness.parity.compare.generation_figures`' form."""
    return {"tokens": [int(t) for t in tokens], "top": [[i for i, _ in s] for s in top],
            "logprobs": [dict(s) for s in top]}


def _run_staggered(eng: OpenAIEngine, prompts: Sequence[list[int]], n: int, top_n: int, concurrency: int,
                   stagger_s: float, labels: Sequence[str] | None = None) -> tuple[list[ServerGenerated],
                                                                                 dict[str, float]]:
    """Send every prompt, request ``i`` started ``i * stagger_s`` after the first, at most ``concurrency`` in
    flight; returns the answers in order, and the wall time with the largest and the mean number of requests in
    flight (from each request's start and end). ``labels``: each request's name, for an engine failure."""
    t0 = time.monotonic()
    spans: list[tuple[float, float]] = [(0.0, 0.0)] * len(prompts)

    def one(i: int) -> ServerGenerated:
        delay = t0 + i * stagger_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        start = time.monotonic()
        g = named(labels[i] if labels else i, eng.complete, prompts[i], n, top_n)
        spans[i] = (start, time.monotonic())
        sent.step()
        return g

    with counter(f"{eng.dialect} requests (staggered)", len(prompts)) as sent, \
            cf.ThreadPoolExecutor(max(1, min(concurrency, len(prompts)))) as ex:
        out = list(ex.map(one, range(len(prompts))))
    wall = time.monotonic() - t0
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    busy = sum(b - a for a, b in spans)
    mean = round(busy / wall, 2) if wall else 0.0
    return out, {"wall_s": round(wall, 3), "max_in_flight": peak, "mean_in_flight": mean}


def batch_figures(eng: OpenAIEngine, order: Sequence[str], prompts: dict[str, list[int]],
                  alone: dict[str, ServerGenerated], alone_s: dict[str, float], opts: ServerOptions,
                  near_tie: float = NEAR_TIE_MARGIN) -> list[Figure]:
    """``server.batched~alone.greedy`` (and ``.max_abs_logprob``, reported): ``opts.batch_requests`` requests
    (the prompts in turn) started ``opts.stagger_s`` apart at ``opts.concurrency``, each against its alone answer.
    ``opts.stagger_s`` None: the median seconds of one alone request (``alone_s``) over the concurrency, so that
    the slots fill within one request's time and later requests arrive while earlier ones are generating.

    The greedy figure's detail counts ``identical`` requests (same tokens), those that agree only by the greedy
    rule (``by_top_n``, ``near_ties``), and ``bit_identical`` ones (same tokens and the same log-probs).
    """
    rids = [order[i % len(order)] for i in range(opts.batch_requests)]
    stagger = opts.stagger_s if opts.stagger_s is not None else \
        float(np.median([alone_s[r] for r in order])) / opts.concurrency
    keys = [f"{r}#{i}" for i, r in enumerate(rids)]
    together, timing = _run_staggered(eng, [prompts[r] for r in rids], opts.max_new_tokens, opts.top_n,
                                      opts.concurrency, stagger, [f"{k} (batch invariance)" for k in keys])
    ours = {k: _as_gen(g.tokens, g.top) for k, g in zip(keys, together)}
    theirs = {k: _as_gen(alone[r].tokens, alone[r].top) for k, r in zip(keys, rids)}
    figs = generation_figures(ours, theirs, "server.batched~alone", opts.top_n, near_tie=near_tie)
    bit = sum(g.tokens == alone[r].tokens and g.top == alone[r].top for g, r in zip(together, rids))
    figs[0].detail.update(requests=len(rids), concurrency=opts.concurrency, stagger_s=round(stagger, 4),
                          bit_identical=bit, **timing)
    return figs


def stream_figures(eng: OpenAIEngine, order: Sequence[str], prompts: dict[str, list[int]],
                   alone: dict[str, ServerGenerated], opts: ServerOptions) -> list[Figure]:
    """``server.stream~nostream.same_tokens``: each prompt streamed, against its alone answer: the same number of
    steps, the same id at every step the stream names (llama-server leaves out the ids of steps whose text ends
    inside a UTF-8 character), and the same text where that text is valid UTF-8 (a stream holds back bytes that
    never complete a character, where the whole answer shows U+FFFD). llama-cpp-python streams each token's text
    decoded alone (``errors="ignore"``): its stream must give the steps' own texts (:attr:`ServerGenerated.pieces`),
    and where the whole text holds a character whose bytes span tokens the row notes the difference.

    On the generic dialect (text only), a stream that ends in an error event fails, and so does one of another length,
    except where the reason is the protocol's (:func:`unstreamable`): that request is "not judged", with the reason,
    and the figure is taken over the others (informational when none is left).
    """
    text_only = getattr(eng, "dialect", None) == "openai"
    rows = []
    worst = 0.0
    for rid in order:
        s = named(f"{rid} (streamed)", eng.complete, prompts[rid], opts.max_new_tokens, opts.top_n, stream=True,
                   gaps=True)
        a = alone[rid]
        bad = note = None
        why = unstreamable(s, a) if text_only and (s.stream_error is not None or len(s.tokens) != len(a.tokens)) \
            else None
        if why is not None:
            rows.append({"request": rid, "ok": None, "steps_named": sum(t != -1 for t in s.tokens), "not_judged": why})
            continue
        if s.stream_error is not None:
            bad = f"the stream carries an error instead of choices: {s.stream_error}"
        elif len(s.tokens) != len(a.tokens):
            bad = f"{len(s.tokens)} steps streamed, {len(a.tokens)} without streaming"
        else:
            i = next((i for i, (x, y) in enumerate(zip(s.tokens, a.tokens)) if x != -1 and x != y), None)
            if i is not None:
                bad = f"step {i}: streamed {s.tokens[i]}, not streamed {a.tokens[i]}"
            elif s.text != a.text and "\ufffd" not in a.text and not (a.pieces and s.text == "".join(a.pieces)):
                j = first_difference([ord(c) for c in s.text], [ord(c) for c in a.text])
                bad = f"texts differ at character {j if j is not None else min(len(s.text), len(a.text))}"
            elif s.text != a.text and a.pieces and s.text == "".join(a.pieces):
                note = ("the stream's text is each token's own text (llama-cpp-python decodes every streamed token "
                        "alone and drops bytes that are no whole character), so a character whose bytes span "
                        f"tokens is not streamed: whole {a.text!r}, streamed {s.text!r}")
        for sa, sb in zip(s.top, a.top):
            db = dict(sb)
            worst = max([worst] + [abs(v - db[t]) for t, v in sa if t in db])
        rows.append({"request": rid, "ok": bad is None, "steps_named": sum(t != -1 for t in s.tokens),
                     **({"why": bad} if bad else {}), **({"note": note} if note else {})})
    faults = [r for r in rows if r["ok"] is False]
    judged = [r for r in rows if r["ok"] is not None]
    skipped_rows = [r for r in rows if r["ok"] is None]
    why = f"request {faults[0]['request']} {faults[0]['why']}" if faults else None
    said = {"not_judged": [r["request"] for r in skipped_rows]} if skipped_rows else {}
    if rows and not judged:
        said["informational_reason"] = f"no request's stream could be judged: {skipped_rows[0]['not_judged']}"
    return [fig("server.stream~nostream.same_tokens", 1.0 - len(faults) / len(judged) if judged else float("nan"),
                None, requests=len(rows), max_abs_logprob=worst, rows=rows[:20], **said,
                **({"why": why, "first_divergence": why} if why else {}))]


def unstreamable(s: ServerGenerated, a: ServerGenerated) -> str | None:
    """Why the stream ``s`` of a request on the generic dialect (text only: its steps are named from the text) cannot
    be compared token by token with the same request's answer without streaming ``a``, where the reason is the
    protocol's; None where it is the server's fault (a stream that must then fail).

    The protocol's reason: ``a``'s text holds U+FFFD (bytes of its tokens that are no UTF-8, which the server's decoder
    replaced), a stream sends text chunks (JSON strings), which cannot carry such bytes, and the stream's text agrees
    with ``a``'s (a U+FFFD of ``a`` standing for any one character, as decoders differ there: HF's ``ByteFallback``
    shows every byte of a bad run as U+FFFD, valid ones included) as far as it goes, and stops where ``a``'s next
    character is a U+FFFD: broken there by an error event (``s.stream_error``; transformers serve 5.23: its tokenizers
    ``DecodeStream`` raises "Invalid prefix encountered while decoding stream" on a run of byte tokens that is no
    UTF-8), or ended without ``a``'s last characters, all U+FFFD (bytes held back that never complete a character).
    Seen on transformers serve 5.23 (docs/server-dialects.md).
    """
    bad = a.text.find("\ufffd")
    n = len(s.text)
    if bad < 0 or n > len(a.text) or not all(x == y or y == "\ufffd" for x, y in zip(s.text, a.text)):
        return None
    rest = a.text[n:]
    if s.stream_error is not None and rest.startswith("\ufffd"):
        return (f"not judged: its stream broke with an error ({s.stream_error}) after {n} characters, where its "
                f"answer without streaming holds bytes that are no UTF-8 (U+FFFD at character {n} of "
                f"{len(a.text)}): a stream of text chunks cannot carry them, and the text it streamed before is that "
                "answer's")
    if s.stream_error is None and rest and set(rest) == {"\ufffd"}:
        return (f"not judged: its stream ended without the last {len(rest)} characters of its answer without "
                "streaming, all bytes that are no UTF-8 (U+FFFD there): a stream of text chunks cannot carry them, "
                "so the steps that gave them cannot be named from its text; the text it streamed is that answer's")
    return None

def _stop_verdict(tokens: Sequence[int], finish: str | None, o: OracleStream, stop_at: int | None,
                  eos_ids: set[int], n: int) -> tuple[str, str]:
    """Judge one stopped (or not) answer against the oracle: ``ok``, ``near-tie`` (the streams part, or the stop
    moves, at an oracle near-tie) or ``fault``, with a reason naming the step and both tokens."""
    got = list(tokens)
    if finish == "stop" and got and got[-1] in eos_ids:
        got = got[:-1]  # llama-server returns the EOS id it stopped on; vLLM may not
    limit = n if stop_at is None else stop_at
    i = first_difference(got[:limit], o.tokens[:limit])
    if i is not None:
        kind = "near-tie" if o.margin[i] < o.near_tie else "fault"
        return kind, f"step {i}: server {got[i]}, oracle {o.tokens[i]} (oracle margin {o.margin[i]:.3g})"
    want_finish = "length" if stop_at is None else "stop"
    if len(got) == limit and finish == want_finish:
        return "ok", ""
    k = len(got)
    if stop_at is None or k < stop_at:  # stopped early at step k, where the oracle goes on
        eos_lp = max((o.logprobs[k].get(e, -np.inf) for e in eos_ids), default=-np.inf) if k < len(o.tokens) else None
        near = eos_lp is not None and o.top[k][0][1] - eos_lp < o.near_tie
        why = (f"step {k}: server stopped ({finish}), oracle continues with {o.tokens[k]}" if k < len(o.tokens)
               else f"{k} tokens, finish_reason {finish!r}, expected {limit} and {want_finish!r}")
        return ("near-tie" if near else "fault"), why
    near = o.margin[stop_at] < o.near_tie
    return ("near-tie" if near else "fault"), (f"step {stop_at}: oracle stops (EOS {o.tokens[stop_at]}), server "
                                               f"gave {len(got)} tokens, finish_reason {finish!r}")


def _stop_figure(gate: str, rows: list[dict[str, Any]], **detail: Any) -> Figure:
    faults = [r for r in rows if r["kind"] == "fault"]
    why = f"request {faults[0]['request']} {faults[0]['why']}" if faults else None
    return fig(gate, 1.0 - len(faults) / max(1, len(rows)), None, requests=len(rows),
               near_ties=sum(r["kind"] == "near-tie" for r in rows), rows=rows[:20],
               **({"why": why, "first_divergence": why} if why else {}), **detail)


def stop_figures(eng: OpenAIEngine, tok: GGUFTokenizer, eos_ids: set[int], order: Sequence[str],
                 prompts: dict[str, list[int]], alone: dict[str, ServerGenerated], oracle: dict[str, OracleStream],
                 opts: ServerOptions) -> list[Figure]:
    """``server.stop.max_tokens``, ``server.stop.string`` and ``server.stop.eos`` (see the module docstring)."""
    n, top_n = opts.max_new_tokens, opts.top_n
    eos_first = {rid: next((k for k, t in enumerate(o.tokens) if t in eos_ids), None) for rid, o in oracle.items()}
    stops_at_eos = True  # every request lets the server stop at EOS (OpenAIEngine.complete), as users run it
    # max_tokens: every alone answer, and 1 and 3 tokens of the first prompt.
    rows = []
    for rid in order:
        g = alone[rid]
        kind, why = _stop_verdict(g.tokens, g.finish_reason, oracle[rid], eos_first[rid] if stops_at_eos else None,
                                  eos_ids, n)
        rows.append({"request": rid, "max_tokens": n, "kind": kind, "why": why})
    first = order[0]
    for k in MAX_TOKENS_PROBES:
        if k < n:
            g = named(f"{first}@max_tokens={k}", eng.complete, prompts[first], k, top_n)
            e = eos_first[first]
            stop_at = e if stops_at_eos and e is not None and e < k else None
            kind, why = _stop_verdict(g.tokens, g.finish_reason, oracle[first], stop_at, eos_ids, k)
            rows.append({"request": f"{first}@max_tokens={k}", "max_tokens": k, "kind": kind, "why": why})
    out = [_stop_figure("server.stop.max_tokens", rows)]

    # A stop string: a normal token's text in the oracle's continuation, first seen where that token starts.
    rows = []
    for rid in order:
        if len(rows) >= STOP_STRING_REQUESTS:
            break
        o = oracle[rid]
        limit = n if eos_first[rid] is None else eos_first[rid]
        pieces = [_token_bytes(tok, t) for t in o.tokens[:limit]]
        plain = next((k for k, p in enumerate(pieces) if p is None), len(pieces))  # the server's text is known so far
        whole = b"".join(pieces[:plain])
        # the stop word is a token the server's own stream (alone, no stop) gave too: where that stream parts from the
        # oracle's the greedy gate judges it (a near-tie, a top-N pair, or a fault), and a stop word from beyond it
        # would judge the same parting again, without that rule (on e2b Q4_1, llama-server: a top-N parting at step
        # 3, the stop word picked at step 3, a false alarm here)
        parted = first_difference(alone[rid].tokens, o.tokens[:limit])
        agreed = min(len(alone[rid].tokens), plain) if parted is None else min(parted, plain)
        for k in range(1, agreed):
            word = pieces[k]
            before = b"".join(pieces[:k])
            if len(word.strip()) < 2 or whole.find(word) != len(before):
                continue
            try:
                text, word_s = before.decode("utf-8"), word.decode("utf-8")
            except UnicodeDecodeError:
                continue
            g = named(f"{rid} (stop {word_s!r})", eng.complete, prompts[rid], n, top_n, stop=[word_s])
            note = None
            i = first_difference(g.tokens[:k], o.tokens[:k])
            if i is not None:
                kind = "near-tie" if o.margin[i] < o.near_tie else "fault"
                why = f"step {i}: server {g.tokens[i]}, oracle {o.tokens[i]} (oracle margin {o.margin[i]:.3g})"
            elif g.finish_reason == "stop" and g.text == text:
                kind, why = "ok", ""
            elif g.finish_reason == "stop" and eng.dialect == "openai" and g.text == text + word_s:
                # transformers serve stops there but keeps the stop string in the text (OpenAI's API leaves it out):
                # the stop is right, the text differs in that documented way
                kind, why = "ok", ""
                note = f"the text keeps the stop string {word_s!r} (OpenAI's API leaves it out)"
            else:
                kind, why = "fault", (f"stop string {word_s!r} at step {k}: finish_reason {g.finish_reason!r}, text "
                                      f"ending {g.text[-24:]!r}, expected 'stop' and a text ending {text[-24:]!r}")
            rows.append({"request": rid, "stop": word_s, "step": k, "kind": kind, "why": why,
                         **({"note": note} if note else {})})
            break
    out.append(_stop_figure("server.stop.string", rows) if rows else
               fig("server.stop.string", float("nan"), None, not_measured="no continuation of the reference holds a "
                   "plain-text token to use as a stop string where the server's own stream agrees with it (this "
                   "model's greedy tokens are byte or special tokens, or the streams part at once)"))

    # EOS: prompt prefixes whose next greedy token is EOS, continuations that reach EOS, and some that never do.
    rows = []
    sites = [(rid, j, m) for rid in order for j, m in oracle[rid].prompt_eos][:MAX_EOS_PREFIX_SITES]
    unsendable = []
    for rid, j, margin in sites:
        try:
            g = named(f"{rid}[:{j + 1}] (EOS not ignored)", eng.complete, prompts[rid][:j + 1], 4, top_n,
                       ignore_eos=False)
        except ServerError as e:  # a text-only dialect: a prefix cut inside a character has no text to send
            if isinstance(e, ServerContextExceeded):
                raise  # longer than the server's context: the user's input, the pair says so (exit 2)
            unsendable.append(f"{rid}[:{j + 1}]: {e}")
            continue
        got = [t for t in g.tokens if t not in eos_ids] if g.finish_reason == "stop" else g.tokens
        ok = g.finish_reason == "stop" and not got
        kind = "ok" if ok else ("near-tie" if margin < oracle[rid].near_tie else "fault")
        rows.append({"request": f"{rid}[:{j + 1}]", "eos_at": 0, "kind": kind,
                     "why": "" if ok else f"step 0: oracle stops (EOS), server gave {g.tokens[:4]}, "
                                          f"finish_reason {g.finish_reason!r}"})
    reaching = [rid for rid in order if eos_first[rid] is not None]
    never = [rid for rid in order if eos_first[rid] is None][:NO_EOS_PROMPTS]
    for rid in reaching + never:
        g = named(f"{rid} (EOS not ignored)", eng.complete, prompts[rid], n, top_n, ignore_eos=False)
        kind, why = _stop_verdict(g.tokens, g.finish_reason, oracle[rid], eos_first[rid], eos_ids, n)
        rows.append({"request": rid, "eos_at": eos_first[rid], "kind": kind, "why": why})
    out.append(_stop_figure("server.stop.eos", rows, eos_ids=sorted(eos_ids),
                            eos_reached=len(sites) - len(unsendable) + len(reaching),
                            **({"not_sent": unsendable} if unsendable else {})))
    return out
