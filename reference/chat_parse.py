"""The Gemma 4 chat format read back: values, model output and whole conversations -> structure.

The inverse of :mod:`reference.chat` (whose docstring gives the text layout). Model output (what
follows ``<|turn>model\\n``) is parsed by :func:`parse_model_output`: ``<|channel>thought\\n...<channel|>``
is thinking, ``<|tool_call>call:NAME{...}<tool_call|>`` are tool calls, the rest (up to ``<turn|>``,
``<|tool_response>`` or ``<eos>``) is the answer. :func:`parse_conversation` reads a rendered
conversation back into messages, so that ``parse_conversation(render(m))`` round-trips
(:func:`normalize_messages` gives the form it compares against).

Source: the same rules as :mod:`reference.chat` (Google's Gemma 4 chat template; transformers' Gemma 4
response parser, ``transformers/cli/serving/utils.py``); no code taken from either.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from .chat import (
    BOS,
    CALL_CLOSE,
    CALL_OPEN,
    CHANNEL_CLOSE,
    EOS,
    QUOTE,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    THINK,
    THOUGHT_OPEN,
    TOOL_CLOSE,
    TOOL_OPEN,
    TURN_CLOSE,
    TURN_OPEN,
    call_parts,
    content_text,
    message_thinking,
)
from .errors import InputError

# --------------------------------------------------------------------------- parsing values


class _ValueParser:
    """Recursive-descent reader of :func:`format_value` text."""

    def __init__(self, text: str):
        self.s, self.i = text, 0

    def error(self, what: str) -> InputError:
        return InputError(f"tool syntax: {what} at offset {self.i} of {self.s[:60]!r}")

    def value(self) -> Any:
        s = self.s
        if s.startswith(QUOTE, self.i):
            end = s.find(QUOTE, self.i + len(QUOTE))
            if end < 0:
                raise self.error("unterminated string")
            v = s[self.i + len(QUOTE):end]
            self.i = end + len(QUOTE)
            return v
        if s.startswith("{", self.i):
            return self.mapping()
        if s.startswith("[", self.i):
            self.i += 1
            out = []
            if s.startswith("]", self.i):
                self.i += 1
                return out
            while True:
                out.append(self.value())
                if s.startswith(",", self.i):
                    self.i += 1
                elif s.startswith("]", self.i):
                    self.i += 1
                    return out
                else:
                    raise self.error("expected ',' or ']'")
        m = re.compile(r"[^,}\]]*").match(s, self.i)
        self.i = m.end()
        return _scalar(m.group(0))

    def key(self) -> str:
        s = self.s
        if s.startswith(QUOTE, self.i):
            k = self.value()
        else:
            j = s.find(":", self.i)
            if j < 0:
                raise self.error("expected 'key:'")
            k, self.i = s[self.i:j], j
        if not s.startswith(":", self.i):
            raise self.error("expected ':'")
        self.i += 1
        return k

    def mapping(self) -> dict:
        s = self.s
        if not s.startswith("{", self.i):
            raise self.error("expected '{'")
        self.i += 1
        out: dict = {}
        if s.startswith("}", self.i):
            self.i += 1
            return out
        while True:
            k = self.key()
            out[k] = self.value()
            if s.startswith(",", self.i):
                self.i += 1
            elif s.startswith("}", self.i):
                self.i += 1
                return out
            else:
                raise self.error("expected ',' or '}'")


def _scalar(tok: str) -> Any:
    t = tok.strip()
    if t == "true":
        return True
    if t == "false":
        return False
    if t in ("None", "null"):
        return None
    if re.fullmatch(r"[+-]?\d+", t):
        return int(t)
    try:
        return float(t)
    except ValueError:
        return tok


def parse_value(text: str) -> Any:
    """Read one value written by :func:`format_value` (keys bare or quoted).

    Raises:
        InputError: malformed text or trailing characters.
    """
    p = _ValueParser(text)
    v = p.value()
    if p.i != len(text):
        raise p.error("trailing text")
    return v


def parse_arguments(body: str) -> dict:
    """``k:v,...`` (the inside of ``call:NAME{...}``) -> dict.

    Raises:
        InputError: malformed.
    """
    return parse_value("{" + body + "}")


# --------------------------------------------------------------------------- parsing model output

_CALL = re.compile(r"call:([^{\s<]+)\{(.*)\}\Z", re.S)
_RESP = re.compile(r"response:([^{\s<]+)\{(.*)\}\Z", re.S)


def _tool_call_of(body: str) -> dict:
    m = _CALL.match(body)
    if not m:
        raise InputError(f"tool call: expected call:NAME{{...}}, got {body[:60]!r}")
    name, args = m.group(1), m.group(2)
    try:
        arguments: Any = parse_arguments(args)
    except InputError:
        arguments = args  # kept verbatim, as the template writes a string argument
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_response_of(body: str) -> dict:
    m = _RESP.match(body)
    if not m:
        raise InputError(f"tool response: expected response:NAME{{...}}, got {body[:60]!r}")
    content: Any = parse_arguments(m.group(2))
    if isinstance(content, dict) and list(content) == ["value"]:
        content = content["value"]
    return {"role": "tool", "name": m.group(1), "content": content}


def parse_model_output(text: str) -> dict:
    """Split what the model generated after ``<|turn>model\\n`` into thinking, answer and tool calls.

    Args:
        text: decoded model output (with special tokens rendered).

    Returns:
        ``{"thinking": str | None, "content": str, "tool_calls": [...],
        "stop": "<turn|>" | "<|tool_response>" | "<eos>" | None}``: thinking
        blocks joined with a newline (one trailing newline of each removed, as
        the template writes one), the answer text outside the blocks (trimmed),
        tool calls as ``{"type": "function", "function": {"name", "arguments"}}``
        (arguments a dict, or the raw text when it does not parse), and the
        marker that ended the output.

    Raises:
        InputError: an unterminated thought or tool-call block, a tool call not
            of the form ``call:NAME{...}``.
    """
    thinking: list[str] = []
    content: list[str] = []
    calls: list[dict] = []
    stop = None
    i = 0
    while i < len(text):
        if text.startswith(THOUGHT_OPEN, i):
            end = text.find(CHANNEL_CLOSE, i)
            if end < 0:
                raise InputError("model output: <|channel>thought without <channel|>")
            t = text[i + len(THOUGHT_OPEN):end]
            thinking.append(t[:-1] if t.endswith("\n") else t)
            i = end + len(CHANNEL_CLOSE)
        elif text.startswith(CALL_OPEN, i):
            end = text.find(CALL_CLOSE, i)
            if end < 0:
                raise InputError("model output: <|tool_call> without <tool_call|>")
            calls.append(_tool_call_of(text[i + len(CALL_OPEN):end]))
            i = end + len(CALL_CLOSE)
        else:
            hit = min(((text.find(m, i), m) for m in (TURN_CLOSE, RESPONSE_OPEN, EOS, THOUGHT_OPEN, CALL_OPEN)
                       if text.find(m, i) >= 0), default=None)
            if hit is None:
                content.append(text[i:])
                break
            pos, marker = hit
            content.append(text[i:pos])
            i = pos
            if marker in (TURN_CLOSE, RESPONSE_OPEN, EOS):
                stop = marker
                break
    return {"thinking": "\n".join(thinking) if thinking else None, "content": "".join(content).strip(),
            "tool_calls": calls, "stop": stop}


# --------------------------------------------------------------------------- parsing a conversation


def _split_model_turn(body: str) -> list[dict]:
    """The body of one model turn -> assistant messages and their tool messages (canonical split)."""
    out: list[dict] = []
    cur: dict | None = None
    state = "empty"  # empty | thought | calls | responses | content

    def new() -> dict:
        m = {"role": "assistant", "content": ""}
        out.append(m)
        return m

    i = 0
    while i < len(body):
        if body.startswith(THOUGHT_OPEN, i):
            end = body.find(CHANNEL_CLOSE, i)
            if end < 0:
                raise InputError("conversation: <|channel>thought without <channel|>")
            t = body[i + len(THOUGHT_OPEN):end]
            if cur is None or state != "empty":
                cur = new()
            cur["reasoning_content"] = t[:-1] if t.endswith("\n") else t
            state, i = "thought", end + len(CHANNEL_CLOSE)
        elif body.startswith(CALL_OPEN, i):
            end = body.find(CALL_CLOSE, i)
            if end < 0:
                raise InputError("conversation: <|tool_call> without <tool_call|>")
            if cur is None or state in ("responses", "content"):
                cur = new()
            cur.setdefault("tool_calls", []).append(_tool_call_of(body[i + len(CALL_OPEN):end]))
            state, i = "calls", end + len(CALL_CLOSE)
        elif body.startswith(RESPONSE_OPEN, i):
            end = body.find(RESPONSE_CLOSE, i)
            if end < 0:  # the turn ends waiting for the tool
                i = len(body)
                break
            if cur is None:
                cur = new()
            out.append(_tool_response_of(body[i + len(RESPONSE_OPEN):end]))
            state, i = "responses", end + len(RESPONSE_CLOSE)
        else:
            nxt = [p for p in (body.find(THOUGHT_OPEN, i), body.find(CALL_OPEN, i), body.find(RESPONSE_OPEN, i))
                   if p >= 0]
            end = min(nxt) if nxt else len(body)
            text = body[i:end]
            if text.strip():
                if cur is None or state == "responses":
                    cur = new()
                cur["content"] += text
                state = "content"
            i = end
    for m in out:
        if m["role"] == "assistant":
            m["content"] = m["content"].strip()
    return out


def parse_conversation(text: str) -> dict:
    """Read text written by :func:`render` back into messages (the inverse for canonical conversations).

    Canonical means: an assistant message's text comes after its tool calls'
    responses only as a separate assistant message (both render alike); an
    assistant message right after tool responses is not empty (it would render
    as nothing); two assistant messages are not adjacent without tool messages
    between them; a mapping tool response is not exactly ``{"value": ...}``; and
    strings hold no format markers. Thinking survives when rendered with
    ``preserve_thinking=True``.

    Returns:
        ``{"messages": [...], "tools": [{"name", "declaration": str}],
        "enable_thinking": bool, "add_generation_prompt": bool}``. Assistant
        messages are ``{"role": "assistant", "content", "reasoning_content"?,
        "tool_calls"?}``, tool messages ``{"role": "tool", "name", "content"}``.

    Raises:
        InputError: text that does not follow the format.
    """
    pos = len(BOS) if text.startswith(BOS) else 0
    res: dict = {"messages": [], "tools": [], "enable_thinking": False, "add_generation_prompt": False}
    first = True
    while pos < len(text):
        if not text.startswith(TURN_OPEN, pos):
            raise InputError(f"conversation: expected {TURN_OPEN} at offset {pos}: {text[pos:pos + 40]!r}")
        nl = text.find("\n", pos)
        if nl < 0:
            raise InputError(f"conversation: turn header without newline at offset {pos}")
        role = text[pos + len(TURN_OPEN):nl]
        pos = nl + 1
        if role == "model":
            # ends at <turn|>\n, at the next turn, or at the end of the text
            close = text.find(TURN_CLOSE, pos)
            nxt = text.find(TURN_OPEN, pos)
            ends = [p for p in (close, nxt) if p >= 0]
            end = min(ends) if ends else len(text)
            body = text[pos:end]
            if end == len(text) and body in ("", THOUGHT_OPEN + CHANNEL_CLOSE):
                res["add_generation_prompt"] = True
                break
            msgs = _split_model_turn(body)
            if not msgs and end == close:
                msgs = [{"role": "assistant", "content": ""}]  # an empty model message
            res["messages"].extend(msgs)
            pos = end + (len(TURN_CLOSE) + (1 if text.startswith("\n", end + len(TURN_CLOSE)) else 0)
                         if end == close else 0)
            first = False
            continue
        close = text.find(TURN_CLOSE, pos)
        if close < 0:
            raise InputError(f"conversation: {role} turn without {TURN_CLOSE}")
        body = text[pos:close]
        pos = close + len(TURN_CLOSE) + (1 if text.startswith("\n", close + len(TURN_CLOSE)) else 0)
        if role == "system" and first:
            if body.startswith(THINK + "\n"):
                res["enable_thinking"] = True
                body = body[len(THINK) + 1:]
            t = body.find(TOOL_OPEN)
            sys_text, decls = (body, "") if t < 0 else (body[:t], body[t:])
            for m in re.finditer(re.escape(TOOL_OPEN) + r"(.*?)" + re.escape(TOOL_CLOSE), decls, re.S):
                d = m.group(1)
                name = re.match(r"declaration:([^{]*)\{", d)
                res["tools"].append({"name": name.group(1) if name else None, "declaration": d})
            if sys_text:
                res["messages"].append({"role": "system", "content": sys_text})
        else:
            res["messages"].append({"role": role, "content": body})
        first = False
    return res


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Messages as :func:`parse_conversation` returns them after :func:`render` (for round-trip checks).

    Roles ``developer`` -> ``system`` (first message only) and ``model`` ->
    ``assistant``; text trimmed (model text without thinking blocks); thinking
    under ``reasoning_content``; tool calls as ``{"type": "function",
    "function": {"name", "arguments"}}``; tool messages as ``{"role": "tool",
    "name", "content"}`` with the name resolved from ``tool_call_id``.
    """
    out: list[dict] = []
    calls_by_id: dict[str, str] = {}
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "developer" and i == 0:
            role = "system"
        if role == "model":
            role = "assistant"
        if role == "tool":
            name = m.get("name") or "unknown"
            if m.get("tool_call_id") in calls_by_id:
                name = calls_by_id[m["tool_call_id"]]
            out.append({"role": "tool", "name": name, "content": m.get("content")})
            continue
        content, _ = content_text(m.get("content"), role == "assistant")
        n: dict = {"role": role, "content": content}
        if role == "assistant":
            th = message_thinking(m)
            if th:
                n["reasoning_content"] = th
            if m.get("tool_calls"):
                n["tool_calls"] = []
                for tc in m["tool_calls"]:
                    name, args = call_parts(tc)
                    if tc.get("id") is not None:
                        calls_by_id[tc["id"]] = name
                    n["tool_calls"].append({"type": "function", "function": {"name": name, "arguments": args}})
        if role == "system" and not content:
            continue
        out.append(n)
    return out
