"""The Gemma 4 chat format: conversations -> text / token ids, and model output -> structure.

The rules are those of Google's Gemma 4 chat template (``tokenizer.chat_template``
of the released checkpoints; learned from public copies of it and from
transformers' Gemma 4 response parser, ``transformers/cli/serving/utils.py``,
entry ``("gemma4",)``). No code is taken from either; the template itself is not
available offline, so a real file's template is compared with this module by
:func:`compare_with_template`.

Text layout
-----------
``<bos>``, then a system turn when thinking is on, tools are declared, or the
first message is ``system``/``developer``::

    <|turn>system\\n[<|think|>\\n]SYSTEM TEXT[<|tool>declaration:NAME{...}<tool|>...]<turn|>\\n

then one turn per message (role ``assistant`` is written ``model``)::

    <|turn>user\\nTEXT<turn|>\\n
    <|turn>model\\n[<|channel>thought\\nTHINKING\\n<channel|>][<|tool_call>call:NAME{k:v,...}<tool_call|>...]
        [<|tool_response>response:NAME{k:v,...}<tool_response|>...]TEXT<turn|>\\n

and, when asked, the generation prompt ``<|turn>model\\n``. Details that follow
the template exactly:

* Text is trimmed (``str.strip``); model text has any ``<|channel>...<channel|>``
  block removed first.
* Thinking of a model message is written only when it comes after the last user
  message and the message makes tool calls (``preserve_thinking=True`` writes
  it for every model message).
* Values (``format_value``): strings ``<|"|>s<|"|>``, booleans ``true``/``false``,
  mappings ``{key:value,...}`` with keys sorted case-insensitively (Jinja
  ``dictsort``), lists ``[a,b]``, anything else ``str()`` (``None`` -> ``None``).
  Tool-call arguments and tool responses write keys bare; other mappings quote
  them with ``<|"|>``.
* Tool responses: the ``tool`` messages that follow a model message with tool
  calls are written inside that model turn (``response:NAME{value:...}`` when
  the response is not a mapping; NAME from ``tool_call_id``, else the message's
  ``name``). After tool calls without responses the turn ends with
  ``<|tool_response>`` (the model waits for the tool); after responses and no
  text it stays open, and the next assistant message continues it without a
  new ``<|turn>model\\n``.
* Media parts of a content list become ``<|image|>``, ``<|audio|>``, ``<|video|>``.
* The generation prompt is not written right after tool calls or responses.

Model output (what follows ``<|turn>model\\n``) is parsed by
:func:`parse_model_output`: ``<|channel>thought\\n...<channel|>`` is thinking,
``<|tool_call>call:NAME{...}<tool_call|>`` are tool calls, the rest (up to
``<turn|>``, ``<|tool_response>`` or ``<eos>``) is the answer.
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping, Sequence

from .errors import InputError
from .tokenizer import read_gguf_metadata

BOS = "<bos>"
EOS = "<eos>"
TURN_OPEN, TURN_CLOSE = "<|turn>", "<turn|>"
THINK = "<|think|>"
CHANNEL_OPEN, CHANNEL_CLOSE = "<|channel>", "<channel|>"
THOUGHT_OPEN = CHANNEL_OPEN + "thought\n"
TOOL_OPEN, TOOL_CLOSE = "<|tool>", "<tool|>"
CALL_OPEN, CALL_CLOSE = "<|tool_call>", "<tool_call|>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<|tool_response>", "<tool_response|>"
QUOTE = '<|"|>'
MEDIA = {"image": "<|image|>", "audio": "<|audio|>", "video": "<|video|>"}
_THINKING_KEYS = ("reasoning_content", "thinking", "reasoning")


# --------------------------------------------------------------------------- values


def _dictsort(d: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Jinja ``dictsort``: items sorted by key, case-insensitively, stable."""
    return sorted(d.items(), key=lambda kv: kv[0].lower() if isinstance(kv[0], str) else kv[0])


def format_value(value: Any, escape_keys: bool = True) -> str:
    """A value in Gemma 4's tool syntax (the template's ``format_argument``).

    Args:
        value: str, bool, mapping, list/tuple, number or None.
        escape_keys: quote mapping keys with ``<|"|>`` (False for tool-call
            arguments and tool responses).

    Returns:
        the text (strings are not escaped: a string holding ``<|"|>`` cannot be
        read back).
    """
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        items = [(QUOTE + k + QUOTE if escape_keys else str(k)) + ":" + format_value(v, escape_keys)
                 for k, v in _dictsort(value)]
        return "{" + ",".join(items) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_value(v, escape_keys) for v in value) + "]"
    return str(value)


def _upper(v: Any) -> str:
    return "" if v is None else str(v).upper()


def _format_parameters(properties: Mapping[str, Any], filter_keys: bool = False) -> str:
    """The template's ``format_parameters``: the ``properties`` of a JSON schema in tool syntax."""
    standard = ("description", "type", "properties", "required", "nullable")
    out: list[str] = []
    for key, value in _dictsort(properties):
        if filter_keys and key in standard:
            continue
        value = value if isinstance(value, Mapping) else {}
        parts: list[str] = []
        if value.get("description"):
            parts.append("description:" + QUOTE + str(value["description"]) + QUOTE)
        vtype = _upper(value.get("type"))
        if vtype == "STRING":
            if value.get("enum"):
                parts.append("enum:" + format_value(value["enum"]))
        elif vtype == "ARRAY":
            items = value.get("items")
            if isinstance(items, Mapping) and items:
                inner: list[str] = []
                for ik, iv in _dictsort(items):
                    if iv is None:
                        continue
                    if ik == "properties":
                        inner.append("properties:{" + (_format_parameters(iv) if isinstance(iv, Mapping) else "") + "}")
                    elif ik == "required":
                        inner.append("required:[" + ",".join(QUOTE + str(r) + QUOTE for r in iv) + "]")
                    elif ik == "type":
                        inner.append("type:" + format_value(_upper(iv) if isinstance(iv, str) else [_upper(x) for x in iv]))
                    else:
                        inner.append(f"{ik}:" + format_value(iv))
                parts.append("items:{" + ",".join(inner) + "}")
        if value.get("nullable"):
            parts.append("nullable:true")
        if vtype == "OBJECT":
            if isinstance(value.get("properties"), Mapping):
                parts.append("properties:{" + _format_parameters(value["properties"]) + "}")
            else:
                parts.append("properties:{" + _format_parameters(value, filter_keys=True) + "}")
            if value.get("required"):
                parts.append("required:[" + ",".join(QUOTE + str(r) + QUOTE for r in value["required"]) + "]")
        parts.append("type:" + QUOTE + vtype + QUOTE)
        out.append(f"{key}:{{" + ",".join(parts) + "}")
    return ",".join(out)


def format_tool_declaration(tool: Mapping[str, Any]) -> str:
    """``declaration:NAME{description:...,parameters:{...}}`` for an OpenAI-style tool schema.

    Args:
        tool: ``{"type": "function", "function": {"name", "description",
            "parameters": JSON schema, "response"?: {...}}}`` (a bare
            ``{"name", ...}`` function dict is accepted too).

    Raises:
        InputError: no function name.

    Source: the template's ``format_function_declaration`` (quirk kept: the
    ``parameters`` brace is closed only when the schema states a ``type``).
    """
    fn = tool.get("function", tool) if isinstance(tool, Mapping) else {}
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not name:
        raise InputError(f"tool declaration without a function name: {str(tool)[:80]}")
    s = f"declaration:{name}{{description:{QUOTE}{fn.get('description') or ''}{QUOTE}"
    params = fn.get("parameters")
    if params:
        s += ",parameters:{"
        if params.get("properties"):
            s += "properties:{" + _format_parameters(params["properties"]) + "},"
        if params.get("required"):
            s += "required:[" + ",".join(QUOTE + str(r) + QUOTE for r in params["required"]) + "],"
        if params.get("type"):
            s += "type:" + QUOTE + _upper(params["type"]) + QUOTE + "}"
    if "response" in fn:
        resp = fn["response"] or {}
        s += ",response:{"
        if resp.get("description"):
            s += "description:" + QUOTE + str(resp["description"]) + QUOTE + ","
        if _upper(resp.get("type")) == "OBJECT":
            s += "type:" + QUOTE + _upper(resp["type"]) + QUOTE + "}"
    return s + "}"


# --------------------------------------------------------------------------- rendering


def strip_thinking(text: str) -> str:
    """Remove ``<|channel>...<channel|>`` blocks from model text, then trim (the template's ``strip_thinking``)."""
    out = []
    for part in text.split(CHANNEL_CLOSE):
        out.append(part.split(CHANNEL_OPEN)[0] if CHANNEL_OPEN in part else part)
    return "".join(out).strip()


def message_thinking(msg: Mapping[str, Any]) -> str | None:
    """The thinking text of a message: ``reasoning_content``, ``thinking`` or ``reasoning`` (first non-empty)."""
    for k in _THINKING_KEYS:
        if msg.get(k):
            return str(msg[k])
    return None


def _call_parts(tc: Mapping[str, Any]) -> tuple[str, Any]:
    fn = tc.get("function", tc)
    return str(fn.get("name")), fn.get("arguments", {})


def format_tool_call(name: str, arguments: Any) -> str:
    """``<|tool_call>call:NAME{k:v,...}<tool_call|>`` (a string ``arguments`` is written as it is)."""
    if isinstance(arguments, Mapping):
        body = ",".join(f"{k}:" + format_value(v, escape_keys=False) for k, v in _dictsort(arguments))
    elif isinstance(arguments, str):
        body = arguments
    else:
        body = ""
    return f"{CALL_OPEN}call:{name}{{{body}}}{CALL_CLOSE}"


def format_tool_response(name: str, response: Any) -> str:
    """``<|tool_response>response:NAME{...}<tool_response|>`` (``{value:...}`` for a non-mapping)."""
    if isinstance(response, Mapping):
        body = ",".join(f"{k}:" + format_value(v, escape_keys=False) for k, v in _dictsort(response))
    else:
        body = "value:" + format_value(response, escape_keys=False)
    return f"{RESPONSE_OPEN}response:{name}{{{body}}}{RESPONSE_CLOSE}"


def _content_text(content: Any, model: bool) -> tuple[str, str | None]:
    """(rendered content, media type of the last media part or None)."""
    if isinstance(content, str):
        return (strip_thinking(content) if model else content.strip()), None
    out, media = [], None
    if isinstance(content, (list, tuple)):
        for item in content:
            kind = item.get("type") if isinstance(item, Mapping) else None
            if kind == "text":
                t = str(item.get("text", ""))
                out.append(strip_thinking(t) if model else t.strip())
            elif kind in MEDIA:
                out.append(MEDIA[kind])
                media = kind
    return "".join(out), media


def render(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None, *,
           add_generation_prompt: bool = False, enable_thinking: bool = False, preserve_thinking: bool = False,
           empty_thought_when_off: bool = False, bos: bool = True) -> str:
    """A conversation as Gemma 4 chat text (rules in the module docstring).

    Args:
        messages: OpenAI/HF-style dicts: ``role`` (``system``, ``developer``,
            ``user``, ``assistant``/``model``, ``tool``), ``content`` (str or a
            list of ``{"type": "text"|"image"|"audio"|"video", ...}``);
            assistant messages may carry thinking (``reasoning_content``,
            ``thinking`` or ``reasoning``), ``tool_calls`` (``[{"function":
            {"name", "arguments": dict | str}, "id"?}]``) and legacy
            ``tool_responses`` (``[{"name", "response"}]``); tool messages carry
            ``content`` and ``tool_call_id`` or ``name``.
        tools: tool schemas, declared in the system turn.
        add_generation_prompt: end with ``<|turn>model\\n``.
        enable_thinking: ``<|think|>`` at the top of the system turn.
        preserve_thinking: write the thinking of every model message (the
            template writes it only for tool-calling messages after the last
            user message).
        empty_thought_when_off: after the generation prompt, write an empty
            thought block when thinking is off (some Gemma 4 templates do).
        bos: start with ``<bos>``.

    Returns:
        the text.

    Raises:
        InputError: a message without a string ``role``; a tool without a name.
    """
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise InputError(f"message {i}: expected a dict with a string 'role'")
    out = [BOS] if bos else []
    prev_type: str | None = None
    loop = list(messages)
    has_system = bool(loop) and loop[0]["role"] in ("system", "developer")
    if enable_thinking or tools or has_system:
        out.append(TURN_OPEN + "system\n")
        if enable_thinking:
            out.append(THINK + "\n")
            prev_type = "think"
        if has_system:
            c = loop[0].get("content")
            if isinstance(c, str):
                out.append(c.strip())
            elif isinstance(c, (list, tuple)):
                out.extend(str(item.get("text", "")).strip() + " " for item in c)
            loop = loop[1:]
        if tools:
            for tool in tools:
                out.append(TOOL_OPEN + format_tool_declaration(tool).strip() + TOOL_CLOSE)
            prev_type = "tool"
        out.append(TURN_CLOSE + "\n")
    last_user = max((i for i, m in enumerate(loop) if m["role"] == "user"), default=-1)
    for idx, msg in enumerate(loop):
        if msg["role"] == "tool":
            continue
        prev_type = None
        role = "model" if msg["role"] == "assistant" else msg["role"]
        prev_role = next((loop[j]["role"] for j in range(idx - 1, -1, -1) if loop[j]["role"] != "tool"), None)
        if not (role == "model" and prev_role == "assistant"):
            out.append(f"{TURN_OPEN}{role}\n")
        calls = msg.get("tool_calls") or []
        thinking = message_thinking(msg)
        if thinking and (preserve_thinking or (idx > last_user and calls)):
            out.append(THOUGHT_OPEN + thinking + "\n" + CHANNEL_CLOSE)
        if calls:
            for tc in calls:
                out.append(format_tool_call(*_call_parts(tc)))
            prev_type = "tool_call"
        responded = False
        if msg.get("tool_responses"):
            for tr in msg["tool_responses"]:
                out.append(format_tool_response(str(tr.get("name") or "unknown"), tr.get("response")))
                responded, prev_type = True, "tool_response"
        elif calls:
            for follow in loop[idx + 1:]:
                if follow["role"] != "tool":
                    break
                name = follow.get("name") or "unknown"
                for tc in calls:
                    if tc.get("id") is not None and tc.get("id") == follow.get("tool_call_id"):
                        name = _call_parts(tc)[0]
                body = follow.get("content")
                if isinstance(body, (list, tuple)):
                    text = "".join(str(p.get("text", "")) for p in body
                                   if isinstance(p, Mapping) and p.get("type") == "text")
                    out.append(format_tool_response(str(name), text))
                    out.extend(MEDIA[p["type"]] for p in body if isinstance(p, Mapping) and p.get("type") in MEDIA)
                else:
                    out.append(format_tool_response(str(name), body))
                responded, prev_type = True, "tool_response"
        captured, media = _content_text(msg.get("content"), role == "model")
        if media is not None:
            prev_type = media
        out.append(captured)
        has_content = bool(captured.strip())
        if prev_type == "tool_call" and not responded:
            out.append(RESPONSE_OPEN)
        elif not (responded and not has_content):
            out.append(TURN_CLOSE + "\n")
    if add_generation_prompt and prev_type not in ("tool_response", "tool_call"):
        out.append(TURN_OPEN + "model\n")
        if empty_thought_when_off and not enable_thinking:
            out.append(THOUGHT_OPEN + CHANNEL_CLOSE)
    return "".join(out)


def render_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
               tools: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> list[int]:
    """Render (see :func:`render`) and tokenize with special markers parsed; BOS exactly once.

    Args:
        tokenizer: a :class:`reference.tokenizer.GGUFTokenizer` (anything with
            ``encode(text, add_bos=, parse_special=)``).
        messages, tools, kwargs: as :func:`render`.

    Returns:
        token ids starting with one BOS (the rendered ``<bos>`` is that BOS; the
        tokenizer does not add another).
    """
    return tokenizer.encode(render(messages, tools, **kwargs), add_bos=True, parse_special=True)


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
        content, _ = _content_text(m.get("content"), role == "assistant")
        n: dict = {"role": role, "content": content}
        if role == "assistant":
            th = message_thinking(m)
            if th:
                n["reasoning_content"] = th
            if m.get("tool_calls"):
                n["tool_calls"] = []
                for tc in m["tool_calls"]:
                    name, args = _call_parts(tc)
                    if tc.get("id") is not None:
                        calls_by_id[tc["id"]] = name
                    n["tool_calls"].append({"type": "function", "function": {"name": name, "arguments": args}})
        if role == "system" and not content:
            continue
        out.append(n)
    return out


# --------------------------------------------------------------------------- Jinja templates


def chat_template_from_gguf(path: str | os.PathLike) -> str | None:
    """``tokenizer.chat_template`` of a GGUF, or None when it has none.

    Raises:
        ModelFileError: not a readable GGUF.
    """
    t = read_gguf_metadata(path).get("tokenizer.chat_template")
    return str(t) if t is not None else None


def render_with_template(template: str, messages: Sequence[Mapping[str, Any]],
                         tools: Sequence[Mapping[str, Any]] | None = None, *, add_generation_prompt: bool = False,
                         enable_thinking: bool = False, bos_token: str = BOS, **extra: Any) -> str:
    """Render with a Jinja chat template through transformers' own renderer (sandboxed, as ``apply_chat_template``).

    Raises:
        InputError: transformers/jinja2 missing, or the template fails (one line).
    """
    try:
        from transformers.utils.chat_template_utils import render_jinja_template  # optional heavy dependency
    except ImportError:
        raise InputError("rendering a Jinja chat template needs transformers and jinja2: pip install transformers jinja2") from None
    try:
        rendered, _ = render_jinja_template(conversations=[list(messages)], tools=list(tools) if tools else None,
                                            chat_template=template, add_generation_prompt=add_generation_prompt,
                                            bos_token=bos_token, eos_token=EOS, enable_thinking=enable_thinking,
                                            **extra)
    except ImportError as e:
        raise InputError(f"rendering a Jinja chat template: {e}") from None
    except Exception as e:  # noqa: BLE001 - jinja errors of a user's template
        raise InputError(f"chat template failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}") from None
    return rendered[0]


def compare_with_template(template: str, cases: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Render each case with :func:`render` and with ``template``; list the ones that differ.

    Args:
        template: Jinja text (e.g. :func:`chat_template_from_gguf`).
        cases: ``{"messages", "tools"?, "add_generation_prompt"?, "enable_thinking"?, "name"?}``.

    Returns:
        one ``{"name", "position", "ours", "template"}`` per differing case
        (texts cut to 60 characters around the first differing character); an
        empty list when all agree.

    Raises:
        InputError: see :func:`render_with_template`.
    """
    diffs = []
    for n, case in enumerate(cases):
        kw = {k: bool(case.get(k, False)) for k in ("add_generation_prompt", "enable_thinking")}
        ours = render(case["messages"], case.get("tools"), **kw)
        theirs = render_with_template(template, case["messages"], case.get("tools"), **kw)
        if ours != theirs:
            pos = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            lo = max(0, pos - 20)
            diffs.append({"name": case.get("name", f"case {n}"), "position": pos,
                          "ours": ours[lo:pos + 40], "template": theirs[lo:pos + 40]})
    return diffs
