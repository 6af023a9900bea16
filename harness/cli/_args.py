"""Argument groups several ``g4h`` sub-commands share, and the model resolver behind ``--model``."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from reference.errors import InputError

from .. import synth
from ..core.cases import DRAFTER_SUFFIX, MODELS_DIR, builtin_drafter_specs, builtin_specs
from ..engines import ENGINES
from ..synth.drafter import ensure_drafter_built

DTYPES = ("float32", "bfloat16", "float16")


def add_model_args(p: argparse.ArgumentParser, default_engine: str = "reference", model_required: bool = True) -> None:
    """``--model``, ``--engine``, ``--device``, ``--dtype`` and ``--weights`` (the engine options)."""
    p.add_argument("--model", required=model_required, default=None,
                   help=".gguf file, HF model folder, or a case: a built-in name (e2b, 26b-a4b ...) or a spec .toml "
                        "(built and cached on first use)")
    p.add_argument("--engine", default=default_engine,
                   help=" | ".join([*ENGINES, "cmd:'COMMAND ...' (docs/engine-protocol.md)", "openai:URL (a server)"]))
    p.add_argument("--device", default=None, help="fast engine: cpu | cuda[:N] (default: cuda when present)")
    p.add_argument("--dtype", dest="dtype_engine", choices=DTYPES, default=None,
                   help="fast engine: compute dtype (default float32)")
    p.add_argument("--weights", choices=("packed", "dequantized"), default=None,
                   help="fast engine, GGUF input: keep quantized matrices packed and dequantize on the fly (on the "
                        "CPU: views of the mapped file through the packed kernels), or dequantize them once at load "
                        "(default: packed for a quantized GGUF)")
    add_scale_args(p)
    add_server_args(p)


def add_server_args(p: argparse.ArgumentParser) -> None:
    """``--server-model`` and ``--server-timeout``: the options of an ``openai:URL`` engine."""
    p.add_argument("--server-model", default=None, metavar="NAME",
                   help="openai:URL engine: the model name to send (default: the first of the server's /v1/models)")
    p.add_argument("--server-timeout", type=float, default=None, metavar="SECONDS",
                   help="openai:URL engine: seconds allowed per request (default 120)")
    p.add_argument("--declare", action="append", default=None, metavar="KEY=VALUE",
                   help="openai:URL engine: what the server computes, over its dialect's defaults (llama-server: "
                        "float32, KV cache f16, flash attention; llama-cpp-python: float32, KV cache f16; vLLM: "
                        "bfloat16): dtype=float32|float64|bfloat16|float16, kv_cache=f32|f16|bf16, "
                        "approximations=NAME,...|none (gelu_fp16_table, quantized_activations, attn_fp16_operands, "
                        "flash_attn_fp16); repeatable. The gates follow it (docs/engine-protocol.md, \"Numerics\")")


def add_scale_args(p: argparse.ArgumentParser, layers: bool = True) -> None:
    """``--ref-cache-gb`` and ``--layers``: how much of a real-size model an engine holds."""
    p.add_argument("--ref-cache-gb", dest="ref_cache_gb", type=float, default=None, metavar="GB",
                   help="reference engine: GB of dequantized float64 weights kept between forwards (default 2; "
                        "0 streams every weight each time)")
    if layers:
        p.add_argument("--layers", type=int, default=None, metavar="N",
                       help="keep only the first N layers of the model (reference, fast, transformers), with a "
                            "valid KV-sharing layout")


def engine_options(args: argparse.Namespace) -> dict:
    """The engine keywords from :func:`add_model_args`' options (None = the engine's default)."""
    return {"device": getattr(args, "device", None), "dtype": getattr(args, "dtype_engine", None),
            "batched": getattr(args, "batched", None), "weights": getattr(args, "weights", None),
            "server_model": getattr(args, "server_model", None),
            "server_timeout": getattr(args, "server_timeout", None),
            "declare": getattr(args, "declare", None),
            "cache_gb": getattr(args, "ref_cache_gb", None), "layers": getattr(args, "layers", None)}


def check_out_file(path: str) -> None:
    """Refuse an output file that cannot be written, before any work starts.

    Raises:
        InputError: ``path`` is a folder, its folder is a file, or the folder cannot be created or written.
    """
    p = Path(path)
    if p.is_dir():
        raise InputError(f"--out {path}: is a folder (expected a file path)")
    parent = p.parent if str(p.parent) else Path(".")
    existing = next((a for a in [parent, *parent.parents] if a.exists()), None)
    if existing is not None and not existing.is_dir():
        raise InputError(f"--out {path}: {existing} is a file, not a folder")
    if existing is not None and not os.access(existing, os.W_OK):
        raise InputError(f"--out {path}: {existing} is not writable")


def check_out_dir(path: str | None) -> None:
    """Refuse an output folder (the parent of a run directory) that cannot be used, before any work starts.

    Raises:
        InputError: ``path`` exists and is not a folder, or it cannot be created or written.
    """
    if path is None:
        return
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise InputError(f"--out {path}: exists and is not a folder")
    existing = next((a for a in [p, *p.parents] if a.exists()), None)
    if existing is not None and not existing.is_dir():
        raise InputError(f"--out {path}: {existing} is a file, not a folder")
    if existing is not None and not os.access(existing, os.W_OK):
        raise InputError(f"--out {path}: {existing} is not writable")


def resolve_model(model: str, engine: str) -> Path:
    """``--model`` as a path the engine can read.

    A file or folder is taken as it is. A case (a built-in name such as ``e2b``, or a ``.toml`` spec) is
    built and cached (:func:`harness.synth.ensure_built`), then given as the HF folder to ``transformers``
    and as the F32 GGUF to every other engine.

    Raises:
        InputError: neither an existing path nor a known case.
    """
    p = Path(model)
    if p.exists() and p.suffix != ".toml":
        return p
    if p.stem.endswith(DRAFTER_SUFFIX):
        raise InputError(f"{model}: a drafter (MTP assistant) spec; give it as --draft-model beside its target")
    if p.suffix == ".toml" or (MODELS_DIR / f"{model}.toml").is_file():
        built = synth.ensure_built(p if p.suffix == ".toml" else MODELS_DIR / f"{model}.toml")
        return built.hf_dir if engine == "transformers" else built.gguf["F32"]
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
    p = Path(draft)
    if p.exists() and p.suffix != ".toml":
        return str(p)
    spec = p if p.suffix == ".toml" else MODELS_DIR / f"{draft}.toml"
    if spec.is_file():
        return str(ensure_drafter_built(spec).hf_dir)
    known = ", ".join(s.stem for s in builtin_drafter_specs())
    raise InputError(f"--draft-model {draft}: no such file or folder, not a drafter case ({known}), "
                     "and not oracle, random or partial:J")
