"""Engines: everything that can run Gemma 4, behind one small protocol (:mod:`.base`).

The registry (:mod:`harness.core.engine_kinds`, one row per engine kind) names each engine's module and class
(:data:`ENGINES`, :data:`ENGINE_SCHEMES` are read from it); :func:`make_engine` imports the
module only when that engine is asked for (pip's ``commands_dict`` pattern), so asking for the
reference never imports torch, and nothing imports llama-cpp-python in the harness's own process.

=============  ========================================================================
name           engine
=============  ========================================================================
reference      float64 NumPy, the specification (:mod:`.reference`)
transformers   HF transformers fp32 eager, the oracle (:mod:`.transformers`)
fast           the torch twin, any device and dtype (:mod:`.fast`)
llamacpp       llama.cpp through llama-cpp-python, in a worker subprocess (:mod:`.llamacpp`)
cmd:COMMAND    any program that speaks the subprocess protocol (:mod:`.cmd`, ``docs/engine-protocol.md``)
openai:URL     a model behind an OpenAI-compatible completion server (:mod:`.openai`, ``docs/server-dialects.md``;
               greedy continuations only)
=============  ========================================================================

An engine name is a plain name (:data:`ENGINES`) or ``<scheme>:<argument>`` (:data:`ENGINE_SCHEMES`): the
scheme picks the class, the argument says which program or server (``cmd:'python my_engine.py --threads 4'``,
``openai:http://127.0.0.1:8080/v1``).
:func:`engine_kind` gives the part that names gates and report rows (``cmd``); :func:`split_engines` reads a
comma list of names (``fast,llamacpp,cmd:'./eng --a,b'``: commas inside quotes stay).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, NamedTuple

from gemma4_harness.reference.errors import InputError

from ..core.engine_kinds import KINDS, plain_kinds, scheme_kinds
from .base import Engine, EngineCrashed, EngineUnavailable, Generated, TraceFn
from .checked import CheckedEngine

__all__ = ["ENGINES", "ENGINE_SCHEMES", "Engine", "EngineCrashed", "EngineUnavailable", "Generated", "TraceFn",
           "check_engine_name", "engine_class", "engine_kind", "make_engine", "split_engines"]


class EngineEntry(NamedTuple):
    """Where an engine lives, and what it is in one line (from its registry row,
    :class:`harness.core.engine_kinds.EngineKind`)."""

    module: str
    cls: str
    summary: str


ENGINES: dict[str, EngineEntry] = {k.name: EngineEntry(k.module, k.cls, k.summary) for k in plain_kinds()}
"""Engine name -> :class:`EngineEntry` (from the registry rows, :data:`harness.core.engine_kinds.KINDS`)."""

ENGINE_SCHEMES: dict[str, EngineEntry] = {k.name: EngineEntry(k.module, k.cls, k.summary) for k in scheme_kinds()}
"""Scheme -> :class:`EngineEntry` for engine names ``<scheme>:<argument>``. The class is built as
``cls(argument, model_path, **options)``."""

#: Keyword options each engine takes from the command line (others are not passed to it): the rows' ``options``.
ENGINE_OPTIONS: dict[str, tuple[str, ...]] = {k.name: k.options for k in KINDS if k.options}


def engine_kind(name: str) -> str:
    """The kind of engine ``name`` names: the name itself, or its scheme (``cmd:'./eng'`` -> ``cmd``).
    Gate pairs and report rows are named by kind (``reference~cmd``)."""
    scheme, sep, _ = name.partition(":")
    return scheme if sep and scheme in ENGINE_SCHEMES else name


def _entry(name: str) -> tuple[EngineEntry, str | None]:
    """The registry row of ``name`` and, for a scheme name, its argument.

    Raises:
        EngineUnavailable: unknown name or scheme, or a scheme name with an empty argument.
    """
    if name in ENGINES:
        return ENGINES[name], None
    scheme, sep, arg = name.partition(":")
    if sep and scheme in ENGINE_SCHEMES:
        if not arg.strip():
            raise EngineUnavailable(f"engine {name!r}: nothing after {scheme}: "
                                    f"(expected {ENGINE_SCHEMES[scheme].summary.rsplit(': ', 1)[-1]})")
        return ENGINE_SCHEMES[scheme], arg
    known = ", ".join([*ENGINES, *(f"{s}:..." for s in ENGINE_SCHEMES)])
    raise EngineUnavailable(f"unknown engine {name!r} (available: {known})")


def check_engine_name(name: str) -> None:
    """Refuse an unknown engine name before any work starts (imports nothing).

    Raises:
        EngineUnavailable: unknown name or scheme, or a scheme name with an empty argument.
    """
    _entry(name)


def split_engines(text: str) -> list[str]:
    """The engine names of a comma list, in order. Commas inside single or double quotes do not split
    (``cmd:'./eng --ids 1,2',fast`` is two names); surrounding blanks are dropped, empty items refused.

    Raises:
        InputError: an empty item, or an unclosed quote.
    """
    names, cur, quote = [], [], None
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == ",":
            names.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    if quote:
        raise InputError(f"engine list {text!r}: unclosed {quote} quote")
    names.append("".join(cur).strip())
    if any(not n for n in names):
        raise InputError(f"engine list {text!r}: an empty name (expected NAME[,NAME...])")
    return names


def engine_class(name: str) -> type:
    """The class of engine ``name`` (a plain name or ``<scheme>:<argument>``), imported on first use.

    Raises:
        EngineUnavailable: unknown name.
    """
    entry, _ = _entry(name)
    return getattr(importlib.import_module(entry.module), entry.cls)


def make_engine(name: str, path: str | Path, **options: Any) -> Engine:
    """Build engine ``name`` for the model at ``path``.

    Args:
        name: a plain engine name (:data:`ENGINES`) or ``<scheme>:<argument>`` (:data:`ENGINE_SCHEMES`).
        options: engine-specific keywords (:data:`ENGINE_OPTIONS`: ``device``, ``dtype``, ``batched``,
            ``weights`` for ``fast``; ``cache_gb`` for the reference; ``layers`` for reference, fast and
            transformers; ``server_model``, ``server_timeout``, ``check_greedy``, ``declare``, ``dialect`` and
            ``local_tokenizer`` (``path -> tokenizer``: the generic dialect's text prompts) for ``openai``;
            ``check_greedy`` for
            ``cmd``); None values and
            options the engine does not take are dropped, except ``layers``, which an engine that cannot cut a
            model refuses.

    Raises:
        EngineUnavailable: unknown engine name or engine not installed (one line, says how to install).
        InputError: bad model file; a ``cmd:`` command that cannot be started; a server that is down or is no known
            dialect (:class:`harness.engines.openai.ServerError`); ``layers`` for an engine that cannot cut a model.
        EngineFailure: the engine crashed loading the model, or a ``cmd:`` engine failed its handshake
            (:class:`harness.core.workers.EngineFailure`: the engine's fault, exit 1).
        NotEnoughMemory: the model does not fit in the memory available (one line, with what to try).

    Returns:
        the engine, its outputs checked (:class:`harness.engines.checked.CheckedEngine`: NaN or Inf in its logits,
        log-probs or trace points is :class:`harness.core.workers.EngineOutputError`, with the first layer and point).
    """
    entry, arg = _entry(name)
    kind = engine_kind(name)
    allowed = ENGINE_OPTIONS.get(kind, ())
    if options.get("layers") is not None and "layers" not in allowed:
        raise InputError(f"--layers {options['layers']}: the {name} engine runs the file as it is and cannot keep "
                         "only the first layers (use reference, fast or transformers)")
    cls = getattr(importlib.import_module(entry.module), entry.cls)
    kw = {k: v for k, v in options.items() if v is not None and k in allowed}
    return CheckedEngine(cls(path, **kw) if arg is None else cls(arg, path, **kw), kind)
