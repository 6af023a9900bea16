"""Checks of a model behind an OpenAI-compatible server: ``g4h parity --model PATH --against openai:URL``.

The server (:class:`harness.engines.openai.OpenAIEngine`: llama-server, llama-cpp-python's server, vLLM, any other
OpenAI server through the generic ``openai`` dialect, which judges its text alone) is one more engine of the pair checks
(:func:`harness.parity.checks.pair.pair_checks`, pair ``reference~openai``): its greedy streams are judged there against
the reference's by vLLM's rule (``reference~openai.greedy``, each divergence a near-tie or a fault naming the request,
the step and both tokens; a token that is not the server's own top-1 is a fault) and by
``reference~openai.max_abs_logprob`` (shared top-5 on the agreed prefix). The server's numerics are its dialect's
defaults or what ``--declare`` states (:data:`harness.engines.numerics.DIALECT_NUMERICS`: llama-server with its fp16
GELU table, an f16 KV cache and flash attention; llama-cpp-python with the table and an f16 KV cache); the reference
makes those approximations too, and each figure is gated at ``max(fp32 bound, 2 x their effect on this model)``
(:data:`harness.core.gates.EFFECT_FACTOR`).

This module adds the checks only a server has (:data:`harness.parity.checks.pair.EXTRA_CHECKS` ``["openai"]``,
:func:`server_checks`), each a figure with a gate in ``harness/core/gates.py``:

1. **tokenizer** (text prompts only): the server's ``/tokenize`` of each text against our tokenizer's ids; a
   difference fails ``server.tokenizer`` and the model checks still run on our ids (a tokenizer fault is not a
   model fault).
2. **batch invariance** (``server.batched~alone.greedy``): ``batch_requests`` requests (the prompts in turn)
   started ``stagger_s`` apart, at most ``concurrency`` in flight, against the same prompts sent alone (the pair
   check's answers); per request: identical tokens, agreement only by the greedy rule, or a fault.
3. **streaming** (``server.stream~nostream.same_tokens``): each prompt streamed against its alone answer.
4. **stop and EOS** (``server.stop.max_tokens``, ``.string``, ``.eos``): ``max_tokens`` 1 and 3; a stop string
   taken from the reference's continuation, where the server's own stream agrees with it; EOS not ignored, at every place where the reference's greedy choice is
   EOS (inside a prompt or in a continuation) and on prompts where it never is.
5. **prompt log-probs** (``server.prompt_logprobs``), where the dialect offers them (vLLM, llama-cpp-python):
   the log-probs of the prompt's own tokens and the top-5 at each position against the reference's.
6. **chat template** (``server.chat_template``): the ids the server evaluates for a chat request against our
   Gemma 4 chat format (:func:`reference.chat.render`).

A check the dialect does not offer (llama-cpp-python's chat template, llama-server's prompt log-probs) is reported as
"not offered by <dialect>" and does not fail the run; ``--require server-template`` (``server-prompt-logprobs``)
makes it fail (:data:`REQUIRABLE`). A check the server offers and gets wrong fails either way.

A server that is down or silent when the pair starts raises :class:`~harness.engines.openai.ServerError` (an
:class:`InputError`: the URL cannot be used, exit 2). Once it serves, a request that fails (an error status, no
answer within the timeout, malformed JSON or another shape, a token it cannot name, a dropped token, a step that is
not greedy, a crash) raises :class:`~harness.engines.openai.ServerFailure`, an engine failure naming the request
(:func:`_named`) and the step: the pair then ends with that one line as its ``reference~openai.runs`` figure
(exit 1, "ENGINE FAILED"). Either way the run goes on with the other engines and cases.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd

from gemma4_harness.reference.chat import BOS as BOS_TEXT
from gemma4_harness.reference.chat import render
from gemma4_harness.reference.errors import InputError, PromptError
from gemma4_harness.reference.tokenizer import BYTE, NORMAL, GGUFTokenizer, read_gguf_metadata

from ... import synth
from ...core.gates import DEFAULT_GATES, NEAR_TIE_MARGIN, effect_limit, gate_for
from ...core.io import dataframe_markdown
from ...core.metrics import log_softmax
from ...core.progress import counter
from ...core.workers import EngineFailure
from ...engines.base import TOP_N
from ...engines.openai import OpenAIEngine, ServerContextExceeded, ServerError, ServerGenerated, end_of_generation_ids
from ...synth.prompts import PROMPT_SEED, text_pieces, text_prompt
from ...tokenizer.prompt_ids import model_tokenizer, text_ids
from ..compare import generation_figures
from ..result import Figure, fig
from ..skips import skipped
from .pair import (
    EXTRA_CHECKS,
    QUANTIZED_ACTIVATIONS,
    ReferenceRuns,
    engine_numerics,
    near_tie_margin,
    numerics_lines,
)

__all__ = ["REQUIRABLE", "ServerOptions", "report_lines", "server_checks", "spec_gates"]

REQUIRABLE = ("server-template", "server-prompt-logprobs")
"""Server checks a dialect may not offer (llama-cpp-python has no chat-template endpoint, llama-server no prompt
log-probs): reported as "not offered by <dialect>" without failing the run, unless ``--require`` names them."""

#: Conversations for the chat-template check (plain turns: what every server's template endpoint takes).
CHAT_CASES: tuple[tuple[str, list[dict[str, str]]], ...] = (
    ("one user turn", [{"role": "user", "content": "Hi"}]),
    ("system and user", [{"role": "system", "content": "You are terse."},
                         {"role": "user", "content": "Name a colour."}]),
    ("three turns", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
                     {"role": "user", "content": "Count to three."}]),
)

MAX_EOS_PREFIX_SITES = 4
"""At most this many prompt prefixes whose next greedy token (the reference's) is EOS are sent."""

NO_EOS_PROMPTS = 2
"""This many prompts whose continuation never reaches EOS are sent with EOS not ignored (no early stop)."""

STOP_STRING_REQUESTS = 3
"""At most this many stop-string requests (each on another prompt)."""

MAX_TOKENS_PROBES = (1, 3)
"""``max_tokens`` values tried on the first prompt, besides the full ``max_new_tokens`` of every request."""

Progress = Callable[[str], None]


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


def default_text_prompts(prompts: Sequence[dict[str, Any]], path: str | Path,
                         seed: int = PROMPT_SEED) -> tuple[list[dict[str, Any]], list[str]]:
    """The case library's default prompts as text, for a server that takes text prompts only
    (:data:`harness.engines.openai.TEXT_ONLY_DIALECTS`): each record keeps its id, note and marks and gets a text of
    as many tokens, built from the model's own vocabulary so that its ids survive the round trip ids -> text -> ids
    (:func:`harness.synth.prompts.text_prompt`, ``seed``), with ``prompt_ids`` its ids
    (:func:`harness.tokenizer.prompt_ids.text_ids`, the one text-to-ids path). The
    server's tokenizer then judges each text (``server.tokenizer``, where the dialect has one).

    An empty text (the BOS-only prompt) is left out: llama-cpp-python answers an empty prompt with log-prob lists
    shorter than its tokens (6 entries for 8 tokens, ``usage.completion_tokens`` 8, on the synthetic ``31b`` GGUF),
    which the client cannot place, and OpenAI's API has no use for one.

    Returns:
        ``(records, left_out)``: the text records, and the ids of the prompts left out (no such text found, or an
        empty one).

    Raises:
        InputError: no tokenizer in the model (the path is named).
    """
    tok = model_tokenizer(path)
    pieces = text_pieces(tok.tokens, tok.types)
    out, left = [], []
    for p in prompts:
        text = text_prompt(tok, lambda t: text_ids(tok, t), len(p["prompt_ids"]), seed, pieces=pieces)
        if not text:
            left.append(str(p["id"]))
            continue
        rec = {k: v for k, v in p.items() if k not in ("prompt_ids", "where")}
        out.append({**rec, "text": text, "prompt_ids": text_ids(tok, text)})
    return out, left


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


# --------------------------------------------------------------------------- helpers


def spec_gates(path: str | Path) -> dict[str, Any] | None:
    """The ``[gates]`` table of the built synthetic case ``path`` belongs to (a ``spec.toml`` beside it), else None."""
    spec = Path(path).parent / "spec.toml"
    if Path(path).suffix == ".gguf" and spec.is_file() and (Path(path).parent / "manifest.json").is_file():
        return synth.load_spec(spec).gates
    return None


def _states_template(path: str | Path) -> bool:
    """Whether the model states its chat template: a GGUF's ``tokenizer.chat_template``, an HF folder's
    ``chat_template`` in ``tokenizer_config.json`` or a ``chat_template.jinja`` beside it."""
    p = Path(path)
    if p.suffix == ".gguf":
        return bool(read_gguf_metadata(p).get("tokenizer.chat_template"))
    if (p / "chat_template.jinja").is_file():
        return True
    try:
        return bool(json.loads((p / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def _eos_ids(tok: GGUFTokenizer, path: str | Path) -> set[int]:
    """The ids that end a generation: the tokenizer's EOS, plus the model's other end-of-generation ids (the GGUF's
    EOT / EOM ids, its end-of-turn tokens: :func:`harness.engines.openai.end_of_generation_ids`)."""
    ids = {tok.eos_id} if tok.eos_id is not None else set()
    return ids | end_of_generation_ids(path)


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


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _named(request: Any, call: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """``call(*args, **kw)``; an engine failure in it names ``request`` (the request as the report shows it)."""
    try:
        return call(*args, **kw)
    except EngineFailure as e:
        raise e.at(request=request)


def _not_run(gate: str, why: str) -> Figure:
    return fig(gate, 0.0, None, got=f"not run: {why}", why=f"not run: {why}")


def _opted_out(gate: str, name: str) -> Figure:
    return fig(gate, 0.0, None, got="opted out", informational_reason=f"opted out with --skip {name}")


# --------------------------------------------------------------------------- the checks


def tokenizer_figures(eng: OpenAIEngine, texts: Sequence[tuple[Any, str, list[int]]]) -> list[Figure]:
    """``server.tokenizer``: each text through the server's tokenizer (BOS added, special markers parsed) against
    ``ids``, our tokenizer's (:func:`harness.tokenizer.prompt_ids.with_prompt_ids`)."""
    rows = []
    for pid, text, mine in texts:
        theirs = _named(pid, eng.tokenize, text, add_special=True)
        if theirs != list(mine):
            i = _first_difference(mine, theirs)
            i = min(len(mine), len(theirs)) if i is None else i
            rows.append({"request": pid, "position": i, "ours": mine[i:i + 6], "server": theirs[i:i + 6]})
    first = rows[0] if rows else None
    why = (f"request {first['request']} position {first['position']}: server {first['server']}, ours {first['ours']}"
           if first else None)
    return [fig("server.tokenizer", 1.0 - len(rows) / max(1, len(texts)), None, texts=len(texts),
                differing=len(rows), rows=rows[:20], **({"why": why, "first_divergence": why} if why else {}))]


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
        g = _named(labels[i] if labels else i, eng.complete, prompts[i], n, top_n)
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
        s = _named(f"{rid} (streamed)", eng.complete, prompts[rid], opts.max_new_tokens, opts.top_n, stream=True,
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
                j = _first_difference([ord(c) for c in s.text], [ord(c) for c in a.text])
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
    i = _first_difference(got[:limit], o.tokens[:limit])
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
            g = _named(f"{first}@max_tokens={k}", eng.complete, prompts[first], k, top_n)
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
        parted = _first_difference(alone[rid].tokens, o.tokens[:limit])
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
            g = _named(f"{rid} (stop {word_s!r})", eng.complete, prompts[rid], n, top_n, stop=[word_s])
            note = None
            i = _first_difference(g.tokens[:k], o.tokens[:k])
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
            g = _named(f"{rid}[:{j + 1}] (EOS not ignored)", eng.complete, prompts[rid][:j + 1], 4, top_n,
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
        g = _named(f"{rid} (EOS not ignored)", eng.complete, prompts[rid], n, top_n, ignore_eos=False)
        kind, why = _stop_verdict(g.tokens, g.finish_reason, oracle[rid], eos_first[rid], eos_ids, n)
        rows.append({"request": rid, "eos_at": eos_first[rid], "kind": kind, "why": why})
    out.append(_stop_figure("server.stop.eos", rows, eos_ids=sorted(eos_ids),
                            eos_reached=len(sites) - len(unsendable) + len(reaching),
                            **({"not_sent": unsendable} if unsendable else {})))
    return out


def prompt_logprob_figures(eng: OpenAIEngine, order: Sequence[str], prompts: dict[str, list[int]],
                           oracle: dict[str, OracleStream], limit: float, top_n: int = TOP_N,
                           required: bool = False) -> list[Figure]:
    """``server.prompt_logprobs``: the log-probs the server reports for each prompt's own tokens (vLLM
    ``prompt_logprobs``, llama-cpp-python ``echo``; :meth:`OpenAIEngine.prompt_logprobs`) against the reference's:
    max |Δ| over the prompt token's log-prob and the shared top-``top_n`` at every position both report, the worst
    place and the first beyond the gate's limit named. ``limit``: the gate's base limit; the figure carries the
    ``effect`` of the emulated approximations on these log-probs (:class:`OracleStream`), which raises it
    (:func:`harness.core.gates.effect_limit`). A dialect that offers none (llama-server) gives an informational
    figure saying "not offered by llama-server", a failing one with ``required`` (``--require
    server-prompt-logprobs``)."""
    gate = "server.prompt_logprobs"
    if eng.dialect == "openai":
        return [_not_offered(gate, "the generic OpenAI dialect", "no prompt log-probabilities (OpenAI's completions "
                             "API returns text)", "server-prompt-logprobs", required)]
    if eng.dialect == "llama-server":
        return [_not_offered(gate, "llama-server", "no prompt log-probabilities (/v1/completions ignores echo; "
                             "/completion reports generated tokens only)", "server-prompt-logprobs", required)]
    effect, effect_at = max((oracle[rid].prompt_effect for rid in order), key=lambda e: e[0], default=(0.0, None))
    limit = effect_limit(DEFAULT_GATES[gate], effect) if effect else limit
    worst, worst_at, first, positions = 0.0, None, None, 0
    for rid in order:
        theirs = _named(f"{rid} (prompt log-probs)", eng.prompt_logprobs, prompts[rid], top_n)
        for i, (t, o) in enumerate(zip(theirs, oracle[rid].prompt_lp)):
            if t is None or o is None:
                continue
            positions += 1
            tl, ttop = t
            ol, otop = o
            diffs = [(abs(tl - ol), prompts[rid][i], tl, ol)]
            diffs += [(abs(v - otop[k]), k, v, otop[k]) for k, v in ttop if k in otop]
            d, k, a, b = max(diffs)
            where = f"request {rid} position {i} token {k}: server {a:.6g}, reference {b:.6g}"
            if d > worst:
                worst, worst_at = d, where
            if first is None and d > limit:
                first = where
    return [fig(gate, worst, None, positions=positions,
                **({"not_measured": "no prompt position has log-probs on both sides"} if not positions else {}),
                **({"worst_at": worst_at, "why": f"largest at {worst_at}"} if worst_at else {}),
                **({"first_divergence": first} if first else {}),
                **({"effect": effect, "effect_at": effect_at} if effect else {}))]


def _not_offered(gate: str, dialect: str, what: str, name: str, required: bool) -> Figure:
    """A check the dialect does not offer: informational ("not offered by <dialect>"), or, when the user required it
    (``--require NAME``), a failing figure saying so."""
    got = f"not offered by {dialect}: {what}"
    if required:
        return fig(gate, float("nan"), None, got=f"{got} (required with --require {name})",
                   why=f"{got}; --require {name} makes that a failure")
    return fig(gate, float("nan"), None, got=got, informational_reason=f"{got} (--require {name} makes it fail)")


def template_figures(eng: OpenAIEngine, tok: GGUFTokenizer) -> list[Figure]:
    """``server.chat_template``: each chat of :data:`CHAT_CASES`, thinking off and on, through the server's template
    against our Gemma 4 chat format: the ids it evaluates against our tokenizer's ids of our text (BOS once), and
    its text (where it shows it, a leading BOS text aside) against ours.
    """
    rows, n = [], 0
    for thinking in (False, True):
        for name, messages in CHAT_CASES:
            n += 1
            text = render(messages, add_generation_prompt=True, enable_thinking=thinking, bos=False)
            ours = text_ids(tok, text)
            theirs, their_text = _named(f"chat {name!r}", eng.chat_ids, messages, enable_thinking=thinking)
            shown = None if their_text is None else their_text.removeprefix(BOS_TEXT)
            if theirs == ours and shown in (None, text):
                continue
            row: dict[str, Any] = {"chat": name, "thinking": thinking}
            if theirs != ours:
                i = _first_difference(ours, theirs)
                i = min(len(ours), len(theirs)) if i is None else i
                row.update(token=i, ours=ours[i:i + 6], server=theirs[i:i + 6])
            if shown is not None and shown != text:
                j = _first_difference([ord(c) for c in text], [ord(c) for c in shown])
                j = min(len(text), len(shown)) if j is None else j
                row.update(char=j, ours_text=text[max(0, j - 20):j + 40], server_text=shown[max(0, j - 20):j + 40])
            rows.append(row)
    first = rows[0] if rows else None
    why = None
    if first:
        where = (f"text at character {first['char']}: server {first['server_text']!r}, ours {first['ours_text']!r}"
                 if "char" in first else f"token {first['token']}: server {first['server']}, ours {first['ours']}")
        why = f"chat {first['chat']!r} (thinking {'on' if first['thinking'] else 'off'}) {where}"
    return [fig("server.chat_template", 1.0 - len(rows) / n, None, chats=n, differing=len(rows), rows=rows,
                **({"why": why, "first_divergence": why} if why else {}))]


# --------------------------------------------------------------------------- the checks, together


def _alone(eng: OpenAIEngine, ids: list[int], n: int, top_n: int = TOP_N,
           request: Any = None) -> tuple[ServerGenerated, float]:
    """The answer to ``ids`` sent alone: the pair check's (:attr:`OpenAIEngine.answers`), else a new request
    (``request`` names it in an engine failure)."""
    key = (tuple(ids), n, top_n)
    if key not in eng.answers:
        t0 = time.monotonic()
        eng.answers[key] = (_named(request, eng.complete, ids, n, top_n), time.monotonic() - t0)
    return eng.answers[key]


def server_checks(eng: OpenAIEngine, runs: ReferenceRuns, prompts: Sequence[dict[str, Any]], pair: str,
                  progress: Progress, opts: ServerOptions | None = None) -> list[Figure]:
    """The server-only checks on ``eng`` after the pair check (see the module docstring).

    Args:
        eng: the server engine the pair check used (its alone answers are reused).
        runs: the reference's shared outputs.
        prompts: prompt records within the model's vocabulary (``text`` kept for text prompts).
        pair: the pair name (``reference~openai``), for progress lines.
        opts: :class:`ServerOptions` (defaults when None).

    Returns:
        Figures for the ``server.*`` gates.

    Raises:
        ServerFailure: the server failed a request (the caller makes it the pair's one line, exit 1).
        InputError: no tokenizer in the model where the checks need one.
    """
    opts = opts or ServerOptions()
    path = eng.path
    n = opts.max_new_tokens
    out: list[Figure] = []
    texts = [(p["id"], p["text"], list(p["prompt_ids"])) for p in prompts if "text" in p]
    tok = model_tokenizer(path)
    if texts and eng.dialect == "openai":
        why = ("not offered by the generic OpenAI dialect: no tokenizer endpoint (the texts are sent as text; the ids "
               "the server evaluates are not seen)")
        out.append(fig("server.tokenizer", float("nan"), None, got=why, informational_reason=why))
    elif texts:
        progress(f"{pair}: tokenizer: {len(texts)} text prompts, server vs ours")
        out += tokenizer_figures(eng, texts)
    context = runs.ref.cfg.context_length
    fit = [p for p in prompts if len(p["prompt_ids"]) + n <= context]
    if not fit:
        raise PromptError(f"{path}: no prompt leaves room for {n} new tokens in the context of {context}")
    order = [str(p["id"]) for p in fit]
    usable = {str(p["id"]): [int(t) for t in p["prompt_ids"]] for p in fit}
    answers = {rid: _alone(eng, usable[rid], n, opts.top_n, rid) for rid in order}
    alone = {rid: a[0] for rid, a in answers.items()}
    alone_s = {rid: a[1] for rid, a in answers.items()}
    eos_ids = _eos_ids(tok, path)
    approx = runs.effective(engine_numerics(eng, "openai").emulation())
    lp_effect, _ = runs.logprob_effect(approx, fit, n, opts.top_n)
    near_tie = near_tie_margin(effect_limit(gate_for(DEFAULT_GATES, f"{pair}.max_abs_logprob"), lp_effect))
    o_streams = oracle_streams(runs, approx, fit, n, eos_ids, opts.top_n, near_tie)

    if skipped(opts.skip, "server-batch"):
        out.append(_opted_out("server.batched~alone.greedy", "server-batch"))
    else:
        progress(f"{pair}: batch invariance, {opts.batch_requests} requests at concurrency {opts.concurrency}")
        out += batch_figures(eng, order, usable, alone, alone_s, opts, near_tie)
    if skipped(opts.skip, "server-stream"):
        out.append(_opted_out("server.stream~nostream.same_tokens", "server-stream"))
    else:
        progress(f"{pair}: streaming vs not streaming")
        out += stream_figures(eng, order, usable, alone, opts)
    if skipped(opts.skip, "server-stop"):
        out += [_opted_out(g, "server-stop") for g in ("server.stop.max_tokens", "server.stop.string",
                                                       "server.stop.eos")]
    else:
        progress(f"{pair}: stop: max_tokens, a stop string, EOS")
        out += _quantized(stop_figures(eng, tok, eos_ids, order, usable, alone, o_streams, opts), eng, runs)
    progress(f"{pair}: prompt log-probs, server vs {runs.name}")
    out += _quantized(prompt_logprob_figures(eng, order, usable, o_streams,
                                             DEFAULT_GATES["server.prompt_logprobs"].limit, opts.top_n,
                                             "server-prompt-logprobs" in opts.require), eng, runs)
    if skipped(opts.skip, "server-template"):
        out.append(_opted_out("server.chat_template", "server-template"))
    elif eng.dialect in ("llama-cpp-python", "openai"):
        out.append(_not_offered("server.chat_template", "the generic OpenAI dialect" if eng.dialect == "openai" else
                                "llama-cpp-python", "no endpoint renders or tokenizes a chat template",
                                "server-template", "server-template" in opts.require))
    elif not _states_template(path) and "server-template" not in opts.require:
        why = (f"{Path(path).name} states no chat template (tokenizer.chat_template), so the server renders its own "
               "fallback (llama-server: ChatML), which is not this model's format; give the server the template "
               "(--chat-template-file) and --require server-template to check it")
        out.append(fig("server.chat_template", float("nan"), None, got=f"not judged: {why}",
                       informational_reason=f"not judged: {why}"))
    else:
        progress(f"{pair}: chat template, server vs ours")
        out += template_figures(eng, tok)
    return out


def _quantized(figs: list[Figure], eng: OpenAIEngine, runs: ReferenceRuns) -> list[Figure]:
    """Figures judged against the oracle's numbers or streams (prompt log-probs; stop and EOS, whose streams part from
    the oracle's where the server's rounding decides a token the other way) of a server that rounds activations for
    quantized weights, on such a file: judged as they are when the oracle emulates the rounding, else informational
    with the reason the pair's own figures carry (:data:`harness.parity.checks.pair.QUANTIZED_ACTIVATIONS`)."""
    types = runs.unemulated_types() if "quantized_activations" in getattr(eng, "approximations", ()) else []
    gap = runs.emulation_gap(engine_numerics(eng, "openai"), types) if types else None
    if gap is not None:
        for f in figs:
            f.detail.setdefault("informational_reason", QUANTIZED_ACTIVATIONS.format(
                engine=eng.dialect, types="/".join(types), why=gap, pair=f"{runs.name}~openai"))
    return figs


EXTRA_CHECKS["openai"] = server_checks
OpenAIEngine.local_tokenizer_of = staticmethod(model_tokenizer)  # the generic dialect's texts (a layer below cannot)


# --------------------------------------------------------------------------- the report


def _md_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    frame = pd.DataFrame([{c: r.get(c, "") for c in columns} for r in rows], columns=columns, dtype=object)
    return dataframe_markdown(frame)


def report_lines(case: dict[str, Any]) -> list[str]:
    """Markdown lines for a case in ``report.md`` (after its checks table): each engine's declared numerics and the
    bounds they set (:func:`harness.parity.checks.pair.numerics_lines`); for a server pair, the server, its dialect
    and model, the requests that part from the reference, the batch-invariance run per request. Empty for a case
    without such pairs."""
    by_gate = {c["gate"]: c for c in case.get("checks", [])}
    lines: list[str] = numerics_lines(case.get("checks", []))
    for gate in by_gate:
        m = re.fullmatch(r"(\w+)~openai(#\d+)?\.runs", gate)
        if m:
            lines += _server_lines(by_gate, f"{m[1]}~openai{m[2] or ''}", m[1], f"server{m[2] or ''}")
    return lines


def _server_lines(by_gate: dict[str, dict[str, Any]], pair: str, oracle: str, server: str) -> list[str]:
    runs = by_gate[f"{pair}.runs"]
    lines = [f"Server: `{runs.get('engine', runs.get('got', ''))}`.", ""]
    g = by_gate.get(f"{pair}.greedy")
    if g and g.get("streams_detail"):
        parted = [r for r in g["streams_detail"] if r["kind"] != "identical"]
        lines += [f"Greedy against the {oracle}: {g['identical']} of {g['streams']} requests identical, "
                  f"{g['by_top_n']} part within the top-{g.get('top_n', TOP_N)}, {g['near_ties']} at a near-tie, "
                  f"{g['streams'] - int(round(g['measured'] * g['streams']))} faults.", ""]
        if parted:
            lines += [_md_table(parted, ["request", "kind", "step", "ours", "oracle", "reason"]), ""]
    b = by_gate.get(f"{server}.batched~alone.greedy")
    if b and b.get("streams_detail"):
        faults = b["requests"] - int(round(b["measured"] * b["streams"]))
        lines += [f"Batch invariance: {b['requests']} requests started {b['stagger_s']:g} s apart, at most "
                  f"{b['concurrency']} in flight (seen: up to {b['max_in_flight']}, {b['mean_in_flight']:g} on "
                  f"average over {b['wall_s']:g} s), each against the same prompt sent alone: "
                  f"**{b['identical']} identical tokens**, **{b['by_top_n'] + b['near_ties']} agree only by the greedy "
                  f"rule** ({b['near_ties']} of them at a near-tie), {faults} faults; {b['bit_identical']} "
                  f"bit-identical (tokens and every log-prob).", ""]
        lines += [_md_table(b["streams_detail"], ["request", "kind", "step", "ours", "oracle", "reason"]), ""]
    return lines
