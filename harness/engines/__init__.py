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
openai:URL     a model behind an OpenAI-compatible completion server (:mod:`.openai`; generate only)
=============  ========================================================================

A *prefix* engine (:data:`PREFIX_ENGINES`) is named ``PREFIX:ARGUMENT`` (``openai:http://127.0.0.1:8080/v1``);
its class builds itself from the whole name with ``from_engine_name(name, path, **options)``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, NamedTuple

from .base import Engine, EngineCrashed, EngineUnavailable, Generated, TraceFn

__all__ = ["ENGINES", "PREFIX_ENGINES", "Engine", "EngineCrashed", "EngineUnavailable", "Generated", "TraceFn",
           "engine_class", "engine_names", "is_engine_name", "make_engine"]


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

PREFIX_ENGINES: dict[str, EngineEntry] = {
    "openai": EngineEntry("harness.engines.openai", "OpenAIEngine",
                          "a model behind an OpenAI-compatible server: openai:http://HOST:PORT/v1 (generate only)"),
}
"""Prefix -> :class:`EngineEntry` of the engines named ``PREFIX:ARGUMENT``."""

#: Keyword options each engine takes from the command line (others are not passed to it).
ENGINE_OPTIONS: dict[str, tuple[str, ...]] = {
    "fast": ("device", "dtype", "batched", "weights"),
    "openai": ("server_model", "server_timeout", "concurrency"),
}


def _prefix(name: str) -> str | None:
    head, sep, _ = name.partition(":")
    return head if sep and head in PREFIX_ENGINES else None


def is_engine_name(name: str) -> bool:
    """True for a registered engine name or a ``PREFIX:ARGUMENT`` of a prefix engine."""
    return name in ENGINES or _prefix(name) is not None


def engine_names() -> str:
    """The engine names for messages and help: ``reference, ..., openai:URL``."""
    return ", ".join([*ENGINES, *(f"{p}:URL" if p == "openai" else f"{p}:..." for p in PREFIX_ENGINES)])


def engine_class(name: str) -> type:
    """The class of engine ``name``, imported on first use.

    Raises:
        EngineUnavailable: unknown name.
    """
    entry = ENGINES.get(name) or PREFIX_ENGINES.get(_prefix(name) or "")
    if entry is None:
        raise EngineUnavailable(f"unknown engine {name!r} (available: {engine_names()})")
    return getattr(importlib.import_module(entry.module), entry.cls)


def make_engine(name: str, path: str | Path, **options: Any) -> Engine:
    """Build engine ``name`` for the model at ``path``.

    Args:
        name: a name of :data:`ENGINES`, or ``PREFIX:ARGUMENT`` of :data:`PREFIX_ENGINES` (``openai:URL``).
        options: engine-specific keywords (``device``, ``dtype``, ``batched``, ``weights`` for ``fast``;
            ``server_model``, ``server_timeout``, ``concurrency`` for ``openai``); None values and options the
            engine does not take are dropped.

    Raises:
        EngineUnavailable: unknown engine name or engine not installed (one line, says how to install).
        InputError: bad model file; a server that is down or answers wrongly
            (:class:`harness.engines.openai.ServerError`).
    """
    cls = engine_class(name)
    prefix = _prefix(name)
    allowed = ENGINE_OPTIONS.get(prefix or name, ())
    kept = {k: v for k, v in options.items() if v is not None and k in allowed}
    return cls.from_engine_name(name, path, **kept) if prefix else cls(path, **kept)
