"""``g4h generate``: greedy continuations of a JSONL prompt set, with top-5 log-probabilities."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from reference.errors import InputError, PromptError

from ..core.cases import load_prompts
from ..core.io import write_text_atomic
from ..engines import make_engine
from ._args import add_model_args, check_out_file, engine_options, resolve_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``g4h generate``."""
    add_model_args(p, default_engine="fast")
    p.add_argument("--prompts", required=True, help='JSONL: {"id": ..., "prompt_ids": [...]} per line')
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--batched", action="store_true", default=None, help="fast engine: one continuous batch")
    p.add_argument("--out", required=True, help='output JSONL: {"id", "tokens", "top5"} per line')


def run(args: argparse.Namespace) -> int:
    """Write the continuations; exit 0 (2 on bad input, from the caller)."""
    check_out_file(args.out)
    prompts = [(p["id"], p["prompt_ids"]) for p in load_prompts(Path(args.prompts))]
    if args.max_new_tokens < 1:
        raise PromptError(f"--max-new-tokens {args.max_new_tokens}: expected >= 1")
    engine = make_engine(args.engine, resolve_model(args.model, args.engine), **engine_options(args))
    gens = engine.generate_full([p for _, p in prompts], args.max_new_tokens)
    lines = [json.dumps({"id": pid, "tokens": g.tokens, "top5": [[[i, lp] for i, lp in step] for step in g.top5]})
             for (pid, _), g in zip(prompts, gens)]
    try:
        write_text_atomic(args.out, "\n".join(lines) + "\n")
    except OSError as e:
        raise InputError(f"{args.out}: cannot write output ({e.strerror or e})") from None
    print(f"{args.out}: {len(lines)} continuations of {args.max_new_tokens} tokens", file=sys.stderr)
    return 0
