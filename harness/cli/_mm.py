"""The multimodal options of ``g4h logits``, ``trace`` and ``generate`` (``--image``, ``--audio``, ``--mmproj`` ...).

A prompt marks each image with ONE ``image_token_id`` and each audio clip with ONE ``audio_token_id``; the harness
preprocesses the media (the model's image processor and mel front end), expands each mark to begin, soft tokens,
end (as transformers' ``Gemma4Processor`` does) and runs a multimodal engine (:mod:`harness.engines.mm`) on the
expanded prompt, so logits and traces cover the expanded sequence.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.mm_model import MM_TOKEN_TYPES, MultimodalModel, MultimodalPrompt, prepare_prompt

from ..core.cases import MODELS_DIR
from ..core.engine_kinds import KIND
from ..core.mm_prompts import MM_MODELS_DIR
from ..engines.mm import MM_ENGINES, make_mm_engine, open_mm
from ._args import Count, InFile


def add_mm_args(p: argparse.ArgumentParser) -> None:
    """``--mmproj``, ``--image``, ``--audio``, ``--resample``, ``--mm-token-types``, ``--image-tokens``."""
    g = p.add_argument_group("multimodal input (engines: " + ", ".join(MM_ENGINES) + ")")
    g.add_argument("--mmproj", default=None, metavar="FILE", type=InFile(),
                   help="the mmproj GGUF (vision and/or audio towers) of a GGUF text --model")
    g.add_argument("--image", action="append", default=[], metavar="IMG", type=InFile(),
                   help="an image file, in the order of the prompt's image placeholders (repeatable)")
    g.add_argument("--audio", action="append", default=[], metavar="WAV", type=InFile(),
                   help="a WAV file, in the order of the prompt's audio placeholders (repeatable)")
    g.add_argument("--resample", action="store_true",
                   help="convert a WAV of another sample rate to the model's (16 kHz); without it that is an error")
    g.add_argument("--mm-token-types", choices=MM_TOKEN_TYPES, default="auto",
                   help="auto: pass mm_token_type_ids (the bidirectional vision mask applies when the config asks "
                        "for it); off: leave them out (causal everywhere)")
    g.add_argument("--image-tokens", type=Count(1, 1 << 20), default=None, metavar="N",
                   help="image token budget (70, 140, 280, 560 or 1120; default: the model's processor setting, "
                        "280 for a GGUF + mmproj)")


def mm_requested(args: argparse.Namespace) -> bool:
    """True when any multimodal option was given."""
    return bool(args.image or args.audio or args.mmproj)


def resolve_mm_model(model: str, engine: str, mmproj: str | None) -> tuple[Path, Path | None, int | None]:
    """``--model`` (and ``--mmproj``) as paths: a file or folder as given, or a built-in multimodal case
    (``cases/models/multimodal/<name>.toml``, built on first use) as its HF folder for an engine whose registry row
    reads no Gemma 4 GGUF (``transformers``) and its text GGUF with its mmproj for the other engines.

    Returns:
        ``(model, mmproj or None, image budget)``: the budget is the case's processor setting for a built-in case
        (so that its two forms take the same images), else None (the model's own).

    Raises:
        InputError: neither an existing path nor a multimodal case.
    """
    p = Path(model)
    if p.exists() and p.suffix != ".toml":
        return p, None if mmproj is None else Path(mmproj), None
    spec = p if p.suffix == ".toml" else MM_MODELS_DIR / f"{model}.toml"
    if spec.is_file():
        # the builder needs transformers and torch: imported only when a case is asked for
        built = importlib.import_module("gemma4_harness.harness.synth.mm_case").ensure_mm_built(spec)
        row = KIND.get(engine)
        if row is not None and not row.reads("gguf"):  # transformers: the HF folder (no Gemma 4 GGUF loader)
            return built.hf_dir, None, built.mspec.max_soft_tokens
        return built.gguf, Path(mmproj) if mmproj else built.mmproj, built.mspec.max_soft_tokens
    known = sorted(s.stem for s in MM_MODELS_DIR.glob("*.toml"))
    if (MODELS_DIR / f"{model}.toml").is_file():
        raise InputError(f"{model}: a text-only case; multimodal input needs a multimodal model (built-in: "
                         f"{', '.join(known)})")
    raise InputError(f"{model}: no such file or folder, and not a built-in multimodal case (known: {', '.join(known)})")


def open_mm_prompt(args: argparse.Namespace, ids: list[int]) -> tuple[MultimodalModel, MultimodalPrompt, Any]:
    """Load the model, prepare the prompt and build the engine from the command line.

    Raises:
        InputError: a bad model, mmproj, image or audio file; placeholders that do not match the media; an engine
            that takes no images or audio.
    """
    if args.engine not in MM_ENGINES:
        raise InputError(f"--engine {args.engine}: images and audio go to the {', '.join(MM_ENGINES)} engines")
    model, mmproj, budget = resolve_mm_model(args.model, args.engine, args.mmproj)
    mm = open_mm(model, mmproj)
    prompt = prepare_prompt(mm, ids, args.image, args.audio, resample=args.resample,
                            mm_token_types=args.mm_token_types,
                            max_soft_tokens=args.image_tokens if args.image_tokens is not None else budget)
    engine = make_mm_engine(args.engine, mm, device=getattr(args, "device", None),
                            dtype=getattr(args, "dtype_engine", None))
    return mm, prompt, engine
