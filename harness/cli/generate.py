"""``g4h generate``: greedy continuations of a JSONL prompt set (or of one ``--prompt-ids`` prompt, which may carry
images and audio: :mod:`._mm`), with top-5 log-probabilities."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from reference.errors import InputError, PromptError

from ..core.cases import load_prompts, read_prompt_ids
from ..core.io import write_text_atomic
from ..engines import make_engine
from ._args import add_model_args, check_out_file, engine_options, resolve_model
from ._mm import add_mm_args, mm_requested, open_mm_prompt


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``g4h generate``."""
    add_model_args(p, default_engine="fast")
    p.add_argument("--prompts", default=None, help='JSONL: {"id": ..., "prompt_ids": [...]} per line')
    p.add_argument("--prompt-ids", default=None, metavar="FILE.json",
                   help="one prompt, a JSON list of token ids (instead of --prompts; needed with --image/--audio); "
                        'its output line has id "prompt"')
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--batched", action="store_true", default=None, help="fast engine: one continuous batch")
    p.add_argument("--out", required=True, help='output JSONL: {"id", "tokens", "top5"} per line')
    add_mm_args(p)


def run(args: argparse.Namespace) -> int:
    """Write the continuations; exit 0 (2 on bad input, from the caller)."""
    check_out_file(args.out)
    if (args.prompts is None) == (args.prompt_ids is None):
        raise InputError("g4h generate: give --prompts FILE.jsonl or --prompt-ids FILE.json (one of them)")
    if args.max_new_tokens < 1:
        raise PromptError(f"--max-new-tokens {args.max_new_tokens}: expected >= 1")
    if mm_requested(args):
        if args.prompt_ids is None:
            raise InputError("g4h generate: --image / --audio / --mmproj go with one --prompt-ids prompt")
        _, prompt, engine = open_mm_prompt(args, read_prompt_ids(args.prompt_ids))
        prompts, gens = [("prompt", prompt.ids)], [engine.generate_full(prompt, args.max_new_tokens)]
    else:
        prompts = ([(p["id"], p["prompt_ids"]) for p in load_prompts(Path(args.prompts))] if args.prompts else
                   [("prompt", read_prompt_ids(args.prompt_ids))])
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
