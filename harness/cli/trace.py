"""``g4h trace``: a checksum trace of one prompt (JSONL), optionally with a tensor dump; or a llama.cpp
eval-callback dump converted into one (format: ``docs/trace-format.md``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gemma4_harness.reference.errors import InputError

from ..core.prompts import read_prompt_ids
from ..core.workers import temp_folder
from ..engines import make_engine
from ..traces.format import TraceWriter, load_dump, read_trace, write_trace
from ..traces.llama_dump import import_llama_dump
from ._args import InFile, OutDir, OutFile, add_model_args, check_out_file, out_dtype, resolve_model
from ._mm import add_mm_args, mm_requested, open_mm_prompt


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``g4h trace``."""
    add_model_args(p, model_required=False)
    p.add_argument("--prompt-ids", required=True, type=InFile(streams=True), help="JSON list of token ids")
    p.add_argument("--out", required=True, type=OutFile(), help="output trace .jsonl")
    p.add_argument("--dump-tensors", default=None, metavar="DIR", type=OutDir(),
                   help="also write every traced tensor to DIR/<trace name>.safetensors (names point.layer)")
    p.add_argument("--case", default=None, help="case name for the trace header (default: from the model path)")
    p.add_argument("--llama-dump", default=None, metavar="FILE", type=InFile(streams=True),
                   help="convert a llama.cpp eval-callback dump (text or JSONL) instead of running an engine")
    p.add_argument("--sum-scope", choices=["all", "printed"], default="all",
                   help="eval-callback text: its sum covers all elements (current llama.cpp) or only the printed "
                        "ones (eval-callback.cpp before common/debug.cpp)")
    add_mm_args(p)


def _case_name(model: str) -> str:
    p = Path(model)
    return p.parent.name if p.name == "hf" else p.stem if p.suffix == ".gguf" else p.name


def trace_command(model: str | None, engine: str, prompt_ids_file: str, out: str, dump_dir: str | None = None,
                  device: str | None = None, dtype: str | None = None, case: str | None = None,
                  llama_dump: str | None = None, sum_scope: str = "all", weights: str | None = None,
                  cache_gb: float | None = None, layers: int | None = None) -> Path:
    """``g4h trace``: run ``engine`` on the prompt with a :class:`TraceWriter` and write the trace; or, with
    ``llama_dump``, convert that dump (:func:`import_llama_dump`) instead of running an engine.

    Returns:
        the trace path.

    Raises:
        InputError: bad model, engine, prompt file or dump; an output that cannot be written.
    """
    check_out_file(out)
    ids = read_prompt_ids(prompt_ids_file)
    if llama_dump is not None:
        tr = import_llama_dump(llama_dump, ids, case=case, model=model, sum_scope=sum_scope)
        if dump_dir is not None and not tr.tensors:
            raise InputError(f"{llama_dump}: --dump-tensors needs full tensor data (a JSONL dump with \"data\")")
        return write_trace(out, tr.header, tr.records, tr.tensors if dump_dir else None, dump_dir)
    if model is None:
        raise InputError("g4h trace: --model is required (or --llama-dump to import a llama.cpp dump)")
    eng = make_engine(engine, resolve_model(model, engine), device=device, dtype=dtype, weights=weights,
                      cache_gb=cache_gb, layers=layers)
    if hasattr(eng, "trace_file"):  # an engine that writes its own trace file (cmd:, docs/engine-protocol.md)
        with temp_folder("g4h-trace-") as tmp:
            dump = Path(tmp) / "tensors" if dump_dir else None
            tr = read_trace(eng.trace_file(ids, Path(tmp) / "trace.jsonl", dump))
            eng.close()
            if tr.prompt_ids != ids:
                raise InputError(f"{eng.name}: its trace holds another prompt ({len(tr.prompt_ids)} ids, "
                                 f"expected {len(ids)})")
            tensors = load_dump(tr) if dump_dir is not None and tr.header.get("tensors") else None
            if dump_dir is not None and tensors is None:
                raise InputError(f"{eng.name}: --dump-tensors: the engine wrote no tensors with its trace")
            return write_trace(out, tr.header, tr.records, tensors, dump_dir if tensors is not None else None)
    act_dtype = out_dtype(engine)
    dev = getattr(getattr(eng, "model", None), "device", None)
    writer = TraceWriter(getattr(eng, "name", engine), ids, case=case or _case_name(model), model=str(model),
                         dtype=act_dtype, device=None if dev is None else str(dev),
                         keep_tensors=dump_dir is not None,
                         extra={"weights_dtype": dtype} if dtype else None)
    eng.logits(ids, trace=writer)
    return writer.write(out, dump_dir)


def mm_trace_command(args: argparse.Namespace) -> Path:
    """``g4h trace`` with images or audio: the encoders' trace points (``v<i>.<name>`` / ``a<j>.<name>``, llama.cpp's
    clip callback names) then the decoder's, over the expanded prompt (the header's ``prompt_ids``).

    Raises:
        InputError: see :func:`harness.cli._mm.open_mm_prompt`; an output that cannot be written.
    """
    check_out_file(args.out)
    if args.llama_dump is not None or args.model is None:
        raise InputError("g4h trace: images and audio need --model (a llama.cpp dump cannot be combined with them)")
    ids = read_prompt_ids(args.prompt_ids)
    _, prompt, eng = open_mm_prompt(args, ids)
    writer = TraceWriter(getattr(eng, "name", args.engine), prompt.ids, case=args.case or _case_name(args.model),
                         model=str(args.model), dtype=out_dtype(args.engine),
                         keep_tensors=args.dump_tensors is not None,
                         extra={"mm_items": [{"kind": it.kind, "source": it.source, "soft_tokens": it.n_soft}
                                             for it in prompt.items],
                                "mm_token_types": args.mm_token_types})
    eng.logits(prompt, trace=writer)
    return writer.write(args.out, args.dump_tensors)


def run(args: argparse.Namespace) -> int:
    """Write the trace; exit 0 (2 on bad input, from the caller)."""
    if mm_requested(args):
        print(f"{mm_trace_command(args)}: trace written", file=sys.stderr)
        return 0
    path = trace_command(args.model, args.engine, args.prompt_ids, args.out, dump_dir=args.dump_tensors,
                         device=args.device, dtype=args.dtype_engine, case=args.case, llama_dump=args.llama_dump,
                         sum_scope=args.sum_scope, weights=args.weights, cache_gb=args.ref_cache_gb,
                         layers=args.layers)
    print(f"{path}: trace written", file=sys.stderr)
    return 0
