"""Text from outside (an engine's error line, a server's reply, a file's name or field) made safe for where it is
written: one function per destination.

The harness quotes what engines and servers say (``docs/hostile-input.md``): their last error line, a reply it
could not read. That text can hold anything: terminal control sequences (which recolour, retitle or clear the
user's terminal, or hide the verdict), Markdown and HTML (which restructure a report or run script in a viewer),
characters XML 1.0 cannot hold (which make a CI system drop the JUnit file), and lone UTF-16 surrogates (which
``json.loads`` makes from ``"\\ud800"`` and which no UTF-8 encoder writes: a traceback instead of a verdict).

* :func:`visible`: the common step: every character that is not printable text (C0 and C1 controls, DEL, lone
  surrogates, the noncharacters U+FFFE/U+FFFF, bidirectional overrides) written as a visible escape
  (``\\x1b``, ``\\ud800``, ``\\u202e``), as Python's ``repr`` would; the rest unchanged;
* :func:`for_terminal`: :func:`visible` (newlines kept where the caller prints several lines);
* :func:`for_markdown`: :func:`visible` on one line, and what Markdown or HTML would read as markup escaped
  (``|``, backticks, ``*``, a link's ``](``, an escaping backslash; ``<`` before a tag and ``&`` before an entity as
  entities), so a viewer renders the text as text;
* :func:`for_markdown_code`: a code span when the text is plain, else :func:`for_markdown`;
* :func:`for_xml`: :func:`visible` (XML 1.0 ``Char`` holds everything left); ElementTree escapes ``<``, ``&`` and
  ``>`` (a CDATA end ``]]>`` included) itself;
* :func:`for_json`: a value with every string (keys included) passed through :func:`visible` where it holds a
  lone surrogate, so that it encodes as UTF-8.

Text the harness writes itself is unchanged by each (it holds none of these characters).
"""

from __future__ import annotations

import re
from typing import Any

_INVISIBLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\ufffe\uffff\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_INVISIBLE_NL = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\ufffe\uffff\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _escape(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def visible(text: Any, newlines: bool = False) -> str:
    """``str(text)`` with every non-printing character written as a visible escape (``\\x1b``, ``\\ud800``).

    Args:
        text: any value (``str()`` of it is taken).
        newlines: keep ``\\n`` and ``\\t`` as they are (several lines printed on purpose); else they are escaped
            too (``\\x0a``, ``\\x09``), like every other control.

    Returns:
        the text: printable characters only, encodable as UTF-8.
    """
    s = text if isinstance(text, str) else str(text)
    return (_INVISIBLE if newlines else _INVISIBLE_NL).sub(_escape, s)


def for_terminal(text: Any, newlines: bool = True) -> str:
    """Text for the terminal (stdout, stderr): :func:`visible` (no escape sequence reaches the terminal)."""
    return visible(text, newlines=newlines)


_MD_SPECIAL = re.compile(r"\\(?=[!-/:-@\[-`{-~])|[`*|]|\](?=[(\[])")
_MD_TAG = re.compile(r"<(?=[A-Za-z/!?])")
_MD_ENTITY = re.compile(r"&(?=[A-Za-z#])")


def for_markdown(text: Any) -> str:
    """Text for a Markdown report (a line, a table cell): :func:`visible` on one line, then backslash-escaped what
    Markdown reads as markup: backticks, ``*``, ``|``, a ``]`` that would close a link (before ``(`` or ``[``) and a
    backslash that would escape the next character; ``<`` before a tag name (``<script``, ``</x``, ``<!--``) and
    ``&`` before an entity name written as ``&lt;`` and ``&amp;``. CommonMark and GitHub render the result as the
    original characters; ``<= 0.5``, ``a & b``, ``results[0]`` and ``a\\nb`` stay as they are."""
    s = visible(text, newlines=False)
    s = _MD_SPECIAL.sub(lambda m: "\\" + m.group(), s)
    s = _MD_ENTITY.sub("&amp;", s)
    return _MD_TAG.sub("&lt;", s)


def for_markdown_code(text: Any) -> str:
    """Text for a Markdown code span: ```text``` when it holds no backtick and nothing :func:`visible` changes (a
    code span shows its content as it is), else :func:`for_markdown` (escapes do not work inside a code span)."""
    s = text if isinstance(text, str) else str(text)
    return f"`{s}`" if "`" not in s and s.strip() == s and s and visible(s) == s else for_markdown(s)


def for_xml(text: Any) -> str:
    """Text for XML 1.0 (an attribute or element text, written by ElementTree, which escapes ``<``, ``&``, ``>``):
    :func:`visible` with newlines kept, which leaves only characters of XML 1.0's ``Char`` production."""
    return visible(text, newlines=True)


def for_json(value: Any) -> Any:
    """``value`` (JSON-able: dicts, lists, strings, numbers) with every string that holds a lone surrogate passed
    through :func:`visible`, keys included; anything else returned as it is (the same object when nothing
    changes)."""
    if isinstance(value, str):
        return visible(value, newlines=True) if _SURROGATE.search(value) else value
    if isinstance(value, dict):
        return {for_json(k): for_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [for_json(v) for v in value]
    return value
