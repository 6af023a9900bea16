"""The document ``g4h inspect`` reports (``docs/inspect-json.md``): what a model file holds and what is wrong.

:class:`Inspection` holds the facts of one file: architecture and size label, the per-layer table, tensor types
with counts and bytes (:class:`TensorType`), tokenizer facts, one :class:`EngineRow` per engine setting and the
:class:`Problem` list (codes and severities: :mod:`harness.inspect`). ``Inspection.as_dict()`` is the
``--json`` document, :data:`SCHEMA_VERSION`; :func:`unreadable_dict` is the document of a file that cannot be
read at all. The checks that fill it are :mod:`.gguf_header`, :mod:`.hf_folder`, :mod:`.common` and
:mod:`.runnable`.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA_VERSION = 1
"""Version of the ``--json`` document (``docs/inspect-json.md``); bumped when a field changes meaning or goes."""

UNUSABLE = "unusable"
WARNING = "warning"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the file.

    Attributes:
        severity: :data:`UNUSABLE` or :data:`WARNING`.
        code: what kind (the module docstring lists them).
        where: the key, tensor or file it is about.
        message: one line naming ``where`` and what was expected.
    """

    severity: str
    code: str
    where: str
    message: str


@dataclass(frozen=True)
class TensorType:
    """The tensors of one stored type.

    Attributes:
        type: GGML type name (``Q8_0``), ``type <id>`` for an id gguf does not know, or a safetensors dtype.
        type_id: the GGML type id (None for safetensors).
        count: tensors of this type.
        elements: their elements, summed.
        bytes: their stored bytes, summed (None when the type's block size is unknown).
    """

    type: str
    type_id: int | None
    count: int
    elements: int
    bytes: int | None


@dataclass
class EngineRow:
    """Whether one engine setting can run the file.

    Attributes:
        engine: ``reference``, ``fast``, ``transformers`` or ``llamacpp``.
        dtype: compute dtype (``float64``, ``float32``, ...); ``stored`` for llama.cpp (it reads the file's types).
        weights: fast on a GGUF: ``packed`` or ``dequantized``; else None.
        can_run: the engine can load this file here.
        reason: why not, one line (None when it can).
        notes: known differences it will show against the reference, one line each.
        memory: the memory plan's estimate (:meth:`harness.core.memory.MemoryPlan.as_dict`; None when the
            row cannot run or the file is unusable).
    """

    engine: str
    dtype: str
    weights: str | None
    can_run: bool
    reason: str | None = None
    notes: list[str] = field(default_factory=list)
    memory: dict[str, Any] | None = None


@dataclass
class Inspection:
    """Everything ``g4h inspect`` reports about one model (see the module docstring and ``docs/inspect-json.md``)."""

    path: str
    format: str
    file_bytes: int
    gguf_version: int | None = None
    architecture: str | None = None
    name: str | None = None
    size_label: str | None = None
    size_label_source: str | None = None
    n_params: int = 0
    n_expert_params: int = 0
    file_type: str | None = None
    model: dict[str, Any] | None = None
    layers: list[dict[str, Any]] = field(default_factory=list)
    tensor_types: list[TensorType] = field(default_factory=list)
    tokenizer: dict[str, Any] = field(default_factory=dict)
    engines: list[EngineRow] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        """``unusable`` (a problem is), ``warnings`` (only warnings) or ``usable``."""
        if any(p.severity == UNUSABLE for p in self.problems):
            return "unusable"
        return "warnings" if self.problems else "usable"

    @property
    def exit_code(self) -> int:
        """0 usable, 1 usable with warnings, 2 unusable."""
        return {"usable": 0, "warnings": 1, "unusable": 2}[self.verdict]

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` document (schema :data:`SCHEMA_VERSION`, ``docs/inspect-json.md``)."""
        d = asdict(self)
        return {"schema": "g4h-inspect", "schema_version": SCHEMA_VERSION, "verdict": self.verdict,
                "exit_code": self.exit_code, **d}


def unreadable_dict(path: str | os.PathLike, message: str) -> dict[str, Any]:
    """The ``--json`` document of a file that cannot be read at all (verdict ``unreadable``, exit code 2)."""
    return {"schema": "g4h-inspect", "schema_version": SCHEMA_VERSION, "verdict": "unreadable", "exit_code": 2,
            "path": str(path), "problems": [asdict(Problem(UNUSABLE, "unreadable", str(path), message))]}
