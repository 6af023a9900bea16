"""Which engine settings can run an inspected file, why not, and the differences each will show.

Every fact read here is its engine's row in the registry (:data:`harness.core.engine_kinds.KINDS`; the plain
kinds, those that read a model file themselves): the file forms it reads (``forms``; a GGUF of some
architectures only: ``gguf_archs``, transformers has no Gemma 4 GGUF loader), its dtypes and GGUF weight modes
(``dtypes``, ``weights``: the fast engine's settings), the GGUF tensor types it decodes (``gguf_types``), and the
checks of a file beyond those (``file_check``: llama.cpp's, :mod:`harness.engines.llamacpp.support`).
"""

from __future__ import annotations

import importlib
from typing import Callable

from gemma4_harness.reference.config import ModelConfig

from ..core.engine_kinds import EngineKind, plain_kinds
from ..engines.llamacpp.support import LLAMACPP_TYPE_IDS, llamacpp_donors
from .model import UNUSABLE, EngineRow, Inspection

__all__ = ["LLAMACPP_TYPE_IDS", "engine_rows", "llamacpp_donors"]

FORM_WORDS = {"gguf": "a GGUF file", "hf": "an HF model folder"}


def _settings(k: EngineKind, gguf_file: bool) -> list[EngineRow]:
    """One row per setting of ``k``: each dtype, and on a GGUF each weight mode."""
    modes = k.weights if gguf_file and k.weights else (None,)
    return [EngineRow(k.name, d, w, True) for d in k.dtypes or ("stored",) for w in modes]


def _why_not(k: EngineKind, info: Inspection) -> str | None:
    """Why ``k`` cannot read this file by its row's facts (form, architecture, tensor types), or None."""
    if info.format not in k.forms:
        return f"{k.said} needs {' or '.join(FORM_WORDS[f] for f in k.forms)}"
    if info.format == "gguf" and k.gguf_archs is not None and info.architecture not in k.gguf_archs:
        return (f"{k.said} needs {FORM_WORDS['hf']} for a {info.architecture} model (it reads the GGUF of "
                f"{', '.join(k.gguf_archs)} only)")
    bad = [t for t in info.tensor_types if info.format == "gguf" and k.gguf_types is not None
           and t.type not in k.gguf_types]
    if bad:
        return (f"{bad[0].count} tensors of type {bad[0].type}: {k.said} decodes {', '.join(sorted(k.gguf_types))} "
                "only")
    return None


def _file_check(k: EngineKind) -> Callable[..., tuple[bool, str | None, list[str]]] | None:
    if k.file_check is None:
        return None
    module, _, name = k.file_check.partition(":")
    return getattr(importlib.import_module(module), name)


def engine_rows(info: Inspection, cfg: ModelConfig | None) -> list[EngineRow]:
    """One row per engine setting: whether it can run the file, why not, and the differences it will show.

    Args:
        info: the inspection so far (format, tensor types, problems).
        cfg: the model config (None when it could not be built).

    Returns:
        per plain engine kind, in the registry's order: one row per dtype (and per weight mode on a GGUF).
    """
    gguf_file = info.format == "gguf"
    kinds = plain_kinds()
    rows = {k.name: _settings(k, gguf_file) for k in kinds}
    bad = next((p for p in info.problems if p.severity == UNUSABLE), None)
    for k in kinds:
        why = f"the file is unusable ({bad.code}: {bad.where})" if bad is not None else _why_not(k, info)
        check = _file_check(k) if why is None else None
        can, notes = why is None, []
        if check is not None:
            can, why, notes = check(info, cfg)
        for r in rows[k.name]:
            r.can_run, r.reason, r.notes = can, why, list(notes)
    return [r for k in kinds for r in rows[k.name]]
