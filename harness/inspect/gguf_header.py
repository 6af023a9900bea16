"""A GGUF file from its header alone: metadata, tensor table, tokenizer keys, and their problems.

:func:`reference.gguf_check.check_gguf` reads the header; when it refuses the file but the header can still be
walked, :func:`_list_gguf` lists it plainly so that the report is still filled. Only the tiny ``rope_freqs``
table is read from the data, for the config check.
"""

from __future__ import annotations

import functools
import importlib.metadata
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import gguf
import numpy as np

from gemma4_harness.reference.config import ModelConfig
from gemma4_harness.reference.config_gguf import attach_rope_freqs, config_from_gguf
from gemma4_harness.reference.errors import InputError, ModelFileError
from gemma4_harness.reference.files import open_regular
from gemma4_harness.reference.gguf_check import check_gguf

from ..engines.llamacpp import LLAMA_CPP_PYTHON_VERSION
from .common import (
    count_params,
    describe_config,
    int_or_none,
    named_in,
    one_line,
    shared_kv_problems,
    special_id_problems,
    str_or_none,
    tensor_problems,
    tensor_types,
)
from .model import UNUSABLE, WARNING, Inspection, Problem
from .runnable import LLAMACPP_TYPE_IDS

#: Tokenizer model each architecture's files are expected to declare.
EXPECTED_TOKENIZER = {"gemma4": "gemma4", "gemma3": "llama"}


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


def inspect_gguf(path: Path) -> tuple[Inspection, ModelConfig | None]:
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
        problems.append(Problem(UNUSABLE, "file_check", named_in(e, str(path)), one_line(e)))
    info = Inspection(path=str(path), format="gguf", file_bytes=path.stat().st_size, gguf_version=version)
    arch = meta.get("general.architecture")
    info.architecture = arch if isinstance(arch, str) else None
    info.name = str_or_none(meta.get("general.name"))
    info.file_type = file_type_name(meta.get("general.file_type"))
    info.tensor_types = tensor_types((t.type_id, _type_name(t.type_id), t.shape, t.n_bytes) for t in tensors)
    count_params(info, [(t.name, t.shape) for t in tensors], str_or_none(meta.get("general.size_label")),
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
        problems.append(Problem(UNUSABLE, "config", named_in(e, "metadata"), one_line(e)))
    if cfg is not None:
        describe_config(info, cfg)
        problems += tensor_problems(str(path), cfg, shapes, skip=())
        problems += shared_kv_problems(cfg, shapes)
        if cfg.arch == "gemma4" and "gemma4.final_logit_softcapping" not in meta:
            problems.append(Problem(WARNING, "softcap_missing", "gemma4.final_logit_softcapping",
                                    f"{path}: key gemma4.final_logit_softcapping is missing: the file means no final "
                                    "softcap, llama.cpp applies 30 (its default), so llama.cpp's logits will differ"))
    info.tokenizer, tok_problems = _gguf_tokenizer(str(path), meta, info.architecture, rows)
    info.problems = problems + tok_problems
    return info, cfg


def _gguf_tokenizer(path: str, meta: Mapping[str, Any], arch: str | None, rows: int | None
                    ) -> tuple[dict[str, Any], list[Problem]]:
    model = str_or_none(meta.get("tokenizer.ggml.model"))
    tokens = meta.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens) if isinstance(tokens, list) else None
    templates = sorted(k for k, v in meta.items() if k.startswith("tokenizer.chat_template") and isinstance(v, str)
                       and v.strip())
    tok = {"model": model, "tokens": n_tokens, "embedding_rows": rows,
           "bos_id": int_or_none(meta.get("tokenizer.ggml.bos_token_id")),
           "eos_id": int_or_none(meta.get("tokenizer.ggml.eos_token_id")),
           "pad_id": int_or_none(meta.get("tokenizer.ggml.padding_token_id")),
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
    problems += special_id_problems(path, tok, n_tokens, "tokenizer.ggml.{}_token_id",
                                     {"bos": "bos", "eos": "eos", "pad": "padding"})
    if not templates:
        problems.append(Problem(WARNING, "chat_template_missing", "tokenizer.chat_template",
                                f"{path}: key tokenizer.chat_template is missing: no chat template (chat prompts "
                                "need one from elsewhere)"))
    return tok, problems




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


def file_type_name(v: Any) -> str | None:
    """``general.file_type`` as llama.cpp names it without the ``MOSTLY_``/``ALL_`` prefix (``Q8_0``, ``Q4_K_M``)."""
    if not isinstance(v, int) or isinstance(v, bool):
        return None
    try:
        return gguf.LlamaFileType(v).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return f"file type {v}"
