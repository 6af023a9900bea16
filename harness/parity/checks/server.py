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

This module adds the checks only a server has (:data:`harness.parity.cases.OWN_CHECKS` ``["openai"]``,
:func:`server_checks`), each a figure with a gate in ``harness/core/gates.py``; those of how a server reads a prompt
(1, 5, 6) are :mod:`.server_prompt`'s, those of how it generates (2 to 4) :mod:`.server_generation`'s, what they share
(options, the reference's streams) :mod:`.server_base`'s:

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
makes it fail (:data:`.server_base.REQUIRABLE`). A check the server offers and gets wrong fails either way.

A server that is down or silent when the pair starts raises :class:`~harness.engines.openai.ServerError` (an
:class:`InputError`: the URL cannot be used, exit 2). Once it serves, a request that fails (an error status, no
answer within the timeout, malformed JSON or another shape, a token it cannot name, a dropped token, a step that is
not greedy, a crash) raises :class:`~harness.engines.openai.ServerFailure`, an engine failure naming the request
(:func:`.server_base.named`) and the step: the pair then ends with that one line as its ``reference~openai.runs`` figure
(exit 1, "ENGINE FAILED"). Either way the run goes on with the other engines and cases.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import pandas as pd

from gemma4_harness.reference.errors import PromptError
from gemma4_harness.reference.tokenizer import GGUFTokenizer, read_gguf_metadata

from ... import synth
from ...core.gates import DEFAULT_GATES, effect_limit, gate_for
from ...core.io import dataframe_markdown
from ...engines.base import TOP_N
from ...engines.openai import OpenAIEngine, ServerGenerated, end_of_generation_ids
from ...synth.prompts import PROMPT_SEED, text_pieces, text_prompt
from ...tokenizer.prompt_ids import model_tokenizer, text_ids
from ..result import Figure, fig
from ..skips import skipped
from .pair import (
    engine_numerics,
    near_tie_margin,
    numerics_lines,
)
from .quantized import QUANTIZED_ACTIVATIONS
from .reference_runs import ReferenceRuns
from .server_base import ServerOptions, named, not_offered, oracle_streams
from .server_generation import batch_figures, stop_figures, stream_figures
from .server_prompt import prompt_logprob_figures, template_figures, tokenizer_figures

__all__ = ["ServerOptions", "report_lines", "server_checks", "spec_gates"]

Progress = Callable[[str], None]


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


def _opted_out(gate: str, name: str) -> Figure:
    return fig(gate, 0.0, None, got="opted out", informational_reason=f"opted out with --skip {name}")


# --------------------------------------------------------------------------- the checks, together


def _alone(eng: OpenAIEngine, ids: list[int], n: int, top_n: int = TOP_N,
           request: Any = None) -> tuple[ServerGenerated, float]:
    """The answer to ``ids`` sent alone: the pair check's (:attr:`OpenAIEngine.answers`), else a new request
    (``request`` names it in an engine failure)."""
    key = (tuple(ids), n, top_n)
    if key not in eng.answers:
        t0 = time.monotonic()
        eng.answers[key] = (named(request, eng.complete, ids, n, top_n), time.monotonic() - t0)
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
        out.append(not_offered("server.chat_template", "the generic OpenAI dialect" if eng.dialect == "openai" else
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
    with the reason the pair's own figures carry (:data:`harness.parity.checks.quantized.QUANTIZED_ACTIVATIONS`)."""
    types = runs.unemulated_types() if "quantized_activations" in getattr(eng, "approximations", ()) else []
    gap = runs.emulation_gap(engine_numerics(eng, "openai"), types) if types else None
    if gap is not None:
        for f in figs:
            f.detail.setdefault("informational_reason", QUANTIZED_ACTIVATIONS.format(
                engine=eng.dialect, types="/".join(types), why=gap, pair=f"{runs.name}~openai"))
    return figs


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
