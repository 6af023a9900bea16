"""The files of a sweep: found, inspected from their headers, grouped by base model, a base chosen per group.

* :func:`find_models` turns what the user named (files, folders, glob patterns) into model paths: a folder
  holding ``config.json`` is one HF model; any other folder gives its ``*.gguf`` files (not recursive).
* :func:`describe` reads one model's header (:func:`harness.inspect.inspect_model`, no tensor data) into a
  :class:`SweepFile`: its file type, bits per weight, ``g4h inspect``'s problems, which engines can run it and why
  not, and its *signature*: the architecture and every tensor's name and shape as the loader sees them
  (:func:`harness.core.memory.model_info`).
* :func:`group_files` puts files of one signature into one :class:`Group`: the same model in different types. The
  group's base is the file of the highest precision (:func:`precision_key`: most bits per weight, then F64 > F32 >
  F16 > BF16), or the file named by ``--base``. The float64 reference runs once per group, on the base.

A file that is unusable (an ``unusable`` problem in ``g4h inspect``) joins no group: it becomes rows with the
problem as their reason. An mmproj (``general.architecture = clip``) is not a decoder and is left out, with a note.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from gemma4_harness.reference.errors import InputError

from ..core import memory
from ..core.engine_kinds import KIND
from ..engines.llamacpp import INSTALL_MSG
from ..inspect import UNUSABLE, Inspection, inspect_model

GLOB_CHARS = set("*?[")

#: Stored types in the order of their precision at equal bits per weight (the base is the first).
FLOAT_ORDER = ("F64", "float64", "F32", "float32", "F16", "float16", "BF16", "bfloat16")


@dataclass
class SweepFile:
    """One model file of a sweep, as its header describes it.

    Attributes:
        path: the resolved path.
        key: 12 hex digits naming this file's version (path, size, modification time): a resumed sweep reruns the
            rows of a file whose key changed.
        label: what rows show: the file type (``Q4_K_M``) when the header says it, else the file name.
        file_type: ``general.file_type`` as llama.cpp names it (``Q4_K_M``), or the HF folder's dtype.
        bpw: bits per weight over every tensor (stored bits / elements), as llama.cpp reports a model's size.
        size: bytes on disk.
        types: stored type -> tensor count.
        problems: ``g4h inspect``'s problems (``severity``, ``code``, ``where``, ``message``).
        engines: engine -> ``{"can_run": bool, "reason": str | None}`` from ``g4h inspect``'s rows (fast: float32
            with its default weight mode).
        signature: the group key (None for an unusable file).
        vocab, context, n_layer: from the config (0 when unusable).
        architecture: ``gemma4``, ``gemma3`` ... (None when unknown).
    """

    path: str
    key: str
    label: str
    file_type: str | None
    bpw: float
    size: int
    types: dict[str, int]
    problems: list[dict[str, str]]
    engines: dict[str, dict[str, Any]]
    signature: str | None
    vocab: int = 0
    context: int = 0
    n_layer: int = 0
    architecture: str | None = None
    facts: Any = field(default=None, repr=False, compare=False)

    @property
    def unusable(self) -> dict[str, str] | None:
        """The first unusable problem, or None."""
        return next((p for p in self.problems if p["severity"] == UNUSABLE), None)

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (``results.json`` ``files``), without the loader facts."""
        return {k: v for k, v in self.__dict__.items() if k != "facts"}


@dataclass
class Group:
    """Files of one base model.

    Attributes:
        name: ``<architecture>-<n_layer>L-<signature[:8]>``.
        signature: the shared signature.
        base: the file the float64 reference runs on.
        files: every file of the group, the base included, in precision order.
    """

    name: str
    signature: str
    base: SweepFile
    files: list[SweepFile]

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (``results.json`` ``groups``)."""
        return {"name": self.name, "signature": self.signature, "base": self.base.path,
                "files": [f.path for f in self.files]}


def find_models(items: Sequence[str]) -> list[Path]:
    """The model paths ``items`` name, in order, each once.

    Args:
        items: files (``.gguf``), HF folders (holding ``config.json``), folders of GGUFs, or glob patterns.

    Raises:
        InputError: a path that does not exist, a pattern or folder that matches no model, nothing named.
    """
    out: list[Path] = []
    for item in items:
        if GLOB_CHARS & set(item):
            hits = [Path(h) for h in sorted(glob.glob(item))]
            hits = [h for h in hits if h.is_file() or (h / "config.json").is_file()]
            if not hits:
                raise InputError(f"{item}: the pattern matches no GGUF file or HF folder")
        else:
            p = Path(item)
            if not p.exists():
                raise InputError(f"{item}: no such file or folder")
            if p.is_dir() and not (p / "config.json").is_file():
                hits = sorted(p.glob("*.gguf"))
                if not hits:
                    raise InputError(f"{item}: a folder with no *.gguf file and no config.json (expected GGUFs or "
                                     "an HF model folder)")
            else:
                hits = [p]
        out += hits
    seen, unique = set(), []
    for p in out:
        r = p.resolve()
        if r not in seen:
            seen.add(r)
            unique.append(r)
    if not unique:
        raise InputError("no model named (give GGUF files, folders or glob patterns)")
    return unique


def file_key(path: Path) -> str:
    """12 hex digits of the path, size and modification time (a changed file gets a new key)."""
    st = path.stat() if path.is_file() else max((f.stat() for f in path.iterdir() if f.is_file()),
                                                  key=lambda s: s.st_mtime_ns)
    size = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return hashlib.sha256(f"{path}\0{size}\0{st.st_mtime_ns}".encode()).hexdigest()[:12]


def _bpw(info: Inspection) -> float:
    bits = sum((t.bytes or 0) * 8 for t in info.tensor_types)
    elems = sum(t.elements for t in info.tensor_types)
    return bits / elems if elems else 0.0


def _engine_table(info: Inspection) -> dict[str, dict[str, Any]]:
    """Engine -> can it run the file (``g4h inspect``'s rows; fast: float32 at its default weight mode)."""
    out: dict[str, dict[str, Any]] = {}
    for r in info.engines:
        row = KIND[r.engine]
        if row.dtypes[1:] and (r.dtype != row.dtypes[0] or r.weights not in (None, *row.weights[:1])):
            continue  # an engine of several settings (fast): its default one only
        reason = r.reason
        if reason == INSTALL_MSG:  # the llama.cpp engine's "not installed" (harness.engines.llamacpp)
            # whether llama-cpp-python is installed is a fact of the node that runs the task, not of the driver
            out[r.engine] = {"can_run": True, "reason": None}
            continue
        out[r.engine] = {"can_run": r.can_run, "reason": reason}
    return out


def _signature(facts: memory.ModelInfo) -> str:
    """The group key: architecture, sizes, and every learned tensor's name and shape (``rope_freqs.weight``, the
    proportional-RoPE table a GGUF carries and an HF folder derives from its config, is left out, so a GGUF and
    the HF folder it came from are one model)."""
    cfg = facts.cfg
    shapes = sorted((name, list(t.shape)) for name, t in facts.tensors.items() if name != "rope_freqs.weight")
    blob = json.dumps({"arch": cfg.arch, "vocab": cfg.vocab_size, "hidden": cfg.hidden_size, "layers": cfg.n_layer,
                       "tensors": shapes}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def describe(path: Path) -> SweepFile | None:
    """The :class:`SweepFile` of one model, or None for an mmproj (not a decoder).

    Raises:
        ModelFileError: the file cannot be read at all (not a GGUF, a header cut short): one line naming it.
    """
    info = inspect_model(path)
    if info.architecture == "clip":
        return None
    problems = [{"severity": p.severity, "code": p.code, "where": p.where, "message": p.message} for p in info.problems]
    types = {t.type: t.count for t in info.tensor_types}
    file_type = info.file_type or (max(info.tensor_types, key=lambda t: t.elements).type if info.tensor_types else None)
    label = info.file_type or (f"{path.name} ({file_type})" if file_type else path.name)
    sf = SweepFile(path=str(path), key=file_key(path), label=label, file_type=file_type, bpw=round(_bpw(info), 4),
                   size=info.file_bytes, types=types, problems=problems, engines=_engine_table(info), signature=None,
                   architecture=info.architecture)
    if sf.unusable is None:
        try:
            facts = memory.model_info(path)
        except InputError as e:  # what the header checks let through but the loader refuses
            sf.problems.append({"severity": UNUSABLE, "code": "loader", "where": str(path),
                                "message": str(e).splitlines()[0]})
            return sf
        sf.facts = facts
        sf.signature = _signature(facts)
        sf.vocab, sf.context, sf.n_layer = facts.cfg.vocab_size, facts.cfg.context_length, facts.cfg.n_layer
        sf.architecture = facts.cfg.arch
    return sf


def precision_key(f: SweepFile) -> tuple:
    """Sort key putting the highest precision first: most bits per weight, then F64 > F32 > F16 > BF16, then path."""
    order = FLOAT_ORDER.index(f.file_type) if f.file_type in FLOAT_ORDER else len(FLOAT_ORDER)
    return (-f.bpw, order, f.path)


def group_files(files: Iterable[SweepFile], base: str | os.PathLike | None = None
                ) -> tuple[list[Group], list[SweepFile]]:
    """Group usable files by signature; choose each group's base.

    Args:
        files: the described files.
        base: ``--base``: the file every file of its group is measured against (it must be one of ``files``).

    Returns:
        ``(groups, unusable files)``; groups in the order of their first file.

    Raises:
        InputError: ``base`` is not among the files, or is unusable.
    """
    groups: dict[str, list[SweepFile]] = {}
    bad: list[SweepFile] = []
    for f in files:
        if f.signature is None:
            bad.append(f)
        else:
            groups.setdefault(f.signature, []).append(f)
    chosen = None
    if base is not None:
        b = str(Path(base).resolve())
        chosen = next((f for f in files if f.path == b), None)
        if chosen is None:
            raise InputError(f"--base {base}: not among the swept files (name it among the models too)")
        if chosen.signature is None:
            raise InputError(f"--base {base}: the file is unusable ({chosen.unusable['message']})")
    out = []
    for sig, members in groups.items():
        members = sorted(members, key=precision_key)
        g_base = chosen if chosen is not None and chosen.signature == sig else members[0]
        head = members[0]
        name = f"{head.architecture or 'model'}-{head.n_layer}L-{sig[:8]}"
        out.append(Group(name=name, signature=sig, base=g_base, files=members))
    return out, bad
