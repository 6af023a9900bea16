"""Engines: everything that can run Gemma 4, behind one small protocol (:mod:`.base`).

The registry :data:`ENGINES` names each engine's module and class; :func:`make_engine` imports the
module only when that engine is asked for (pip's ``commands_dict`` pattern), so asking for the
reference never imports torch, and nothing imports llama-cpp-python in the harness's own process.

=============  ========================================================================
name           engine
=============  ========================================================================
reference      float64 NumPy, the specification (:mod:`.reference`)
transformers   HF transformers fp32 eager, the oracle (:mod:`.transformers`)
fast           the torch twin, any device and dtype (:mod:`.fast`)
llamacpp       llama.cpp through llama-cpp-python, in a worker subprocess (:mod:`.llamacpp`)
=============  ========================================================================
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, NamedTuple

from reference.errors import InputError

from .base import Engine, EngineCrashed, EngineUnavailable, Generated, TraceFn

__all__ = ["ENGINES", "Engine", "EngineCrashed", "EngineUnavailable", "Generated", "TraceFn", "engine_class",
           "make_engine"]


class EngineEntry(NamedTuple):
    """One row of the registry: where the engine lives, and what it is in one line."""

    module: str
    cls: str
    summary: str


ENGINES: dict[str, EngineEntry] = {
    "reference": EngineEntry("harness.engines.reference", "ReferenceEngine", "float64 NumPy reference"),
    "transformers": EngineEntry("harness.engines.transformers", "TransformersEngine",
                                "HF transformers fp32 eager (HF folders; Gemma 3 GGUFs)"),
    "fast": EngineEntry("harness.engines.fast", "FastEngine", "torch fast path (--device, --dtype, --weights)"),
    "llamacpp": EngineEntry("harness.engines.llamacpp", "LlamaCppEngine",
                            "llama.cpp via llama-cpp-python, in a worker subprocess (GGUF only)"),
}
"""Engine name -> :class:`EngineEntry`."""

#: Keyword options each engine takes from the command line (others are not passed to it).
ENGINE_OPTIONS: dict[str, tuple[str, ...]] = {
    "reference": ("cache_gb", "layers"),
    "fast": ("device", "dtype", "batched", "weights", "layers"),
    "transformers": ("layers",),
}


def engine_class(name: str) -> type:
    """The class of engine ``name``, imported on first use.

    Raises:
        EngineUnavailable: unknown name.
    """
    entry = ENGINES.get(name)
    if entry is None:
        raise EngineUnavailable(f"unknown engine {name!r} (available: {', '.join(ENGINES)})")
    return getattr(importlib.import_module(entry.module), entry.cls)


def make_engine(name: str, path: str | Path, **options: Any) -> Engine:
    """Build engine ``name`` for the model at ``path``.

    Args:
        options: engine-specific keywords (:data:`ENGINE_OPTIONS`: ``device``, ``dtype``, ``batched``,
            ``weights`` for ``fast``; ``cache_gb`` for the reference; ``layers`` for reference, fast and
            transformers); None values and options the engine does not take are dropped, except
            ``layers``, which an engine that cannot cut a model refuses.

    Raises:
        EngineUnavailable: unknown engine name or engine not installed (one line, says how to install).
        InputError: bad model file; ``layers`` for an engine that cannot cut a model.
        NotEnoughMemory: the model does not fit in the memory available (one line, with what to try).
    """
    cls = engine_class(name)
    allowed = ENGINE_OPTIONS.get(name, ())
    if options.get("layers") is not None and "layers" not in allowed:
        raise InputError(f"--layers {options['layers']}: the {name} engine runs the file as it is and cannot keep "
                         "only the first layers (use reference, fast or transformers)")
    return cls(path, **{k: v for k, v in options.items() if v is not None and k in allowed})
