"""A ``cmd:`` engine whose every error carries hostile text (issue 37, item 3): XML that ends a CDATA section and
characters XML 1.0 cannot hold, Markdown (pipes, backticks, HTML), terminal escape and control sequences and a
lone surrogate (sent as the JSON escape ``\\ud800``, which ``json.loads`` turns into one). It answers ``hello``
and refuses ``logits`` and ``generate`` with that text, and writes it to stderr (as bytes, the surrogate as the
invalid UTF-8 a C program would write)."""

from __future__ import annotations

import json
import sys

NASTY = ("</failure>]]><![CDATA[<x a='1'>&amp; \ud800 | col | `code` <script>alert(1)</script> *em* [l](javascript:x) "
         "\x1b[31mRED\x1b[0m \x1b]0;title\x07 \x9b2J \x08\x00\x0b\x0c \udfff \ufffe \u202e end\rEND")


def main() -> None:
    sys.stderr.buffer.write(b"engine: " + NASTY.encode("utf-8", "surrogatepass") + b"\n")
    sys.stderr.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "hello":
            ans = {"id": req["id"], "ok": True, "protocol": 1, "ops": ["logits", "generate"], "vocab_size": 32,
                   "engine": NASTY}
        else:
            ans = {"id": req["id"], "ok": False, "error": NASTY}
        sys.stdout.write(json.dumps(ans) + "\n")  # ensure_ascii: the surrogate travels as \ud800
        sys.stdout.flush()


if __name__ == "__main__":
    main()
