"""``g4h tokenize``: token ids of each line of a text file, to JSONL, by any tokenizer engine."""

from __future__ import annotations

import argparse
import json
import sys

from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.files import read_text

from ..core.io import write_text_atomic
from ..tokenizer.corpus import unescape
from ..tokenizer.engines import ENGINE_NAMES, make_tok_engine, special_mode
from ._args import InFile, OutFile


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``g4h tokenize``."""
    p.add_argument("--tokenizer", required=True, type=InFile(),
                   help=".gguf, tokenizer.json or tokenizer.model")
    p.add_argument("--engine", default="ours", help=" | ".join(ENGINE_NAMES))
    p.add_argument("--text-file", required=True, type=InFile(streams=True), help="UTF-8 text, one text per line")
    p.add_argument("--out", required=True, type=OutFile(), help='output JSONL: {"text", "ids"} per line')
    p.add_argument("--escapes", action="store_true", help="decode \\n \\t \\uXXXX ... in the lines (corpus format)")
    p.add_argument("--no-bos", action="store_true", help="no BOS in front")
    p.add_argument("--special", choices=["auto", "parse", "text"], default="auto",
                   help="special-token markers in text: parse them, keep them as text, or auto (engine default)")


def run(args: argparse.Namespace) -> int:
    """``g4h tokenize``: each line of ``--text-file`` -> ``{"text": ..., "ids": [...]}`` in ``--out`` (JSONL).

    Lines are split at LF only; ``--escapes`` decodes the corpus escapes
    (``cases/tokenizer/README.md``). Exit 0, or 2 on bad input.
    """
    raw = read_text(args.text_file, "--text-file")
    lines = raw.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if args.escapes:
        lines = [unescape(x) for x in lines]
    engine = make_tok_engine(args.engine, args.tokenizer, add_bos=not args.no_bos,
                             parse_special=special_mode(args.special, args.engine))
    out = [json.dumps({"text": t, "ids": ids}, ensure_ascii=False)
           for t, ids in zip(lines, engine.encode_many(lines))]
    try:
        write_text_atomic(args.out, "\n".join(out) + ("\n" if out else ""))
    except OSError as e:
        raise InputError(f"{args.out}: cannot write output ({e.strerror or e})") from None
    print(f"{args.out}: {len(out)} texts tokenized by {engine.describe()}", file=sys.stderr)
    return 0
