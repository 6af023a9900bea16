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

Parsing the other way (model output and whole conversations back to structure) is
:mod:`reference.chat_parse`.
"""

from __future__ import annotations

import os
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


def call_parts(tc: Mapping[str, Any]) -> tuple[str, Any]:
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


def content_text(content: Any, model: bool) -> tuple[str, str | None]:
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
                out.append(format_tool_call(*call_parts(tc)))
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
                        name = call_parts(tc)[0]
                body = follow.get("content")
                if isinstance(body, (list, tuple)):
                    text = "".join(str(p.get("text", "")) for p in body
                                   if isinstance(p, Mapping) and p.get("type") == "text")
                    out.append(format_tool_response(str(name), text))
                    out.extend(MEDIA[p["type"]] for p in body if isinstance(p, Mapping) and p.get("type") in MEDIA)
                else:
                    out.append(format_tool_response(str(name), body))
                responded, prev_type = True, "tool_response"
        captured, media = content_text(msg.get("content"), role == "model")
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
    """Render (see :func:`render`) and tokenize with special markers parsed; BOS exactly once (the rendered one).

    Args:
        tokenizer: a :class:`reference.tokenizer.GGUFTokenizer` (anything with
            ``encode(text, add_bos=, parse_special=)``).
        messages, tools, kwargs: as :func:`render`.

    Returns:
        token ids starting with one BOS (the rendered ``<bos>`` is that BOS; the
        tokenizer is asked for none, as transformers' ``apply_chat_template`` tokenizes the rendered text with
        ``add_special_tokens=False``; a rendering without ``<bos>`` gets one from the tokenizer).
    """
    text = render(messages, tools, **kwargs)
    return tokenizer.encode(text, add_bos=not text.startswith(BOS), parse_special=True)


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
