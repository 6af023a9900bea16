"""Argument groups several ``g4h`` sub-commands share, the model resolver behind ``--model``, and the one place
where command-line values are checked.

Every option that takes a number, a device or a path has a ``type=`` from here (an :class:`ArgType`): argparse
calls it on the text as it parses, so a bad value ends the command before any work with one line naming the
option, the value and what was expected (``g4h logits: error: argument --layers: expected an integer in
[1, 512], got 0``). Each type says what it accepts (``kind``, ``lo``, ``hi`` ...), which is how
``tests/test_arg_probe.py`` generates bad values for every option of every command without a list to keep.

===============  ===========================================================================================
type             accepts
===============  ===========================================================================================
:class:`Count`   an integer in ``[lo, hi]`` (``hi`` at most 2**63 - 1: every count fits an int64)
:class:`Number`  a finite float in ``[lo, hi]`` (or ``(lo, hi]``): never NaN or Inf
:class:`Device`  ``cpu``, ``cuda`` or ``cuda:N`` of a device this machine has
:class:`InFile`  a file to read (regular; with ``streams``, a pipe or character device read with a bound and a
                 timeout, :mod:`reference.files`; with ``folders``, a folder)
:class:`ModelArg`  an existing file or folder (as :class:`InFile`), or a name resolved later (a case)
:class:`OutFile` where an output file can go (:func:`harness.core.io.check_output`: a regular file, a symlink
                 to one, a character device or a FIFO; never a folder, block device or socket)
:class:`OutDir`  a folder for run directories or caches (existing or creatable, writable)
===============  ===========================================================================================
"""

from __future__ import annotations

import argparse
import math
import os
import stat
from pathlib import Path

from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.files import is_stream, kind_of

from .. import synth
from ..core.cases import DRAFTER_SUFFIX, MODELS_DIR, builtin_drafter_specs, builtin_specs
from ..core.io import OutputError, check_output
from ..core.engine_kinds import KIND, KINDS, ORACLE
from ..engines import engine_kind
from ..synth.drafter import ensure_drafter_built
from ..tokenizer.prompt_ids import model_tokenizer

INT64_MAX = 2**63 - 1
"""The largest count any option takes: it goes to numpy and torch as an int64."""


class ArgType:
    """An argparse ``type=``: converts one option value and checks it; ``kind`` says what it accepts."""

    kind = "text"

    def __call__(self, text: str):
        return text

    def __repr__(self) -> str:  # argparse names the type in "invalid <type> value" (never reached: we raise ours)
        return type(self).__name__.lower()


def _bad(msg: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(msg)


class Count(ArgType):
    """An integer in ``[lo, hi]`` (``hi`` None: up to :data:`INT64_MAX`)."""

    kind = "int"

    def __init__(self, lo: int | None = 0, hi: int | None = None):
        self.lo, self.hi = lo, INT64_MAX if hi is None else hi

    def expected(self) -> str:
        if self.lo is None:
            return f"an integer <= {self.hi}"
        return f"an integer >= {self.lo}" if self.hi == INT64_MAX else f"an integer in [{self.lo}, {self.hi}]"

    def __call__(self, text: str) -> int:
        try:
            value = int(str(text).strip(), 10)
        except ValueError:
            raise _bad(f"expected {self.expected()}, got {text!r}") from None
        if (self.lo is not None and value < self.lo) or value > self.hi:
            raise _bad(f"expected {self.expected()}, got {value}")
        return value


class Number(ArgType):
    """A finite float in ``[lo, hi]`` (``lo_open``: ``(lo, hi]``); NaN and Inf are refused."""

    kind = "float"

    def __init__(self, lo: float | None = None, hi: float | None = None, lo_open: bool = False):
        self.lo, self.hi, self.lo_open = lo, hi, lo_open

    def expected(self) -> str:
        lo = "" if self.lo is None else f"{'>' if self.lo_open else '>='} {self.lo:g}"
        hi = "" if self.hi is None else f"<= {self.hi:g}"
        return "a finite number" + (f" {lo}" if lo else "") + (" and" if lo and hi else "") + (f" {hi}" if hi else "")

    def __call__(self, text: str) -> float:
        try:
            value = float(str(text).strip())
        except ValueError:
            raise _bad(f"expected {self.expected()}, got {text!r}") from None
        if not math.isfinite(value):
            raise _bad(f"expected {self.expected()}, got {text!r}")
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            raise _bad(f"expected {self.expected()}, got {text}")
        if self.hi is not None and value > self.hi:
            raise _bad(f"expected {self.expected()}, got {text}")
        return value


class Device(ArgType):
    """``cpu``, ``cuda`` or ``cuda:N``, checked against the devices this machine has (torch is imported only for a
    CUDA name)."""

    kind = "device"

    def __call__(self, text: str) -> str:
        name = str(text).strip()
        head, sep, index = name.partition(":")
        if head == "cpu" and not sep:
            return name
        if head != "cuda" or (sep and not index.isdigit()):
            raise _bad(f"expected cpu, cuda or cuda:N, got {text!r}")
        import torch  # only for a CUDA name

        if not torch.cuda.is_available():
            raise _bad(f"--device {name}: CUDA is not available here (torch {torch.__version__}); use cpu")
        if sep and int(index) >= torch.cuda.device_count():
            raise _bad(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s), cuda:0 .. "
                       f"cuda:{torch.cuda.device_count() - 1}")
        return name


def _kind_problem(path: str, streams: bool, folders: bool) -> str | None:
    """Why ``path`` cannot be read as this input (None: it can, or it does not exist)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{path}: cannot read: {e.strerror or e}"
    if stat.S_ISREG(st.st_mode) or (folders and stat.S_ISDIR(st.st_mode)) or (streams and is_stream(st.st_mode)):
        return None
    want = "a regular file" + (" or a folder" if folders else "") + (", a pipe or a character device" if streams
                                                                      else "")
    return f"{path}: is a {kind_of(st.st_mode)}, expected {want}"


class InFile(ArgType):
    """An input path: it must exist and be a regular file; ``streams``: or a pipe or character device (read with a
    bound and a timeout); ``folders``: or a folder. The file is read later through :mod:`reference.files`."""

    kind = "in_file"

    def __init__(self, streams: bool = False, folders: bool = False, what: str = ""):
        self.streams, self.folders, self.what = streams, folders, what

    def __call__(self, text: str) -> str:
        path = str(text)
        if not path:
            raise _bad("expected a file path, got ''")
        problem = _kind_problem(path, self.streams, self.folders)
        if problem:
            raise _bad(problem)
        if not os.path.lexists(path):
            what = f"{self.what} " if self.what else ""
            raise _bad(f"{path}: no such {what}file" + (" or folder" if self.folders else ""))
        return path


class ModelArg(InFile):
    """``--model`` / ``--draft-model``: an existing file or folder (never a FIFO or a device), or a name resolved
    later (a built-in case, a spec ``.toml``, ``oracle`` ...)."""

    kind = "model"

    def __init__(self) -> None:
        super().__init__(streams=False, folders=True)

    def __call__(self, text: str) -> str:
        path = str(text)
        if not path:
            raise _bad("expected a model file, folder or case name, got ''")
        problem = _kind_problem(path, False, True)
        if problem:
            raise _bad(problem)
        return path


class OutFile(ArgType):
    """Where an output file goes (:func:`harness.core.io.check_output`); ``regular``: a regular file only (a file
    written by a library through its own name, such as a GGUF)."""

    kind = "out_file"

    def __init__(self, regular: bool = False):
        self.regular = regular

    def __call__(self, text: str) -> str:
        path = str(text)
        if not path:
            raise _bad("expected a file path, got ''")
        try:
            check_output(path, what="")
        except OutputError as e:
            raise _bad(str(e).strip()) from None
        if self.regular and os.path.exists(path) and not os.path.isfile(path):
            raise _bad(f"{path}: is a {kind_of(os.stat(path).st_mode)}; this output is written to a regular file")
        return path


class OutDir(ArgType):
    """A folder for outputs: existing, or creatable under an existing writable folder."""

    kind = "out_dir"

    def __call__(self, text: str) -> str:
        path = str(text)
        if not path:
            raise _bad("expected a folder path, got ''")
        try:
            check_out_dir(path, what="")
        except InputError as e:
            raise _bad(str(e).strip()) from None
        return path


DTYPES = next(k.dtypes for k in KINDS if "dtype" in k.options)
"""``--dtype``: the compute dtypes of the engine that takes that option (the fast engine's registry row)."""


def add_model_args(p: argparse.ArgumentParser, default_engine: str = ORACLE, model_required: bool = True) -> None:
    """``--model``, ``--engine``, ``--device``, ``--dtype`` and ``--weights`` (the engine options)."""
    p.add_argument("--model", required=model_required, default=None, type=ModelArg(),
                   help=".gguf file, HF model folder, or a case: a built-in name (e2b, 26b-a4b ...) or a spec .toml "
                        "(built and cached on first use)")
    p.add_argument("--engine", default=default_engine,
                   help=" | ".join(k.usage for k in KINDS))
    p.add_argument("--device", default=None, type=Device(),
                   help="fast engine: cpu | cuda[:N] (default: cuda when present)")
    p.add_argument("--dtype", dest="dtype_engine", choices=DTYPES, default=None,
                   help="fast engine: compute dtype (default float32)")
    p.add_argument("--weights", choices=("packed", "dequantized"), default=None,
                   help="fast engine, GGUF input: keep quantized matrices packed and dequantize on the fly (on the "
                        "CPU: views of the mapped file through the packed kernels), or dequantize them once at load "
                        "(default: packed for a quantized GGUF)")
    add_compute_arg(p)
    add_scale_args(p)
    add_engine_timeout_arg(p)
    add_server_args(p)


COMPUTE_HELP = ("fast engine: exact (the default: fp32 products of the exact weights) or q8 (llama.cpp's CPU "
                "arithmetic: the input of every product with a quantized or 16-bit weight rounded to its dot-product "
                "type, Q8_0/Q4_0/Q5_0 products as int8 integer dot products; judged against the emulating reference, "
                "docs/quantized-activations.md)")


def add_compute_arg(p) -> None:
    """``--compute exact|q8``: the fast engine's arithmetic (:mod:`fast.q8_compute`)."""
    p.add_argument("--compute", choices=("exact", "q8"), default=None, help=COMPUTE_HELP)


def add_engine_timeout_arg(p: argparse.ArgumentParser) -> None:
    """``--engine-timeout``: how long a llama.cpp worker, or a ``cmd:`` engine's reply, may take."""
    p.add_argument("--engine-timeout", dest="engine_timeout", type=Number(0, 7 * 86400, lo_open=True), default=None,
                   metavar="SECONDS",
                   help="llamacpp engine: seconds one worker may run (default: what its work allows: 600 s, plus one "
                        "read of the file at 1 GB/s per prefill or decode step, plus 2 operations per parameter per "
                        "token at 5 GFLOP/s); cmd: engine: seconds allowed per reply (default $G4H_CMD_TIMEOUT or "
                        "600)")


def add_server_args(p: argparse.ArgumentParser) -> None:
    """``--server-model`` and ``--server-timeout``: the options of an ``openai:URL`` engine."""
    p.add_argument("--server-model", default=None, metavar="NAME",
                   help="openai:URL engine: the model name to send (default: the first of the server's /v1/models)")
    p.add_argument("--server-timeout", type=Number(0, 7 * 86400, lo_open=True), default=None, metavar="SECONDS",
                   help="openai:URL engine: seconds allowed per request (default 120)")
    p.add_argument("--dialect", default=None, choices=("llama-server", "llama-cpp-python", "vllm", "openai"),
                   help="openai:URL engine: which server it is, instead of asking it (openai: any server of OpenAI's "
                        "/v1/completions, judged on text; docs/server-dialects.md)")
    p.add_argument("--declare", action="append", default=None, metavar="KEY=VALUE",
                   help="openai:URL engine: what the server computes, over its dialect's defaults (llama-server: "
                        "float32, KV cache f16, flash attention; llama-cpp-python: float32, KV cache f16; vLLM: "
                        "bfloat16): dtype=float32|float64|bfloat16|float16, kv_cache=f32|f16|bf16, "
                        "approximations=NAME,...|none (gelu_fp16_table, quantized_activations, attn_fp16_operands, "
                        "flash_attn_fp16), vec_dot_types=llama.cpp|none (whose dot-product types the quantized "
                        "activations round to; none: not known, as on a GPU backend, judged by the 8-bit yardstick); "
                        "repeatable. The gates follow it (docs/engine-protocol.md, \"Numerics\")")


def add_scale_args(p: argparse.ArgumentParser, layers: bool = True) -> None:
    """``--ref-cache-gb`` and ``--layers``: how much of a real-size model an engine holds."""
    p.add_argument("--ref-cache-gb", dest="ref_cache_gb", type=Number(0, 1e6), default=None, metavar="GB",
                   help="reference engine: GB of dequantized float64 weights kept between forwards (default 2; "
                        "0 streams every weight each time)")
    if layers:
        p.add_argument("--layers", type=Count(1, 512), default=None, metavar="N",
                       help="keep only the first N layers of the model (reference, fast, transformers), with a "
                            "valid KV-sharing layout")


def out_dtype(engine: str) -> str:
    """The dtype an engine's logits and activations are written in: ``float64`` for an engine whose registry row
    computes in float64 (the reference), else ``float32``."""
    row = KIND.get(engine_kind(engine))
    return "float64" if row is not None and row.dtypes[:1] == ("float64",) else "float32"


def engine_options(args: argparse.Namespace) -> dict:
    """The engine keywords from :func:`add_model_args`' options (None = the engine's default), and our tokenizer of
    the model (``local_tokenizer``: the text prompts of a server's generic dialect)."""
    return {"device": getattr(args, "device", None), "dtype": getattr(args, "dtype_engine", None),
            "batched": getattr(args, "batched", None), "weights": getattr(args, "weights", None),
            "compute": getattr(args, "compute", None),
            "server_model": getattr(args, "server_model", None),
            "server_timeout": getattr(args, "server_timeout", None),
            "timeout": getattr(args, "engine_timeout", None),
            "declare": getattr(args, "declare", None), "dialect": getattr(args, "dialect", None),
            "cache_gb": getattr(args, "ref_cache_gb", None), "layers": getattr(args, "layers", None),
            "local_tokenizer": model_tokenizer}


def check_out_file(path: str, what: str = "--out") -> None:
    """Refuse an output file that cannot be written, before any work starts (:func:`harness.core.io.check_output`).

    Raises:
        InputError: ``path`` is a folder, a block device or a socket, its folder is a file, or the folder cannot be
            created or written.
    """
    check_output(path, what)


def check_out_dir(path: str | None, what: str = "--out") -> None:
    """Refuse an output folder (the parent of a run directory, a cache) that cannot be used, before any work starts.

    Raises:
        InputError: ``path`` exists and is not a folder, or it cannot be created or written.
    """
    if path is None:
        return
    label = f"{what} {path}".strip()
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise InputError(f"{label}: exists and is not a folder")
    existing = next((a for a in [p, *p.parents] if a.exists()), None)
    if existing is not None and not existing.is_dir():
        raise InputError(f"{label}: {existing} is a file, not a folder")
    if existing is not None and not os.access(existing, os.W_OK):
        raise InputError(f"{label}: {existing} is not writable")


def resolve_model(model: str, engine: str) -> Path:
    """``--model`` as a path the engine can read.

    A file or folder is taken as it is. A case (a built-in name such as ``e2b``, or a ``.toml`` spec) is
    built and cached (:func:`harness.synth.ensure_built`), then given as the HF folder to ``transformers``
    and as the F32 GGUF to every other engine.

    Raises:
        InputError: neither an existing path nor a known case.
    """
    p = Path(model)
    problem = _kind_problem(model, False, True)
    if problem:
        raise InputError(f"--model {problem}")
    if p.exists() and p.suffix != ".toml":
        return p
    if p.stem.endswith(DRAFTER_SUFFIX):
        raise InputError(f"{model}: a drafter (MTP assistant) spec; give it as --draft-model beside its target")
    if p.suffix == ".toml" or (MODELS_DIR / f"{model}.toml").is_file():
        built = synth.ensure_built(p if p.suffix == ".toml" else MODELS_DIR / f"{model}.toml")
        row = KIND.get(engine_kind(engine))
        return built.gguf["F32"] if row is None else row.built_file(built.gguf["F32"], built.hf_dir)
    raise InputError(f"{model}: no such file or folder, and not a built-in case "
                     f"(known: {', '.join(s.stem for s in builtin_specs())})")


SPECIAL_DRAFTERS = ("oracle", "random")
"""``--draft-model`` names of the drafters that exercise the verifier (besides ``partial:J``)."""


def resolve_draft_model(draft: str) -> str:
    """``--draft-model`` as what :meth:`harness.engines.fast.FastEngine.proposer` takes.

    ``oracle``, ``random`` and ``partial:J`` pass as they are; an existing file or folder too; a drafter case (a
    built-in name such as ``e2b-assistant``, or a drafter spec ``.toml``) is built and cached, then given as its
    HF folder (which keeps the centroid head; its GGUF has none).

    Raises:
        InputError: neither a special name, an existing path, nor a drafter case.
    """
    if draft in SPECIAL_DRAFTERS or draft.startswith("partial:"):
        return draft
    problem = _kind_problem(draft, False, True)
    if problem:
        raise InputError(f"--draft-model {problem}")
    p = Path(draft)
    if p.exists() and p.suffix != ".toml":
        return str(p)
    spec = p if p.suffix == ".toml" else MODELS_DIR / f"{draft}.toml"
    if spec.is_file():
        return str(ensure_drafter_built(spec).hf_dir)
    known = ", ".join(s.stem for s in builtin_drafter_specs())
    raise InputError(f"--draft-model {draft}: no such file or folder, not a drafter case ({known}), "
                     "and not oracle, random or partial:J")
