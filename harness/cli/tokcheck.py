"""``g4h tokcheck``: texts whose token ids differ between two tokenizer engines."""

from __future__ import annotations

import argparse
import json

from gemma4_harness.reference.errors import InputError

from ..core.io import write_text_atomic
from ..tokenizer.corpus import compare_engines, format_diff, load_corpus
from ..tokenizer.engines import DEFAULT_ENGINE, ENGINE_NAMES, make_tok_engine, special_mode
from ..tokenizer.files import tokenizer_kind
from ._args import Count, InFile, OutFile


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``g4h tokcheck``."""
    p.add_argument("--tokenizer", required=True, type=InFile(),
                   help=".gguf, tokenizer.json or tokenizer.model")
    p.add_argument("--engine", default="ours", help="engine for --tokenizer (default ours)")
    p.add_argument("--against", required=True,
                   help="an engine name (" + " | ".join(ENGINE_NAMES) + ") or a second tokenizer file")
    p.add_argument("--against-tokenizer", default=None, type=InFile(),
                   help="file for an --against engine (default: --tokenizer)")
    p.add_argument("--against-engine", default=None, help="engine for an --against file (default by kind)")
    p.add_argument("--corpus", default=None, type=InFile(streams=True, folders=True, what="corpus"),
                   help="corpus folder or file (default cases/tokenizer)")
    p.add_argument("--special", choices=["auto", "parse", "text"], default="auto",
                   help="auto: parse special markers unless spm takes part (its own rule)")
    p.add_argument("--max-examples", type=Count(0), default=50, help="differing texts listed (all are counted)")
    p.add_argument("--json", default=None, type=OutFile(), help="also write the result as JSON here")


def run(args: argparse.Namespace) -> int:
    """``g4h tokcheck``: texts whose ids differ between two tokenizer engines.

    ``--against`` is an engine name (run on ``--against-tokenizer``, default the
    same file) or a tokenizer file (run with ``--against-engine``, default by
    kind: tokenizer.json -> hf, tokenizer.model -> spm, .gguf -> ours).
    Exit 0 none differ, 1 some differ, 2 bad input.
    """
    if args.against in ENGINE_NAMES:
        b_engine, b_path = args.against, args.against_tokenizer or args.tokenizer
    else:
        b_path = args.against
        b_engine = args.against_engine or DEFAULT_ENGINE[tokenizer_kind(b_path)]
    texts = load_corpus(args.corpus)
    mode = special_mode(args.special, args.engine, b_engine)
    a = make_tok_engine(args.engine, args.tokenizer, parse_special=mode)
    b = make_tok_engine(b_engine, b_path, parse_special=mode)
    res = compare_engines(a, b, texts, max_examples=args.max_examples)
    for d in res["diffs"]:
        print(format_diff(d))
    print(f"{res['a']} vs {res['b']}: {res['texts']} texts, {res['differing']} differ")
    if args.json:
        try:
            write_text_atomic(args.json, json.dumps(res, ensure_ascii=False, indent=1) + "\n")
        except OSError as e:
            raise InputError(f"{args.json}: cannot write output ({e.strerror or e})") from None
    return 1 if res["differing"] else 0
