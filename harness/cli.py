"""``g4h``: the command line.

Sub-commands:

* ``g4h logits --model PATH --engine NAME --prompt-ids FILE.json --out FILE.npy``
  writes the logits of every position, ``[T, vocab]`` (float64 for the
  reference, float32 otherwise unless ``--dtype`` says so).
* ``g4h parity [--model PATH ...] [--against ENGINE] [--out DIR]`` runs the
  parity job (see :mod:`harness.parity`).

Exit status: 0 success / all gates pass, 1 a gate failed, 2 bad input (one line
on stderr naming the file, key or tensor).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from reference.errors import InputError, PromptError


def read_prompt_ids(path: str) -> list[int]:
    """Read ``FILE.json``: a JSON list of token ids.

    Raises:
        PromptError: unreadable, not JSON, not a non-empty list of non-negative ints.
    """
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise PromptError(f"{path}: cannot read prompt ids ({e.strerror})") from None
    try:
        ids = json.loads(text)
    except json.JSONDecodeError:
        raise PromptError(f"{path}: not valid JSON (expected a JSON list of token ids)") from None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise PromptError(f"{path}: expected a non-empty JSON list of integer token ids")
    return ids


def save_npy_atomic(path: str, arr: np.ndarray) -> None:
    """Write ``arr`` to ``path`` (.npy) through a temp file and ``os.replace``.

    Raises:
        InputError: the destination cannot be written (named).
    """
    dest = Path(path)
    tmp = None
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npy", dir=dest.parent)
        with os.fdopen(fd, "wb") as f:
            np.save(f, arr)
        os.replace(tmp, dest)
    except OSError as e:
        if tmp:
            Path(tmp).unlink(missing_ok=True)
        raise InputError(f"{path}: cannot write output ({e.strerror or e})") from None


def _engine_options(args: argparse.Namespace) -> dict:
    return {"device": getattr(args, "device", None), "dtype": getattr(args, "dtype_engine", None),
            "batched": getattr(args, "batched", None)}


def cmd_generate(args: argparse.Namespace) -> int:
    from .engines import make_engine
    from .report import write_text_atomic

    from .parity import load_prompts

    prompts = [(p["id"], p["prompt_ids"]) for p in load_prompts(Path(args.prompts))]
    if args.max_new_tokens < 1:
        raise PromptError(f"--max-new-tokens {args.max_new_tokens}: expected >= 1")
    engine = make_engine(args.engine, args.model, **_engine_options(args))
    gens = engine.generate_full([p for _, p in prompts], args.max_new_tokens)
    lines = [json.dumps({"id": pid, "tokens": g.tokens, "top5": [[[i, lp] for i, lp in step] for step in g.top5]})
             for (pid, _), g in zip(prompts, gens)]
    try:
        write_text_atomic(args.out, "\n".join(lines) + "\n")
    except OSError as e:
        raise InputError(f"{args.out}: cannot write output ({e.strerror or e})") from None
    print(f"{args.out}: {len(lines)} continuations of {args.max_new_tokens} tokens", file=sys.stderr)
    return 0


def cmd_logits(args: argparse.Namespace) -> int:
    from .engines import make_engine

    ids = read_prompt_ids(args.prompt_ids)
    engine = make_engine(args.engine, args.model, **_engine_options(args))
    logits = engine.logits(ids)
    dtype = args.dtype or ("float64" if args.engine == "reference" else "float32")
    save_npy_atomic(args.out, np.asarray(logits, dtype=dtype))
    print(f"{args.out}: logits {list(logits.shape)} {dtype}", file=sys.stderr)
    return 0


def cmd_parity(args: argparse.Namespace) -> int:
    from .parity import run
    from .parity_report import short_table

    data, status = run(models=args.model, against=args.against, out=args.out, real=not args.no_real,
                       case_filter=args.case, quiet=args.quiet)
    print(short_table(data))
    print(f"\nreport: {data['run_dir']}/report.md  (exit {status})")
    return status


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``g4h`` (sub-commands ``logits`` and ``parity``)."""
    p = argparse.ArgumentParser(prog="g4h", description="Gemma 4 correctness and performance harness")
    sub = p.add_subparsers(dest="command", required=True)

    lg = sub.add_parser("logits", help="logits of every position of a prompt, [T, vocab], to .npy")
    lg.add_argument("--model", required=True, help=".gguf file or HF model folder")
    lg.add_argument("--engine", default="reference", help="reference | transformers | fast")
    lg.add_argument("--prompt-ids", required=True, help="JSON list of token ids")
    lg.add_argument("--out", required=True, help="output .npy")
    lg.add_argument("--device", default=None, help="fast engine: cpu | cuda (default: cuda when present)")
    lg.add_argument("--dtype", dest="dtype_engine", choices=["float32", "bfloat16", "float16"], default=None,
                    help="fast engine: compute dtype (default float32)")
    lg.add_argument("--out-dtype", dest="dtype", choices=["float32", "float64"], default=None,
                    help="dtype of the .npy (default float64 for the reference, else float32)")
    lg.set_defaults(func=cmd_logits)

    ge = sub.add_parser("generate", help="greedy continuations of a JSONL prompt set")
    ge.add_argument("--model", required=True, help=".gguf file or HF model folder")
    ge.add_argument("--engine", default="fast", help="reference | transformers | fast")
    ge.add_argument("--prompts", required=True, help='JSONL: {"id": ..., "prompt_ids": [...]} per line')
    ge.add_argument("--max-new-tokens", type=int, required=True)
    ge.add_argument("--batched", action="store_true", default=None, help="fast engine: one continuous batch")
    ge.add_argument("--device", default=None, help="fast engine: cpu | cuda")
    ge.add_argument("--dtype", dest="dtype_engine", choices=["float32", "bfloat16", "float16"], default=None)
    ge.add_argument("--out", required=True, help='output JSONL: {"id", "tokens", "top5"} per line')
    ge.set_defaults(func=cmd_generate)

    pa = sub.add_parser("parity", help="compare engines on the case library and apply the gates")
    pa.add_argument("--model", action="append", default=None,
                    help="a user model (.gguf or HF folder); repeatable. Default: the built-in cases")
    pa.add_argument("--against", default="transformers", help="oracle engine for --model (default transformers)")
    pa.add_argument("--out", default=None, help="parent folder of the run directory (default reports/)")
    pa.add_argument("--case", action="append", default=None, help="only this built-in case (repeatable)")
    pa.add_argument("--no-real", action="store_true", help="skip the real Gemma 3 270M GGUF")
    pa.add_argument("--quiet", action="store_true", help="no progress lines")
    pa.set_defaults(func=cmd_parity)
    return p


def _quiet_libraries() -> None:
    """Silence transformers' per-load progress bars and advisory logs (our own progress lines remain)."""
    try:
        import transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.logging.set_verbosity_error()
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``g4h``; returns the exit status (also when called from Python)."""
    args = build_parser().parse_args(argv)
    _quiet_libraries()
    try:
        return args.func(args)
    except InputError as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"g4h: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("g4h: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
