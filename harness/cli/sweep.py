"""``g4h sweep``: every quantization of a model on every engine against one float64 base, on Ray (harness.sweep)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from gemma4_harness.reference.errors import InputError

from ..core.cases import PROMPTS
from ..core.engine_kinds import default_against
from ..core.paths import default_reports_dir
from ..engines import split_engines
from ..engines.base import TOP_N
from ..engines.llamacpp import tools as llama_tools
from ..inspect import inspect_model
from ..sweep.files import find_models
from ._args import DTYPES, Count, Device, InFile, ModelArg, Number, OutDir, check_out_dir

try:
    from ..sweep.run import SweepOptions, run_sweep
except ModuleNotFoundError as e:  # Ray is an optional dependency: without it, g4h sweep says how to get it
    if e.name != "ray":
        raise
    SweepOptions = run_sweep = None  # type: ignore[assignment,misc]

SWEEP_EXTRA = "pip install 'gemma4-harness[sweep]' (Ray)"
FLOAT_SUFFIXES = ("-F32", "-BF16", "-F16", "-f32", "-bf16", "-f16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``g4h sweep``."""
    p.add_argument("models", nargs="*", metavar="MODEL",
                   help="GGUF files, folders of GGUFs, HF model folders or glob patterns (quote them); files of the "
                        "same model (architecture and tensor shapes) form one group, measured against the float64 "
                        "reference on the group's highest-precision file")
    p.add_argument("--against", action="append", default=None, metavar="ENGINE[,ENGINE...]",
                   help="engines to sweep (repeatable, or a comma list): fast, llamacpp, reference, transformers, "
                        "cmd:'COMMAND ...'. Default: " + ",".join(default_against("gguf")))
    p.add_argument("--base", default=None, metavar="FILE", type=ModelArg(),
                   help="the file of its group the reference runs on (default: the highest precision: most bits per "
                        "weight, then F32 > F16 > BF16)")
    p.add_argument("--prompts", default=str(PROMPTS), metavar="FILE.jsonl", type=InFile(streams=True),
                   help='prompt set, {"prompt_ids": [...]} or {"text": "..."} a line, optional "id" (default: '
                        "cases/prompts/synthetic.jsonl; every prompt must fit every group's vocabulary and context, "
                        "one that does not is bad input naming its line)")
    p.add_argument("--max-new-tokens", type=Count(0, 1 << 16), default=8, metavar="N",
                   help="tokens of each greedy stream (default 8; 0: no greedy figures)")
    p.add_argument("--top-n", type=Count(1, 1 << 16), default=TOP_N, metavar="N",
                   help=f"vLLM's N for the greedy rule: log-probs kept per step (default {TOP_N})")
    q = p.add_argument_group("making the quantizations (llama.cpp's llama-quantize, built into the user cache)")
    q.add_argument("--quantize", default=None, metavar="TYPE[,TYPE...]",
                   help="first quantize each F32/BF16/F16 GGUF named to these llama-quantize types (Q8_0, Q6_K, "
                        "Q5_K_M, Q4_K_M, Q4_0, Q3_K_M, Q2_K, IQ4_XS ...) and sweep them too")
    q.add_argument("--quant-dir", default=None, metavar="DIR", type=OutDir(),
                   help="where the quantized files go (default: <out>/quants/; an existing file is reused)")
    q.add_argument("--imatrix", default=None, metavar="FILE", type=InFile(),
                   help="importance matrix for the --quantize types that need one (IQ2_XXS, IQ1_S, Q2_K_S ...)")
    q.add_argument("--imatrix-text", default=None, metavar="FILE", type=InFile(),
                   help="or make one with llama-imatrix over this text file (UTF-8)")
    r = p.add_argument_group("Ray")
    r.add_argument("--address", default=None, metavar="HOST:PORT",
                   help="an existing Ray cluster (default: $RAY_ADDRESS; without either, a local cluster is started "
                        "for the command and stopped with it)")
    r.add_argument("--local-nodes", type=Count(1, 64), default=1, metavar="N",
                   help="nodes of the local cluster (default 1; several share this machine's CPUs and memory)")
    r.add_argument("--cpus", type=Count(1, 1 << 16), default=None, metavar="N",
                   help="CPUs of the local cluster in all (default: every CPU of this process)")
    r.add_argument("--object-store-gb", type=Number(0.0, 1e6, lo_open=True), default=None, metavar="GB",
                   help="object store of each local node (default 1 GB, at most a fifth of its memory)")
    r.add_argument("--cpus-per-task", type=Count(1, 1 << 16), default=1, metavar="N",
                   help="CPUs each task declares and uses as threads (default 1)")
    r.add_argument("--task-timeout", type=Number(0.0, 1e9), default=7200.0, metavar="SECONDS",
                   help="a task running longer is cancelled and becomes a timeout row (default 7200; 0: none)")
    p.add_argument("--out", default=None, type=OutDir(), help="parent folder of the run directory (default reports/)")
    p.add_argument("--resume", default=None, metavar="RUN_DIR", type=InFile(folders=True),
                   help="continue an interrupted sweep: its models and options, only the rows it lacks")
    p.add_argument("--retry-failed", action="store_true", help="with --resume: also rerun the rows that failed")
    f = p.add_argument_group("fast engine")
    f.add_argument("--device", default=None, type=Device(), help="cpu | cuda[:N] (default: cuda when present)")
    f.add_argument("--dtype", dest="dtype_engine", choices=DTYPES, default=None, help="compute dtype (default float32)")
    f.add_argument("--weights", choices=("packed", "dequantized"), default=None,
                   help="keep quantized matrices packed (default for a quantized GGUF) or dequantize them at load")
    p.add_argument("--quiet", action="store_true", help="no progress display")


def _quant_name(src: Path, qtype: str) -> str:
    stem = src.stem
    for s in FLOAT_SUFFIXES:
        if stem.endswith(s):
            stem = stem[: -len(s)]
            break
    return f"{stem}-{qtype}.gguf"


def make_quants(models: list[str], types: list[str], where: Path, imatrix: str | None, imatrix_text: str | None,
                say=print) -> list[str]:
    """Quantize each float GGUF of ``models`` to ``types`` in ``where`` (reused when present); returns the new paths.

    Raises:
        InputError: no float GGUF among the models, an unknown type, an imatrix type without a matrix, a quantizer
            failure (one line).
    """
    canon = [llama_tools.canonical_type(t) for t in types]
    srcs = [p for p in find_models(models) if p.suffix == ".gguf" and _is_float(p)]
    if not srcs:
        raise InputError("--quantize: none of the models is an F32, BF16 or F16 GGUF to quantize")
    needs = [t for t in canon if t in llama_tools.IMATRIX_TYPES]
    if needs and not (imatrix or imatrix_text):
        raise InputError(f"--quantize {needs[0]}: this type needs an importance matrix: give --imatrix FILE or "
                         "--imatrix-text FILE")
    tools = llama_tools.ensure_tools()
    out = []
    for src in srcs:
        d = where / src.stem
        d.mkdir(parents=True, exist_ok=True)
        matrix = imatrix
        if needs and matrix is None:
            matrix = str(d / "imatrix.gguf")
            if not Path(matrix).is_file():
                say(f"llama-imatrix over {imatrix_text} for {src.name}")
                llama_tools.make_imatrix(src, imatrix_text, matrix, tools=tools)
        for t in canon:
            dst = d / _quant_name(src, t)
            if not (dst.is_file() and dst.stat().st_mtime >= src.stat().st_mtime):
                say(f"llama-quantize {src.name} -> {dst.name}")
                llama_tools.quantize(src, dst, t, imatrix=matrix if t in llama_tools.IMATRIX_TYPES else None,
                                     tools=tools)
            out.append(str(dst))
    return out


def _is_float(path: Path) -> bool:
    info = inspect_model(path)
    return info.file_type in ("F32", "F16", "BF16") or (info.file_type is None and all(
        t.type in ("F32", "F16", "BF16") for t in info.tensor_types))


def run(args: argparse.Namespace) -> int:
    """Run the sweep; print where its report is and the verdict; return the exit status."""
    if run_sweep is None:
        raise InputError(f"g4h sweep runs on Ray, which is not installed: {SWEEP_EXTRA}")
    check_out_dir(args.out)
    if args.resume and (args.models or args.quantize):
        raise InputError("--resume RUN_DIR continues a sweep with its own models: name no models and no --quantize")
    if args.max_new_tokens < 0 or args.top_n < 1 or args.cpus_per_task < 1:
        raise InputError("--max-new-tokens must be >= 0, --top-n and --cpus-per-task >= 1")
    if args.task_timeout < 0 or (args.object_store_gb is not None and not args.object_store_gb > 0) or \
            (args.cpus is not None and args.cpus < 1) or args.local_nodes < 1:
        raise InputError("--task-timeout must be >= 0 (0: none), --object-store-gb > 0, --cpus and --local-nodes "
                         ">= 1")
    address = args.address or os.environ.get("RAY_ADDRESS") or None
    if address and (args.local_nodes != 1 or args.cpus or args.object_store_gb):
        raise InputError("--local-nodes, --cpus and --object-store-gb shape a local cluster: not with --address or "
                         f"RAY_ADDRESS ({address}: an existing cluster has its own)")
    models = list(args.models)
    if args.quantize:
        where = Path(args.quant_dir) if args.quant_dir else Path(args.out or default_reports_dir()) / "quants"
        types = [t for t in args.quantize.split(",") if t.strip()]
        models += make_quants(models, types, where, args.imatrix, args.imatrix_text,
                              say=(lambda m: None) if args.quiet else (lambda m: print(f"g4h sweep: {m}")))
    against = ([n for text in args.against for n in split_engines(text)] if args.against
               else list(default_against("gguf")))  # a GGUF's default engines (the registry rows' default_for)
    eopts = {k: v for k, v in {"device": args.device, "dtype": args.dtype_engine, "weights": args.weights}.items()
             if v is not None}
    opts = SweepOptions(against=against, prompts=args.prompts, base=args.base, new_tokens=args.max_new_tokens,
                        top_n=args.top_n, cpus_per_task=args.cpus_per_task, engine_options=eopts,
                        task_timeout=args.task_timeout or None, address=address,
                        local_nodes=args.local_nodes, cpus=args.cpus, object_store_gb=args.object_store_gb,
                        retry_failed=args.retry_failed, quiet=args.quiet)
    data, status = run_sweep(models, opts, out=args.out, resume=args.resume)
    s = data["summary"]
    print(f"{s['rows']} rows: {s['ok']} ran, {s['failed']} failed, {s['declared_not_run']} out of an engine's declared "
          f"reach; {s['agreements']} engine pairs compared, {s['disagreements']} disagree; {data['wall_s']} s")
    print(f"report: {data['run_dir']}/report.md")
    print(f"{data['verdict']} (exit {status})")
    return status
