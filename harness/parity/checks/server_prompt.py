"""The server checks of how a server reads a prompt (:mod:`.server`, items 1, 5 and 6): its ``/tokenize`` of each text
against our tokenizer (:func:`tokenizer_figures`), the log-probs of the prompt's own tokens against the reference's
(:func:`prompt_logprob_figures`), and the ids its chat template evaluates against our Gemma 4 chat format
(:func:`template_figures`).
"""

from __future__ import annotations

from typing import Any, Sequence

from gemma4_harness.reference.chat import BOS as BOS_TEXT
from gemma4_harness.reference.chat import render
from gemma4_harness.reference.tokenizer import GGUFTokenizer

from ...core.gates import DEFAULT_GATES, effect_limit
from ...engines.base import TOP_N
from ...engines.openai import OpenAIEngine
from ...tokenizer.prompt_ids import text_ids
from ..result import Figure, fig
from .server_base import OracleStream, first_difference, named, not_offered


#: Conversations for the chat-template check (plain turns: what every server's template endpoint takes).
CHAT_CASES: tuple[tuple[str, list[dict[str, str]]], ...] = (
    ("one user turn", [{"role": "user", "content": "Hi"}]),
    ("system and user", [{"role": "system", "content": "You are terse."},
                         {"role": "user", "content": "Name a colour."}]),
    ("three turns", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
                     {"role": "user", "content": "Count to three."}]),
)


# --------------------------------------------------------------------------- the checks


def tokenizer_figures(eng: OpenAIEngine, texts: Sequence[tuple[Any, str, list[int]]]) -> list[Figure]:
    """``server.tokenizer``: each text through the server's tokenizer (BOS added, special markers parsed) against
    ``ids``, our tokenizer's (:func:`harness.tokenizer.prompt_ids.with_prompt_ids`)."""
    rows = []
    for pid, text, mine in texts:
        theirs = named(pid, eng.tokenize, text, add_special=True)
        if theirs != list(mine):
            i = first_difference(mine, theirs)
            i = min(len(mine), len(theirs)) if i is None else i
            rows.append({"request": pid, "position": i, "ours": mine[i:i + 6], "server": theirs[i:i + 6]})
    first = rows[0] if rows else None
    why = (f"request {first['request']} position {first['position']}: server {first['server']}, ours {first['ours']}"
           if first else None)
    return [fig("server.tokenizer", 1.0 - len(rows) / max(1, len(texts)), None, texts=len(texts),
                differing=len(rows), rows=rows[:20], **({"why": why, "first_divergence": why} if why else {}))]


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
        return [not_offered(gate, "the generic OpenAI dialect", "no prompt log-probabilities (OpenAI's completions "
                             "API returns text)", "server-prompt-logprobs", required)]
    if eng.dialect == "llama-server":
        return [not_offered(gate, "llama-server", "no prompt log-probabilities (/v1/completions ignores echo; "
                             "/completion reports generated tokens only)", "server-prompt-logprobs", required)]
    effect, effect_at = max((oracle[rid].prompt_effect for rid in order), key=lambda e: e[0], default=(0.0, None))
    limit = effect_limit(DEFAULT_GATES[gate], effect) if effect else limit
    worst, worst_at, first, positions = 0.0, None, None, 0
    for rid in order:
        theirs = named(f"{rid} (prompt log-probs)", eng.prompt_logprobs, prompts[rid], top_n)
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
            theirs, their_text = named(f"chat {name!r}", eng.chat_ids, messages, enable_thinking=thinking)
            shown = None if their_text is None else their_text.removeprefix(BOS_TEXT)
            if theirs == ours and shown in (None, text):
                continue
            row: dict[str, Any] = {"chat": name, "thinking": thinking}
            if theirs != ours:
                i = first_difference(ours, theirs)
                i = min(len(ours), len(theirs)) if i is None else i
                row.update(token=i, ours=ours[i:i + 6], server=theirs[i:i + 6])
            if shown is not None and shown != text:
                j = first_difference([ord(c) for c in text], [ord(c) for c in shown])
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
