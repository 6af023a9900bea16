"""What a model file holds, what is wrong with it, and which engines can run it: the facts behind ``g4h inspect``.

:func:`inspect_model` reads a GGUF file's header (metadata and tensor table, through
:func:`reference.gguf_check.check_gguf`) or an HF folder's ``config.json``, safetensors headers and
tokenizer files; the tensor data is read once, for the weight problems (``weights``, ``weight_not_carried``: about
a second per GB, :func:`weight_problems`), everything else comes from the header. It returns an
:class:`Inspection`: architecture and size label, the per-layer table (:class:`reference.config.LayerSpec`),
tensor types with counts and bytes, tokenizer facts, one :class:`EngineRow` per engine setting and
the :class:`Problem` list. ``Inspection.as_dict()`` is the ``g4h inspect --json`` document, specified
field by field in ``docs/inspect-json.md`` (:data:`SCHEMA_VERSION`).

Problems (``code``: severity):

* ``file_check``: unusable. :func:`reference.gguf_check.check_gguf` refuses the file (its message), or an
  HF folder's safetensors header cannot be read. When the GGUF header can still be listed (a tensor of a
  type id ``gguf`` does not know, a bad padding byte, a key of the wrong GGUF type), the rest of the
  report is filled from a plain listing of the header (:func:`_list_gguf`); otherwise the file is
  *unreadable* and :func:`inspect_model` raises.
* ``config``: unusable. :func:`reference.config.config_from_gguf` / ``config_from_hf`` /
  ``attach_rope_freqs`` refuse the metadata (their message).
* ``tensors``: unusable. A tensor the decoder reads is missing or mis-shaped, or the file has a decoder
  tensor the config does not read (:func:`reference.config.unread_tensors`), as the loader refuses them.
* ``tensor_type``: unusable. A tensor type ``gguf.quants`` cannot dequantize: an id ``gguf`` does not
  know (a fork's type, or a newer llama.cpp's) or a known type without a dequantizer (``Q8_1``, ``Q8_K``,
  ``F64``, the integer types). ``TQ1_0`` and ``TQ2_0`` are *not* among them with gguf 0.19 (it
  dequantizes both); the fast engine cannot decode them, which its rows say.
* ``vocab_mismatch``: unusable. ``tokenizer.ggml.tokens`` (GGUF) or ``vocab_size`` (HF) against the rows
  of ``token_embd.weight``.
* ``tokenizer_model``: warning. ``tokenizer.ggml.model`` is not the architecture's (``gemma4`` for
  gemma4, ``llama`` for gemma3), e.g. a SentencePiece ``llama`` tokenizer declared in a gemma4 file.
* ``no_tokenizer``: warning. No ``tokenizer.ggml.model`` key (GGUF; llama.cpp then refuses the file),
  no tokenizer file (HF).
* ``special_token_id``: warning. A BOS/EOS/padding id outside the vocabulary.
* ``chat_template_missing``: warning. No ``tokenizer.chat_template`` key (GGUF), no chat template in
  ``tokenizer_config.json``, ``chat_template.jinja`` or ``chat_template.json`` (HF).
* ``shared_kv_tensors``: warning. ``attn_k`` / ``attn_k_norm`` / ``attn_v`` of a KV-shared layer: the
  file ships them, no engine reads them (the layer reads its donor's cache).
* ``weights``: unusable. A weight is NaN, Inf or larger than any matmul holds (:func:`reference.weight_check.
  check_weights`, the loaders' own check).
* ``weight_not_carried``: warning. A weight the fast engine holds in a compute dtype but cannot carry through the
  ops after it (:func:`fast.carry.carry_problems`): one per tensor and dtype, naming the op and the magnitude.
  These two read the tensor data once (about a second per GB; everything else reads the header only).
* ``softcap_missing``: warning. A gemma4 GGUF without ``gemma4.final_logit_softcapping``: the file
  means no final softcap, llama.cpp applies 30 (``llama-hparams.h``), so its logits differ.

Exit status (:attr:`Inspection.exit_code`): 0 usable, 1 usable with warnings, 2 unusable.

Engines: ``reference`` (float64), ``fast`` for each dtype and, for GGUF, each weight mode, ``transformers``
(fp32) and ``llamacpp``. An unusable file runs on none (the harness compares every engine with the
reference, which refuses it). Otherwise each engine's own limits apply: the fast path decodes
:data:`FAST_TYPES` only (:data:`fast.quants.SUPPORTED`); transformers reads HF folders and Gemma 3 GGUFs,
not Gemma 4 GGUFs; llama.cpp needs a GGUF, llama-cpp-python installed, a ``tokenizer.ggml.model`` key and type ids its
ggml knows (:data:`LLAMACPP_TYPE_IDS`), and its KV donor rule must give each shared layer a cache of
the right shape (:func:`llamacpp_donors`). The memory column of each row that can run is its memory plan
(:func:`_memory_estimates`, :func:`harness.core.memory.plan`).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import mmap
import os
import re
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import gguf
import numpy as np
from safetensors import safe_open

from fast.carry import carry_problems
from reference.config import (
    ModelConfig,
    attach_rope_freqs,
    config_from_gguf,
    config_from_hf,
    expected_tensors,
    optional_tensors,
    unread_tensors,
)
from reference.errors import InputError, ModelFileError
from reference.files import open_regular, read_json
from reference.gguf_check import check_gguf
from reference.names import hf_to_gguf
from reference.weight_check import MAX_ABS_FP16, MAX_ABS_FP32, check_weights
from reference.weights import load_model, read_hf_config

from ..core import memory
from .llamacpp import INSTALL_MSG, LLAMA_CPP_PYTHON_VERSION

SCHEMA_VERSION = 1
"""Version of the ``--json`` document (``docs/inspect-json.md``); bumped when a field changes meaning or goes."""

UNUSABLE = "unusable"
WARNING = "warning"

FAST_DTYPES = ("float32", "bfloat16", "float16")
"""Compute dtypes of the fast engine (``--dtype``)."""

#: GGUF tensor types the fast engine decodes: :data:`fast.quants.SUPPORTED`, copied here so that inspecting a
#: file does not import torch (3-5 s, longer than the header of a 33 GB file takes); tests/test_inspect.py
#: checks that the copy equals the original.
FAST_TYPES = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                        "Q6_K"})

#: The fast engine's ``--weights`` modes (:data:`harness.engines.fast.WEIGHT_MODES`, copied for the same reason
#: and checked the same way).
FAST_WEIGHT_MODES = ("packed", "dequantized")

#: GGML type ids the ggml of llama-cpp-python 0.3.36 reads: ``enum ggml_type`` in ``ggml/include/ggml.h``,
#: 0..42 without the removed ids 4, 5 (Q4_2, Q4_3), 31-33 (Q4_0_4_4 ..) and 36-38 (IQ4_NL_4_4 ..).
#: Id 42 (Q2_0) is one gguf 0.19 does not know.
LLAMACPP_TYPE_IDS = frozenset(range(43)) - {4, 5, 31, 32, 33, 36, 37, 38}

#: Tokenizer model each architecture's files are expected to declare.
EXPECTED_TOKENIZER = {"gemma4": "gemma4", "gemma3": "llama"}

#: Bytes per element of the safetensors dtypes.
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                     "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}

_SHARED_KV = ("attn_k.weight", "attn_k_norm.weight", "attn_v.weight")


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


# --------------------------------------------------------------------------- entry point


def inspect_model(path: str | os.PathLike) -> Inspection:
    """Inspect a ``.gguf`` file or an HF folder from its metadata and tensor table.

    Args:
        path: the file or folder.

    Returns:
        :class:`Inspection` (problems included; an unusable file is a result, not an error).

    Raises:
        ModelFileError: the path does not exist, or the file cannot be read at all (not GGUF, a header
            cut short, an HF folder without a readable ``config.json``): one line naming it.
    """
    p = Path(path)
    if not p.exists():
        raise ModelFileError(f"{p}: no such file or folder")
    info, cfg = _inspect_hf(p) if p.is_dir() else _inspect_gguf(p)
    if cfg is not None and not any(q.severity == UNUSABLE for q in info.problems):
        info.problems += weight_problems(p)
    info.engines = engine_rows(info, cfg)
    _note_carry(info)
    for row, estimate in zip(info.engines, _memory_estimates(info, info.engines)):
        row.memory = estimate
    return info


#: The use each memory estimate is made for: a prompt of this many tokens and as many generated ones (the
#: reference then reads its weights more than once, so its weight cache counts), one sequence, on the CPU.
ESTIMATE_TOKENS = 16


def _memory_estimates(info: Inspection, rows: list[EngineRow]) -> list[dict[str, Any] | None]:
    """Per row, the memory plan of that engine setting (:func:`harness.core.memory.plan`, as a dict:
    ``need_bytes``, ``breakdown``, ``available_bytes``, ``fits``, ``advice`` ...), or None for a row that
    cannot run.

    Each estimate is for :data:`ESTIMATE_TOKENS` prompt tokens and as many generated, on the CPU, with the
    engine's defaults otherwise (the reference's ``--ref-cache-gb`` 2; fast: the row's dtype and weight
    mode), as a new process (``fresh``: the engine's runtime counts as still to allocate) against what
    this machine has now. The model's facts come from the reference's loader with no
    tensor read (:func:`harness.core.memory.model_info`), the same facts the engines plan with; an
    unusable file, or one that loader refuses, gets no estimate.
    """
    if info.verdict == "unusable" or not any(r.can_run for r in rows):
        return [None for _ in rows]
    try:
        facts = memory.model_info(info.path)
    except InputError:  # what the header checks let through but the loader refuses: no estimate
        return [None for _ in rows]
    out: list[dict[str, Any] | None] = []
    for r in rows:
        if not r.can_run:
            out.append(None)
            continue
        options: dict[str, Any] = {"tokens": ESTIMATE_TOKENS, "new_tokens": ESTIMATE_TOKENS, "fresh": True}
        if r.engine == "fast":
            options.update(dtype=r.dtype, weights=r.weights or "dequantized")
        out.append(memory.plan(r.engine, facts, **options).as_dict())
    return out


# --------------------------------------------------------------------------- GGUF


@dataclass(frozen=True)
class _Tensor:
    name: str
    type_id: int
    shape: tuple[int, ...]  # numpy order
    n_bytes: int | None


def _type_name(type_id: int) -> str:
    try:
        return gguf.GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type {type_id}"


@functools.cache
def gguf_can_dequantize(type_id: int) -> bool:
    """Whether ``gguf.quants.dequantize`` decodes GGML type ``type_id`` (tried on one zero block, no file data).

    The reference reads every GGUF tensor through it, so a type it cannot decode makes a file unusable.
    """
    try:
        qtype = gguf.GGMLQuantizationType(type_id)
        _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        return False
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _inspect_gguf(path: Path) -> tuple[Inspection, ModelConfig | None]:
    problems: list[Problem] = []
    rope_freqs = None
    try:
        gf = check_gguf(path)
        meta, version = gf.metadata, gf.version
        tensors = [_Tensor(t.name, t.ggml_type, t.shape, t.n_bytes) for t in gf.tensors.values()]
        if "rope_freqs.weight" in gf.tensors and gguf_can_dequantize(gf.tensors["rope_freqs.weight"].ggml_type):
            t = gf.tensors["rope_freqs.weight"]  # the one tensor read: a few hundred bytes the config check needs
            rope_freqs = gguf.quants.dequantize(gf.view(t.name), gguf.GGMLQuantizationType(t.ggml_type))
    except InputError as e:
        try:
            version, meta, tensors = _list_gguf(path)
        except ModelFileError:
            raise e from None  # not even a listing: unreadable, with check_gguf's own line
        problems.append(Problem(UNUSABLE, "file_check", _where(e, str(path)), _line(e)))
    info = Inspection(path=str(path), format="gguf", file_bytes=path.stat().st_size, gguf_version=version)
    arch = meta.get("general.architecture")
    info.architecture = arch if isinstance(arch, str) else None
    info.name = _str_or_none(meta.get("general.name"))
    info.file_type = _file_type(meta.get("general.file_type"))
    info.tensor_types = _tensor_types((t.type_id, _type_name(t.type_id), t.shape, t.n_bytes) for t in tensors)
    _count_params(info, [(t.name, t.shape) for t in tensors], _str_or_none(meta.get("general.size_label")),
                  "general.size_label")
    problems += _type_problems(str(path), tensors)
    shapes = {t.name: t.shape for t in tensors}
    rows = shapes["token_embd.weight"][0] if len(shapes.get("token_embd.weight", ())) == 2 else None
    tokens = meta.get("tokenizer.ggml.tokens")
    cfg_meta = meta
    if isinstance(tokens, list) and rows is not None and len(tokens) != rows:
        problems.append(Problem(UNUSABLE, "vocab_mismatch", "tokenizer.ggml.tokens",
                                f"{path}: tokenizer.ggml.tokens has {len(tokens)} entries but token_embd.weight has "
                                f"{rows} rows: expected one row per token"))
        cfg_meta = {k: v for k, v in meta.items() if k != "tokenizer.ggml.tokens"}  # the rest is still checked
    cfg = None
    try:
        cfg = config_from_gguf(cfg_meta, shapes, str(path))
        if rope_freqs is not None:
            cfg = attach_rope_freqs(cfg, np.asarray(rope_freqs, dtype=np.float32).reshape(-1))
    except InputError as e:
        problems.append(Problem(UNUSABLE, "config", _where(e, "metadata"), _line(e)))
    if cfg is not None:
        _describe_config(info, cfg)
        problems += _tensor_problems(str(path), cfg, shapes, skip=())
        problems += _shared_kv_problems(cfg, shapes)
        if cfg.arch == "gemma4" and "gemma4.final_logit_softcapping" not in meta:
            problems.append(Problem(WARNING, "softcap_missing", "gemma4.final_logit_softcapping",
                                    f"{path}: key gemma4.final_logit_softcapping is missing: the file means no final "
                                    "softcap, llama.cpp applies 30 (its default), so llama.cpp's logits will differ"))
    info.tokenizer, tok_problems = _gguf_tokenizer(str(path), meta, info.architecture, rows)
    info.problems = problems + tok_problems
    return info, cfg


def _gguf_tokenizer(path: str, meta: Mapping[str, Any], arch: str | None, rows: int | None
                    ) -> tuple[dict[str, Any], list[Problem]]:
    model = _str_or_none(meta.get("tokenizer.ggml.model"))
    tokens = meta.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens) if isinstance(tokens, list) else None
    templates = sorted(k for k, v in meta.items() if k.startswith("tokenizer.chat_template") and isinstance(v, str)
                       and v.strip())
    tok = {"model": model, "tokens": n_tokens, "embedding_rows": rows,
           "bos_id": _int_or_none(meta.get("tokenizer.ggml.bos_token_id")),
           "eos_id": _int_or_none(meta.get("tokenizer.ggml.eos_token_id")),
           "pad_id": _int_or_none(meta.get("tokenizer.ggml.padding_token_id")),
           "chat_template": bool(templates), "chat_template_source": templates[0] if templates else None}
    problems = []
    expected = EXPECTED_TOKENIZER.get(arch or "")
    if model is None:
        problems.append(Problem(WARNING, "no_tokenizer", "tokenizer.ggml.model",
                                f"{path}: key tokenizer.ggml.model is missing: no tokenizer (token-id prompts only; "
                                "llama.cpp refuses the file)"))
    elif expected and model != expected:
        kind = " (SentencePiece)" if model == "llama" else ""
        problems.append(Problem(WARNING, "tokenizer_model", "tokenizer.ggml.model",
                                f"{path}: tokenizer.ggml.model = {model!r}{kind} in a {arch} file: expected "
                                f"{expected!r}; text tokenizes differently from the real model"))
    problems += _special_id_problems(path, tok, n_tokens, "tokenizer.ggml.{}_token_id",
                                     {"bos": "bos", "eos": "eos", "pad": "padding"})
    if not templates:
        problems.append(Problem(WARNING, "chat_template_missing", "tokenizer.chat_template",
                                f"{path}: key tokenizer.chat_template is missing: no chat template (chat prompts "
                                "need one from elsewhere)"))
    return tok, problems


def _special_id_problems(path: str, tok: Mapping[str, Any], n_tokens: int | None, key_fmt: str,
                         names: Mapping[str, str]) -> list[Problem]:
    out = []
    for short, long in names.items():
        tid = tok.get(f"{short}_id")
        if tid is not None and n_tokens is not None and not 0 <= tid < n_tokens:
            key = key_fmt.format(long)
            out.append(Problem(WARNING, "special_token_id", key, f"{path}: {key} = {tid}: expected an id below the "
                                                                 f"vocabulary size {n_tokens}"))
    return out


def _type_problems(path: str, tensors: list[_Tensor]) -> list[Problem]:
    """One unusable problem per tensor type ``gguf.quants`` cannot dequantize, naming its first tensor."""
    by_type: dict[int, list[str]] = {}
    for t in tensors:
        if not gguf_can_dequantize(t.type_id):
            by_type.setdefault(t.type_id, []).append(t.name)
    version = importlib.metadata.version("gguf")
    out = []
    for type_id, names in by_type.items():
        try:
            what = f"type {gguf.GGMLQuantizationType(type_id).name} (id {type_id}): gguf {version} has no dequantizer"
        except ValueError:
            known = f"; llama.cpp {LLAMA_CPP_PYTHON_VERSION} knows it" if type_id in LLAMACPP_TYPE_IDS else ""
            what = f"type id {type_id}, unknown to gguf {version} (a fork's type, or a newer llama.cpp's{known})"
        more = f" (and {len(names) - 1} more tensors)" if len(names) > 1 else ""
        out.append(Problem(UNUSABLE, "tensor_type", names[0], f"{path}: tensor {names[0]}{more}: {what}; expected a "
                                                              "type gguf.quants dequantizes"))
    return out


def _list_gguf(path: Path) -> tuple[int, dict[str, Any], list[_Tensor]]:
    """A plain listing of a GGUF header that :func:`check_gguf` refused: version, metadata, tensor table.

    Reads every field with bounds but checks nothing beyond that (not types, layout or padding), so the
    report can still show what the file holds. A tensor of a type id gguf does not know gets
    ``n_bytes`` None.

    Raises:
        ModelFileError: the header itself cannot be walked (not GGUF, cut short, a length past the end).
    """
    try:
        with open_regular(path, error=ModelFileError) as f:  # never a FIFO or a device: mapped
            size = os.fstat(f.fileno()).st_size
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read: {e.strerror or e}") from None
    pos = 0

    def take(n: int) -> int:
        nonlocal pos
        if n < 0 or pos + n > size:
            raise ModelFileError(f"{path}: header cut short at byte {pos}")
        pos += n
        return pos - n

    def scalar(fmt: str):
        return struct.unpack_from(fmt, buf, take(struct.calcsize(fmt)))[0]

    def string() -> str:
        n = scalar("<Q")
        return bytes(buf[take(n):pos]).decode("utf-8", errors="replace")

    fmts = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}

    def value(vtype: int):
        if vtype in fmts:
            return scalar(fmts[vtype])
        if vtype == 8:
            return string()
        if vtype != 9:
            raise ModelFileError(f"{path}: value type {vtype} at byte {pos}")
        etype, count = scalar("<I"), scalar("<Q")
        if etype == 8:
            if count * 8 > size - pos:
                raise ModelFileError(f"{path}: array of {count} strings at byte {pos} past the end")
            return [string() for _ in range(count)]
        if etype not in fmts:
            raise ModelFileError(f"{path}: array element type {etype} at byte {pos}")
        dt = np.dtype(fmts[etype].replace("?", "u1"))
        if count * dt.itemsize > size - pos:
            raise ModelFileError(f"{path}: array of {count} items at byte {pos} past the end")
        return np.frombuffer(buf, dtype=dt, count=count, offset=take(count * dt.itemsize)).tolist()

    if size < 4 or bytes(buf[:4]) != b"GGUF":
        raise ModelFileError(f"{path}: not a GGUF file")
    take(4)
    version, n_tensors, n_kv = scalar("<I"), scalar("<Q"), scalar("<Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        meta[key] = value(scalar("<I"))
    tensors = []
    for _ in range(n_tensors):
        name = string()
        n_dims = scalar("<I")
        if n_dims > 4:
            raise ModelFileError(f"{path}: tensor {name}: n_dims {n_dims}")
        dims = tuple(scalar("<Q") for _ in range(n_dims))
        type_id = scalar("<I")
        scalar("<Q")  # offset: not checked here
        try:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
            n_bytes = int(np.prod(dims, dtype=object)) // block * type_size
        except (ValueError, KeyError):
            n_bytes = None
        tensors.append(_Tensor(name, type_id, tuple(reversed(dims)), n_bytes))
    return version, meta, tensors


# --------------------------------------------------------------------------- HF


def _inspect_hf(path: Path) -> tuple[Inspection, ModelConfig | None]:
    raw = read_hf_config(path)
    cfg_path = path / "config.json"
    problems: list[Problem] = []
    files = sorted(path.glob("*.safetensors"))
    info = Inspection(path=str(path), format="hf", file_bytes=sum(f.stat().st_size for f in files))
    info.architecture = _str_or_none(raw.get("model_type"))
    info.name = _str_or_none(raw.get("_name_or_path")) or path.name
    if not files:
        problems.append(Problem(UNUSABLE, "file_check", str(path), f"{path}: no *.safetensors files"))
    stored: list[tuple[str, str, tuple[int, ...]]] = []  # (key, dtype, shape)
    canon: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="numpy") as h:
                for key in h.keys():
                    sl = h.get_slice(key)
                    stored.append((key, str(sl.get_dtype()), tuple(int(d) for d in sl.get_shape())))
        except Exception as e:  # safetensors raises its own error types for a damaged header
            problems.append(Problem(UNUSABLE, "file_check", str(f), f"{f}: cannot read the safetensors header "
                                                                   f"({_line(e)[:120]})"))
            continue
    for key, _, shape in stored:
        name = hf_to_gguf(key)
        if name is None:
            continue
        if name in canon:
            problems.append(Problem(UNUSABLE, "tensors", key, f"{path}: tensor {key} maps to {name}, which another "
                                                              "tensor already provides"))
        canon[name] = shape
    info.tensor_types = _tensor_types(
        (None, dtype, shape, int(np.prod(shape, dtype=object)) * SAFETENSORS_BYTES[dtype]
         if dtype in SAFETENSORS_BYTES else None) for _, dtype, shape in stored)
    _count_params(info, [(hf_to_gguf(k) or k, s) for k, _, s in stored], None, None)
    cfg = None
    try:
        cfg = config_from_hf(raw, str(cfg_path))
    except InputError as e:
        problems.append(Problem(UNUSABLE, "config", _where(e, "config.json"), _line(e)))
    rows = canon["token_embd.weight"][0] if len(canon.get("token_embd.weight", ())) == 2 else None
    skip: tuple[str, ...] = ()
    if cfg is not None:
        _describe_config(info, cfg)
        if rows is not None and rows != cfg.vocab_size:
            problems.append(Problem(UNUSABLE, "vocab_mismatch", "vocab_size",
                                    f"{cfg_path}: vocab_size = {cfg.vocab_size} but the embedding table has {rows} "
                                    "rows: expected one row per token"))
            skip = ("token_embd.weight", "output.weight")
        if files:
            problems += _tensor_problems(str(path), cfg, canon, skip=skip)
        problems += _shared_kv_problems(cfg, canon)
    info.tokenizer, tok_problems = _hf_tokenizer(path, raw, cfg, rows)
    info.problems = problems + tok_problems
    return info, cfg


def _hf_tokenizer(path: Path, raw: Mapping[str, Any], cfg: ModelConfig | None, rows: int | None
                  ) -> tuple[dict[str, Any], list[Problem]]:
    tok_json, tok_cfg = path / "tokenizer.json", path / "tokenizer_config.json"
    model = None
    n_tokens = None
    sources = []
    if tok_json.is_file():
        data = _read_json(tok_json)
        m = data.get("model") if isinstance(data, dict) else None
        if isinstance(m, dict):
            model = _str_or_none(m.get("type"))
            vocab = m.get("vocab")
            ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab))) \
                if isinstance(vocab, list) else []
            ids += [a.get("id") for a in data.get("added_tokens") or [] if isinstance(a, dict)]
            ids = [i for i in ids if isinstance(i, int)]
            n_tokens = max(ids) + 1 if ids else None
            sources.append("tokenizer.json")
    if model is None and (path / "tokenizer.model").is_file():
        model, sources = "sentencepiece", ["tokenizer.model"]
    template_source = None
    tc = _read_json(tok_cfg) if tok_cfg.is_file() else {}
    if isinstance(tc, dict) and tc.get("chat_template"):
        template_source = "tokenizer_config.json"
    for name in ("chat_template.jinja", "chat_template.json"):
        if template_source is None and (path / name).is_file() and (path / name).stat().st_size:
            template_source = name
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    ids = {k: (getattr(cfg, f"{k}_token_id") if cfg is not None else text.get(f"{k}_token_id"))
           for k in ("bos", "eos", "pad")}
    tok = {"model": model, "tokens": n_tokens, "embedding_rows": rows,
           "bos_id": _int_or_none(ids["bos"]), "eos_id": _int_or_none(ids["eos"]), "pad_id": _int_or_none(ids["pad"]),
           "chat_template": template_source is not None, "chat_template_source": template_source}
    problems = []
    if model is None:
        problems.append(Problem(WARNING, "no_tokenizer", str(tok_json),
                                f"{path}: no tokenizer.json or tokenizer.model: no tokenizer (token-id prompts only)"))
    if n_tokens is not None and rows is not None and n_tokens > rows:
        problems.append(Problem(UNUSABLE, "vocab_mismatch", str(tok_json),
                                f"{tok_json}: {n_tokens} token ids but the embedding table has {rows} rows: expected "
                                "at most one token per row"))
    problems += _special_id_problems(str(path / "config.json"), tok, rows, "{}_token_id",
                                     {"bos": "bos", "eos": "eos", "pad": "pad"})
    if template_source is None:
        problems.append(Problem(WARNING, "chat_template_missing", str(tok_cfg),
                                f"{path}: no chat template (tokenizer_config.json chat_template, chat_template.jinja "
                                "or chat_template.json)"))
    return tok, problems


def _read_json(p: Path) -> Any:
    try:
        return read_json(p, streams=False)  # a regular file only: a FIFO in the folder never blocks the inspection
    except InputError:
        return {}


# --------------------------------------------------------------------------- shared by both formats


def _describe_config(info: Inspection, cfg: ModelConfig) -> None:
    info.model = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "n_layer": cfg.n_layer,
                  "sliding_window": cfg.sliding_window, "context_length": cfg.context_length,
                  "final_logit_softcap": cfg.final_logit_softcap, "ple_dim": cfg.ple_dim,
                  "n_kv_shared": cfg.n_kv_shared, "n_expert": cfg.n_expert, "n_expert_used": cfg.n_expert_used,
                  "n_ff_exp": cfg.n_ff_exp, "tie_word_embeddings": cfg.tie_word_embeddings}
    info.layers = [{"index": L.index, "type": "sliding" if L.is_sliding else "full", "head_dim": L.head_dim,
                    "n_head": L.n_head, "n_kv_head": L.n_kv_head,
                    "kv_donor": None if L.has_kv else L.kv_donor, "has_v_proj": L.has_v_proj, "n_ff": L.n_ff,
                    "moe": {"experts": cfg.n_expert, "top_k": cfg.n_expert_used, "n_ff_exp": cfg.n_ff_exp}
                    if L.has_moe else None} for L in cfg.layers]


def _tensor_types(items: Iterable[tuple[int | None, str, tuple[int, ...], int | None]]) -> list[TensorType]:
    acc: dict[str, list] = {}
    for type_id, name, shape, n_bytes in items:
        a = acc.setdefault(name, [type_id, 0, 0, 0])
        a[1] += 1
        a[2] += int(np.prod(shape, dtype=object))
        a[3] = None if a[3] is None or n_bytes is None else a[3] + n_bytes
    out = [TensorType(name, a[0], a[1], a[2], a[3]) for name, a in acc.items()]
    return sorted(out, key=lambda t: -(t.bytes if t.bytes is not None else t.elements))


def _count_params(info: Inspection, tensors: list[tuple[str, tuple[int, ...]]], label: str | None,
                  label_key: str | None) -> None:
    """Parameter count and size label, counted as gguf's writer does (``GGUFWriter.get_total_parameter_count``:
    an ``*_exps.*`` tensor of 3 dims is ``n_expert`` experts), labelled with ``gguf.utility.size_label``."""
    total = shared = expert = expert_sum = n_exp_tensors = 0
    for name, shape in tensors:
        size = int(np.prod(shape, dtype=object))
        total += size
        if "_exps." in name and len(shape) >= 3:
            expert += size // shape[-3]
            expert_sum += shape[-3]
            n_exp_tensors += 1
        else:
            shared += size
    n_expert = expert_sum // n_exp_tensors if n_exp_tensors else 0
    info.n_params = total
    info.n_expert_params = expert * n_expert
    if label:
        info.size_label, info.size_label_source = label, label_key
    elif total:
        info.size_label = gguf.utility.size_label(total, shared, expert, n_expert)
        info.size_label_source = "computed"


def _tensor_problems(source: str, cfg: ModelConfig, shapes: Mapping[str, tuple[int, ...]], skip: tuple[str, ...]
                     ) -> list[Problem]:
    """The loader's tensor checks, from the tensor table: missing, mis-shaped, unread decoder tensors."""
    expected, optional = expected_tensors(cfg), optional_tensors(cfg)
    missing = [n for n in expected if n not in shapes and n not in optional and n not in skip]
    wrong = [n for n, s in expected.items() if n in shapes and n not in skip and tuple(shapes[n]) != tuple(s)]
    unread = unread_tensors(cfg, shapes)
    out = []

    def more(names):
        return f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    if missing:
        n = missing[0]
        out.append(Problem(UNUSABLE, "tensors", n, f"{source}: missing tensor {n}{more(missing)} (expected shape "
                                                   f"{list(expected[n])})"))
    if wrong:
        n = wrong[0]
        out.append(Problem(UNUSABLE, "tensors", n, f"{source}: tensor {n}{more(wrong)} has shape {list(shapes[n])}, "
                                                   f"expected {list(expected[n])}"))
    if unread:
        n = unread[0]
        out.append(Problem(UNUSABLE, "tensors", n, f"{source}: tensor {n}{more(unread)} is not one this {cfg.arch} "
                                                   "config reads (a misspelt or damaged name, or keys that do not "
                                                   "match the tensors)"))
    return out


def shared_kv_tensors(cfg: ModelConfig, names: Iterable[str]) -> list[str]:
    """The ``attn_k`` / ``attn_k_norm`` / ``attn_v`` tensors of KV-shared layers among ``names`` (canonical):
    shipped, but read by no engine (a shared layer reads its donor's cache). Sorted by layer."""
    have = set(names)
    return [f"blk.{L.index}.{s}" for L in cfg.layers if not L.has_kv for s in _SHARED_KV
            if f"blk.{L.index}.{s}" in have]


def compact_names(names: list[str]) -> str:
    """``blk.15-19.attn_k.weight, blk.15.attn_v.weight``: names grouped by suffix, layer runs as ranges."""
    groups: dict[str, list[int]] = {}
    other = []
    for n in names:
        m = re.match(r"^blk\.(\d+)\.(.+)$", n)
        if m:
            groups.setdefault(m.group(2), []).append(int(m.group(1)))
        else:
            other.append(n)
    parts = []
    for suffix, layers in groups.items():
        layers = sorted(set(layers))
        runs, start = [], layers[0]
        for a, b in zip(layers, layers[1:] + [None]):
            if b != a + 1:
                runs.append(str(start) if start == a else f"{start}-{a}")
                start = b
        parts += [f"blk.{r}.{suffix}" for r in runs]
    return ", ".join(parts + other)


def _shared_kv_problems(cfg: ModelConfig, names: Iterable[str]) -> list[Problem]:
    found = shared_kv_tensors(cfg, names)
    if not found:
        return []
    return [Problem(WARNING, "shared_kv_tensors", found[0],
                    f"{cfg.source}: {len(found)} K/V tensors of KV-shared layers that no engine reads (each shared "
                    f"layer reads its donor's cache): {compact_names(found)}")]


# --------------------------------------------------------------------------- engines


def llamacpp_donors(cfg: ModelConfig) -> dict[int, int]:
    """The layer whose KV cache llama.cpp gives each KV-shared layer of a gemma4 model.

    llama.cpp's rule (``llama-model.cpp``, the ``reuse`` callback for LLM_ARCH_GEMMA4): with
    ``n_kv = n_layer - shared_kv_layers``, a layer ``il >= n_kv`` reuses layer ``n_kv - 2`` when it is a
    sliding layer, else ``n_kv - 1``. Its sliding and full layers live in two caches
    (``llama_kv_cache_iswa``), so a donor of the other type is not found and llama.cpp aborts
    (``GGML_ASSERT(map_layer_ids.find(il_reuse) != ...)``, ``llama-kv-cache.cpp``; seen on the built-in
    case ``edge-keqv-shared-donor``). transformers' rule (the last non-shared layer of the same type,
    :func:`reference.config.kv_donors`) is the tie-breaker; the two agree on the usual layouts.

    Returns:
        shared layer index -> llama.cpp's donor (empty without shared layers).
    """
    n_kv = cfg.n_layer - cfg.n_kv_shared
    return {L.index: n_kv - (2 if L.is_sliding else 1) for L in cfg.layers if L.index >= n_kv}


CARRY_DTYPES = ("float32", "bfloat16", "float16")
"""The fast engine's compute dtypes whose carry limits :func:`weight_problems` checks."""


def weight_problems(path: Path) -> list[Problem]:
    """The weights' values, read once: ``weights`` (unusable: NaN, Inf or a magnitude no matmul holds,
    :func:`reference.weight_check.check_weights`) or, per fast compute dtype, ``weight_not_carried`` (a warning:
    a weight that dtype holds but cannot carry through the ops after it, :func:`fast.carry.carry_problems`; GGUF
    quantized matrices counted packed, as the fast engine keeps them by default)."""
    try:
        cfg, W = load_model(path, cache_bytes=0)
        bounds = check_weights(W, MAX_ABS_FP32)
    except InputError as e:
        return [Problem(UNUSABLE, "weights", _where(e, str(path)), _line(e))]
    out = []
    for dtype in CARRY_DTYPES:
        if dtype == "float16":
            try:
                bounds = check_weights(W, MAX_ABS_FP16)
            except InputError as e:
                out.append(Problem(WARNING, "weight_not_carried", _where(e, str(path)), f"{_line(e)} (float16)"))
                continue

        def held(name: str, dtype=dtype) -> str:
            packed = len(W.shape(name)) == 2 and W.stored(name) is not None and \
                W.raw_dtype(name) not in ("F32", "F16", "BF16")
            return "float32" if len(W.shape(name)) == 1 or packed else dtype

        for p in carry_problems(cfg, W, bounds, dtype, held):
            out.append(Problem(WARNING, "weight_not_carried", p.tensor, p.line(str(path))))
    return out


def _note_carry(info: Inspection) -> None:
    """On each fast row, how many weights its dtype cannot carry (the ``weight_not_carried`` problems)."""
    for row in info.engines:
        n = sum(1 for p in info.problems if p.code == "weight_not_carried"
                and (f" {row.dtype} cannot carry" in p.message or p.message.endswith(f"({row.dtype})")))
        if row.engine == "fast" and row.can_run and n:
            row.notes.append(f"{n} weight(s) {row.dtype} cannot carry: expect wrong or non-finite output (problems)")


def engine_rows(info: Inspection, cfg: ModelConfig | None) -> list[EngineRow]:
    """One row per engine setting: whether it can run the file, why not, and the differences it will show.

    Args:
        info: the inspection so far (format, tensor types, problems).
        cfg: the model config (None when it could not be built).

    Returns:
        ``reference``; ``fast`` per dtype (and per weight mode for a GGUF); ``transformers``; ``llamacpp``.
    """
    gguf_file = info.format == "gguf"
    fast_settings = [(d, w) for d in FAST_DTYPES for w in (FAST_WEIGHT_MODES if gguf_file else (None,))]
    rows = [EngineRow("reference", "float64", None, True)]
    rows += [EngineRow("fast", d, w, True) for d, w in fast_settings]
    rows += [EngineRow("transformers", "float32", None, True), EngineRow("llamacpp", "stored", None, True)]
    bad = next((p for p in info.problems if p.severity == UNUSABLE), None)
    if bad is not None:
        for r in rows:
            r.can_run, r.reason = False, f"the file is unusable ({bad.code}: {bad.where})"
        return rows
    fast_bad = [t for t in info.tensor_types if gguf_file and t.type not in FAST_TYPES]
    for r in rows:
        if r.engine == "fast" and fast_bad:
            r.can_run = False
            r.reason = (f"{fast_bad[0].count} tensors of type {fast_bad[0].type}: fast dequantization decodes "
                        f"{', '.join(sorted(FAST_TYPES))} only")
        elif r.engine == "transformers" and gguf_file and info.architecture != "gemma3":
            r.can_run = False
            r.reason = "transformers needs an HF model folder for a Gemma 4 model (it cannot read a Gemma 4 GGUF)"
        elif r.engine == "llamacpp":
            r.can_run, r.reason, r.notes = _llamacpp_row(info, cfg)
    return rows


def _llamacpp_row(info: Inspection, cfg: ModelConfig | None) -> tuple[bool, str | None, list[str]]:
    if info.format != "gguf":
        return False, "llama.cpp needs a GGUF file", []
    if importlib.util.find_spec("llama_cpp") is None:
        return False, INSTALL_MSG, []
    unknown = [t.type for t in info.tensor_types if t.type_id not in LLAMACPP_TYPE_IDS]
    if unknown:
        return False, f"type {unknown[0]} is not one llama.cpp {LLAMA_CPP_PYTHON_VERSION}'s ggml reads", []
    if info.tokenizer.get("model") is None:
        return False, "no tokenizer.ggml.model key: llama.cpp's vocabulary loader needs one", []
    notes = []
    if cfg is not None and cfg.arch == "gemma4":
        n_kv = cfg.n_layer - cfg.n_kv_shared
        if n_kv < 2:
            return False, (f"{n_kv} non-shared layer(s): llama.cpp asserts n_layer_kv_from_start >= 2 for gemma4 "
                           "and aborts"), []
        if not any(L.is_sliding for L in cfg.layers):
            return False, "no sliding layer: llama.cpp asserts one for gemma4 (its iSWA cache) and aborts", []
        for il, d in llamacpp_donors(cfg).items():
            L, D, T = cfg.layers[il], cfg.layers[d], cfg.layers[il].kv_donor
            if D.is_sliding != L.is_sliding:
                kind = {True: "sliding", False: "full"}
                return False, (f"llama.cpp's KV donor rule gives {kind[L.is_sliding]} shared layer {il} the cache of "
                               f"{kind[D.is_sliding]} layer {d} (transformers: layer {T}); its sliding and full caches "
                               "are apart, so it aborts (GGML_ASSERT in llama-kv-cache.cpp)"), []
            if (D.head_dim, D.n_kv_head) != (L.head_dim, L.n_kv_head):
                return False, (f"llama.cpp's KV donor rule gives shared layer {il} (head_dim {L.head_dim}, "
                               f"{L.n_kv_head} KV heads) the cache of layer {d} (head_dim {D.head_dim}, "
                               f"{D.n_kv_head} KV heads; transformers: layer {T}): the shapes differ"), []
            if d != T:
                notes.append(f"shared layer {il} reads layer {d}'s KV cache in llama.cpp, layer {T}'s in "
                             "transformers: its output differs")
        if cfg.final_logit_softcap is None:
            notes.append("applies a final softcap of 30 (its default) where the file has none")
    return True, None, notes


# --------------------------------------------------------------------------- small helpers


def _line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


_NAMED = re.compile(r"\b((?:general|tokenizer|gemma3|gemma4)\.[\w.]*\w"  # a key
                    r"|blk\.\d+\.\w+(?:\.\w+)?|[a-z_]+\.(?:weight|scale))\b")  # a tensor


def _where(e: BaseException, default: str) -> str:
    """The first GGUF key or tensor name a message names (best effort), else ``default``."""
    m = _NAMED.search(str(e).split(": ", 1)[-1])
    return m.group(1) if m else default


def _str_or_none(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _int_or_none(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else None


def _file_type(v: Any) -> str | None:
    """``general.file_type`` as llama.cpp names it without the ``MOSTLY_``/``ALL_`` prefix (``Q8_0``, ``Q4_K_M``)."""
    if not isinstance(v, int) or isinstance(v, bool):
        return None
    try:
        return gguf.LlamaFileType(v).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return f"file type {v}"
