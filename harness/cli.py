"""``g4h``: the command line.

Sub-commands:

* ``g4h logits --model PATH --engine NAME --prompt-ids FILE.json --out FILE.npy``
  writes the logits of every position, ``[T, vocab]`` (float64 for the
  reference, float32 otherwise unless ``--out-dtype`` says so).
* ``g4h generate --model PATH --engine NAME --prompts FILE.jsonl --max-new-tokens N --out FILE.jsonl``
  greedy continuations with top-5 log-probabilities.
* ``g4h parity [--model PATH ...] [--against ENGINE] [--out DIR] [--baseline F]`` runs the
  parity job (see :mod:`harness.parity`).
* ``g4h trace`` / ``g4h diff`` write and compare checksum traces (:mod:`harness.traces`);
  ``g4h selftest`` runs the mutation self-test (:mod:`harness.selftest`).
* ``g4h tokenize`` / ``g4h tokcheck``: tokenizer engines and parity (:mod:`harness.tokengines`).
* ``g4h bench --model PATH --engines fast,transformers,...``: llama-bench-style throughput
  with a batch/depth sweep and roofline shares (:mod:`harness.bench_cli`).

Exit status: 0 success / all gates pass, 1 a gate failed, 2 bad input (one line
on stderr naming the file, key or tensor) or an engine whose worker process
crashed on it (one line: ``g4h: error: engine crashed: ...``).
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
                       case_filter=args.case, quiet=args.quiet, baseline=getattr(args, "baseline", None),
                       write_baseline=getattr(args, "write_baseline", None),
                       regression_factor=getattr(args, "regression_factor", 10.0))
    print(short_table(data))
    _print_baseline(data, getattr(args, "write_baseline", None))
    print(f"\nreport: {data['run_dir']}/report.md  (exit {status})")
    return status


def _print_baseline(data: dict, written: str | None) -> None:
    """Terminal lines for ``--baseline`` (regressions, one per line) and ``--write-baseline``."""
    b = data.get("baseline")
    if b:
        regs = b["regressions"]
        print(f"\nbaseline {b['file']}: {b['compared']} checks compared, {len(regs)} regression(s)")
        for r in regs:
            extra = f" ({r['ratio']:.3g}x worse)" if "ratio" in r else ""
            print(f"  REGRESSION {r['case']} {r['gate']} {r.get('prompt') or ''}: {r['rule']}{extra}: "
                  f"baseline {r.get('baseline')} -> now {r.get('now')}")
    if written:
        print(f"baseline written: {written}")


def cmd_tokenize(args: argparse.Namespace) -> int:
    """``g4h tokenize``: each line of ``--text-file`` -> ``{"text": ..., "ids": [...]}`` in ``--out`` (JSONL).

    Lines are split at LF only; ``--escapes`` decodes the corpus escapes
    (``cases/tokenizer/README.md``). Exit 0, or 2 on bad input.
    """
    from .report import write_text_atomic
    from .tokengines import make_tok_engine, special_mode, unescape

    try:
        raw = Path(args.text_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{args.text_file}: cannot read text file ({getattr(e, 'strerror', None) or e})") from None
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


def cmd_tokcheck(args: argparse.Namespace) -> int:
    """``g4h tokcheck``: texts whose ids differ between two tokenizer engines.

    ``--against`` is an engine name (run on ``--against-tokenizer``, default the
    same file) or a tokenizer file (run with ``--against-engine``, default by
    kind: tokenizer.json -> hf, tokenizer.model -> spm, .gguf -> ours).
    Exit 0 none differ, 1 some differ, 2 bad input.
    """
    from .tokbuild import tokenizer_kind
    from .tokengines import (DEFAULT_ENGINE, ENGINE_NAMES, compare_engines, format_diff, load_corpus,
                             make_tok_engine, special_mode)

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
        from .report import write_text_atomic

        try:
            write_text_atomic(args.json, json.dumps(res, ensure_ascii=False, indent=1) + "\n")
        except OSError as e:
            raise InputError(f"{args.json}: cannot write output ({e.strerror or e})") from None
    return 1 if res["differing"] else 0


def cmd_trace(args: argparse.Namespace) -> int:
    """``g4h trace``: write a trace file of one prompt (see :func:`harness.traces.trace_command`)."""
    from .traces import trace_command

    path = trace_command(args.model, args.engine, args.prompt_ids, args.out, dump_dir=args.dump_tensors,
                         device=args.device, dtype=args.dtype_engine, case=args.case, llama_dump=args.llama_dump,
                         sum_scope=args.sum_scope)
    print(f"{path}: trace written", file=sys.stderr)
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    """``g4h diff A B``: first diverging trace point; exit 0 none, 1 one, 2 bad input."""
    from .traces import diff_command

    return diff_command(args.a, args.b, tol=args.tol, skip=args.skip or (), min_cosine=args.min_cosine,
                        json_out=args.json)


def cmd_selftest(args: argparse.Namespace) -> int:
    """``g4h selftest``: mutation test of the harness (see :mod:`harness.selftest`)."""
    from .selftest import selftest_command

    return selftest_command(args.case, args.prompt, args.out, args.quiet)


def _add_trace_parsers(sub) -> None:
    """Parser entries of ``trace``, ``diff`` and ``selftest``."""
    from .traces import DEFAULT_TOL

    tr = sub.add_parser("trace", help="checksum trace of one prompt (JSONL), optionally with a tensor dump")
    tr.add_argument("--model", default=None, help=".gguf file or HF model folder")
    tr.add_argument("--engine", default="reference", help="reference | transformers | fast")
    tr.add_argument("--prompt-ids", required=True, help="JSON list of token ids")
    tr.add_argument("--out", required=True, help="output trace .jsonl")
    tr.add_argument("--dump-tensors", default=None, metavar="DIR",
                    help="also write every traced tensor to DIR/<trace name>.safetensors (names point.layer)")
    tr.add_argument("--device", default=None, help="fast engine: cpu | cuda")
    tr.add_argument("--dtype", dest="dtype_engine", choices=["float32", "bfloat16", "float16"], default=None,
                    help="fast engine: compute dtype")
    tr.add_argument("--case", default=None, help="case name for the trace header (default: from the model path)")
    tr.add_argument("--llama-dump", default=None, metavar="FILE",
                    help="convert a llama.cpp eval-callback dump (text or JSONL) instead of running an engine")
    tr.add_argument("--sum-scope", choices=["all", "printed"], default="all",
                    help="eval-callback text: its sum covers all elements (current llama.cpp) or only the printed "
                         "ones (eval-callback.cpp before common/debug.cpp)")
    tr.set_defaults(func=cmd_trace)

    df = sub.add_parser("diff", help="compare two traces and name the first diverging point")
    df.add_argument("a", help="trace under test (.jsonl)")
    df.add_argument("b", help="baseline trace (.jsonl); relative errors divide by its norms")
    df.add_argument("--tol", type=float, default=DEFAULT_TOL,
                    help=f"relative error bound: rel L2 with tensor dumps, else the checksum lower bound "
                         f"(default {DEFAULT_TOL:g})")
    df.add_argument("--min-cosine", type=float, default=None, help="also require this cosine (tensor dumps only)")
    df.add_argument("--skip", action="append", default=None, metavar="POINT",
                    help="leave this point out (repeatable), e.g. result_output when one side kept only the last row")
    df.add_argument("--json", default=None, help="also write the comparison as JSON here")
    df.set_defaults(func=cmd_diff)

    st = sub.add_parser("selftest", help="inject known faults into a copy of the fast path; check they are caught")
    st.add_argument("--case", action="append", default=None, help="only this built-in case (repeatable)")
    st.add_argument("--prompt", action="append", default=None,
                    help="only this prompt id of cases/prompts/synthetic.jsonl (repeatable; default: every prompt "
                         "longer than the sliding window)")
    st.add_argument("--out", default=None, help="parent folder of the run directory (default reports/)")
    st.add_argument("--quiet", action="store_true", help="no progress lines")
    st.set_defaults(func=cmd_selftest)


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
    pa.add_argument("--baseline", default=None,
                    help="earlier results.json (or --write-baseline file): exit 1 on a regression against it")
    pa.add_argument("--write-baseline", default=None, help="also write this run as a baseline to this file")
    pa.add_argument("--regression-factor", type=float, default=10.0,
                    help="a figure this many times worse than the baseline is a regression (default 10)")
    pa.set_defaults(func=cmd_parity)
    _add_trace_parsers(sub)

    from .bench_cli import add_parser as add_bench_parser

    add_bench_parser(sub)

    tk = sub.add_parser("tokenize", help="token ids of each line of a text file, to JSONL")
    tk.add_argument("--tokenizer", required=True, help=".gguf, tokenizer.json or tokenizer.model")
    tk.add_argument("--engine", default="ours", help="ours | hf | spm | transformers-gguf | llamacpp")
    tk.add_argument("--text-file", required=True, help="UTF-8 text, one text per line")
    tk.add_argument("--out", required=True, help='output JSONL: {"text", "ids"} per line')
    tk.add_argument("--escapes", action="store_true", help="decode \\n \\t \\uXXXX ... in the lines (corpus format)")
    tk.add_argument("--no-bos", action="store_true", help="no BOS in front")
    tk.add_argument("--special", choices=["auto", "parse", "text"], default="auto",
                    help="special-token markers in text: parse them, keep them as text, or auto (engine default)")
    tk.set_defaults(func=cmd_tokenize)

    tc = sub.add_parser("tokcheck", help="texts whose token ids differ between two tokenizer engines")
    tc.add_argument("--tokenizer", required=True, help=".gguf, tokenizer.json or tokenizer.model")
    tc.add_argument("--engine", default="ours", help="engine for --tokenizer (default ours)")
    tc.add_argument("--against", required=True,
                    help="an engine name (ours | hf | spm | transformers-gguf | llamacpp) or a second tokenizer file")
    tc.add_argument("--against-tokenizer", default=None, help="file for an --against engine (default: --tokenizer)")
    tc.add_argument("--against-engine", default=None, help="engine for an --against file (default by kind)")
    tc.add_argument("--corpus", default=None, help="corpus folder or file (default cases/tokenizer)")
    tc.add_argument("--special", choices=["auto", "parse", "text"], default="auto",
                    help="auto: parse special markers unless spm takes part (its own rule)")
    tc.add_argument("--max-examples", type=int, default=50, help="differing texts listed (all are counted)")
    tc.add_argument("--json", default=None, help="also write the result as JSON here")
    tc.set_defaults(func=cmd_tokcheck)
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
    except RuntimeError as e:
        # An engine's worker process died (llama.cpp aborted): one line, like bad input, never a traceback.
        llamacpp = sys.modules.get("harness.llamacpp")
        if llamacpp is None or not isinstance(e, llamacpp.EngineCrashed):
            raise
        print(f"g4h: error: {str(e).splitlines()[0] if str(e) else 'engine crashed'}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
