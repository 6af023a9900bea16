"""``g4h generate``: greedy continuations of a JSONL prompt set (or of one ``--prompt-ids`` prompt, which may carry
images and audio: :mod:`._mm`), with top-5 log-probabilities.

With ``--draft-model`` (fast engine, text prompts) the continuations come from speculative decoding
(:class:`fast.speculative.SpecEngine`): the same tokens, and each line also carries
``"speculative": {"drafted", "accepted", "acceptance_rate", "target_forwards", "tokens_per_forward"}``.
"""

from __future__ import annotations

import argparse
import json
import sys

from gemma4_harness.reference.errors import InputError, PromptError

from ..core.engine_kinds import KIND, KINDS, TWIN
from ..core.io import write_text_atomic
from ..core.prompts import load_prompts, read_prompt_ids
from ..engines import make_engine
from ..engines.base import TOP_N
from ._args import (
    Count,
    InFile,
    ModelArg,
    OutFile,
    add_model_args,
    check_out_file,
    engine_options,
    resolve_draft_model,
    resolve_model,
)
from ._mm import add_mm_args, mm_requested, open_mm_prompt


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``g4h generate``."""
    add_model_args(p, default_engine=TWIN)
    p.add_argument("--prompts", default=None, type=InFile(streams=True),
                   help='JSONL: {"id": ..., "prompt_ids": [...]} per line')
    p.add_argument("--prompt-ids", default=None, metavar="FILE.json", type=InFile(streams=True),
                   help="one prompt, a JSON list of token ids (instead of --prompts; needed with --image/--audio); "
                        'its output line has id "prompt"')
    p.add_argument("--max-new-tokens", type=Count(1), required=True, help="tokens to generate per prompt")
    p.add_argument("--batched", action="store_true", default=None, help="fast engine: one continuous batch")
    p.add_argument("--top-n", type=Count(1), default=TOP_N, metavar="N",
                   help=f"(id, logprob) pairs kept per step, best first (default {TOP_N}; text prompts without "
                        "--draft-model)")
    p.add_argument("--out", required=True, type=OutFile(),
                   help='output JSONL: {"id", "tokens", "top_logprobs"} per line')
    p.add_argument("--draft-model", default=None, type=ModelArg(),
                   help="speculative decoding (fast engine): a Gemma 4 assistant (HF folder, gemma4-assistant GGUF, "
                        "or a drafter case such as e2b-assistant), or oracle | random | partial:J; the output is the "
                        "same, plus per-request statistics")
    p.add_argument("--draft-tokens", type=Count(1, 1024), default=4, help="with --draft-model: drafts per round (K)")
    add_mm_args(p)


def run(args: argparse.Namespace) -> int:
    """Write the continuations; exit 0 (2 on bad input, from the caller)."""
    check_out_file(args.out)
    if (args.prompts is None) == (args.prompt_ids is None):
        raise InputError("g4h generate: give --prompts FILE.jsonl or --prompt-ids FILE.json (one of them)")
    if args.max_new_tokens < 1:
        raise PromptError(f"--max-new-tokens {args.max_new_tokens}: expected >= 1")
    if args.draft_model is not None and not getattr(KIND.get(args.engine), "drafts", False):
        raise InputError(f"--draft-model: speculative decoding runs on the "
                         f"{' or '.join(k.name for k in KINDS if k.drafts)} engine, not {args.engine!r}")
    if args.draft_tokens < 1:
        raise InputError(f"--draft-tokens {args.draft_tokens}: expected >= 1")
    if args.top_n < 1:
        raise InputError(f"--top-n {args.top_n}: expected >= 1")
    if args.top_n != TOP_N and (args.draft_model is not None or mm_requested(args)):
        raise InputError(f"--top-n {args.top_n}: speculative and multimodal generation keep the top {TOP_N}")
    extra: list[dict] = []
    if mm_requested(args):
        if args.prompt_ids is None:
            raise InputError("g4h generate: --image / --audio / --mmproj go with one --prompt-ids prompt")
        if args.draft_model is not None:
            raise InputError("--draft-model: speculative decoding takes text prompts, not --image / --audio")
        _, prompt, engine = open_mm_prompt(args, read_prompt_ids(args.prompt_ids))
        prompts, gens = [("prompt", prompt.ids)], [engine.generate_full(prompt, args.max_new_tokens)]
    else:
        prompts = ([(p["id"], p["prompt_ids"]) for p in load_prompts(args.prompts, ids_only=True)] if args.prompts else
                   [("prompt", read_prompt_ids(args.prompt_ids))])
        engine = make_engine(args.engine, resolve_model(args.model, args.engine), **engine_options(args))
        ids = [p for _, p in prompts]
        if args.draft_model is None:
            gens = engine.generate_full(ids, args.max_new_tokens, top_n=args.top_n)
        else:
            gens = engine.generate_speculative(ids, args.max_new_tokens, resolve_draft_model(args.draft_model),
                                               args.draft_tokens)
            extra = [{"speculative": g.stats.as_dict(len(g.tokens))} for g in gens]
            drafted, accepted = sum(g.stats.drafted for g in gens), sum(g.stats.accepted for g in gens)
            forwards = sum(g.stats.target_forwards for g in gens)
            print(f"speculative ({args.draft_model}, K={args.draft_tokens}): {accepted} of {drafted} drafts accepted"
                  f"{f' ({100 * accepted / drafted:.1f} %)' if drafted else ''}, "
                  f"{sum(len(g.tokens) for g in gens) / max(forwards, 1):.2f} tokens per target forward",
                  file=sys.stderr)
    extra = extra or [{} for _ in gens]
    lines = [json.dumps({"id": pid, "tokens": g.tokens, "top_logprobs": [[[i, lp] for i, lp in step] for step in g.top],
                         **x}) for (pid, _), g, x in zip(prompts, gens, extra)]
    try:
        write_text_atomic(args.out, "\n".join(lines) + "\n")
    except OSError as e:
        raise InputError(f"{args.out}: cannot write output ({e.strerror or e})") from None
    print(f"{args.out}: {len(lines)} continuations of {args.max_new_tokens} tokens", file=sys.stderr)
    return 0
