"""Tokenizer files read into GGUF-style metadata, so :class:`reference.tokenizer.GGUFTokenizer` runs on any.

* :func:`tokenizer_kind`: a path is a GGUF (``.gguf``), a HF ``tokenizer.json``, or a SentencePiece
  ``tokenizer.model``;
* :func:`load_tokenizer_metadata`: the ``tokenizer.ggml.*`` keys of any of them;
  :func:`metadata_from_tokenizer_json` (HF ``tokenizers`` BPE with byte fallback, as Gemma ships it) and
  :func:`metadata_from_sentencepiece` (the ``ModelProto`` read field by field: pieces, scores, types).

Sources: the field numbers of sentencepiece's ``sentencepiece_model.proto``; the token types as llama.cpp's
``convert_hf_to_gguf.py`` writes them for Gemma. No code taken from either.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gemma4_harness.reference import files
from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.files import open_regular
from gemma4_harness.reference.tokenizer import BYTE, CONTROL, NORMAL, SPACE, USER_DEFINED, read_gguf_metadata

MAX_TOKENIZER_BYTES = 1 << 30
"""The most a tokenizer file may hold (1 GiB; Gemma's tokenizer.json is 33 MB)."""

BYTE_TOKEN_RE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
"""A byte-fallback token's text (``<0x0A>``)."""


# --------------------------------------------------------------------------- file kinds


def tokenizer_kind(path: str | os.PathLike) -> str:
    """``"gguf"``, ``"json"`` (HF ``tokenizer.json``) or ``"spm"`` (SentencePiece ``.model``).

    Decided by the first bytes (``GGUF`` magic, ``{``), else by the suffix.

    Raises:
        InputError: the file is missing or unreadable, or is none of the three.
    """
    p = Path(path)
    try:
        with open_regular(p, max_bytes=MAX_TOKENIZER_BYTES) as f:  # a regular file: never a FIFO or a device
            head = f.read(64)
    except InputError as e:
        raise InputError(f"{e} (a tokenizer file)") from None
    except OSError as e:
        raise InputError(f"{p}: cannot read tokenizer file ({e.strerror or e})") from None
    if head[:4] == b"GGUF":
        return "gguf"
    if head.lstrip()[:1] == b"{":
        return "json"
    if p.suffix == ".model" and head[:1] == b"\x0a":  # protobuf: field 1, length-delimited
        return "spm"
    raise InputError(f"{p}: not a tokenizer file (expected a .gguf, a tokenizer.json or a SentencePiece .model)")


def load_tokenizer_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """GGUF-style tokenizer metadata of a ``.gguf``, a ``tokenizer.json`` or a ``tokenizer.model``.

    Raises:
        InputError: see :func:`tokenizer_kind`, :func:`metadata_from_tokenizer_json`,
            :func:`metadata_from_sentencepiece`; ModelFileError for a bad GGUF.
    """
    kind = tokenizer_kind(path)
    if kind == "gguf":
        return read_gguf_metadata(path)
    if kind == "json":
        return metadata_from_tokenizer_json(path)
    return metadata_from_sentencepiece(path)


# --------------------------------------------------------------------------- tokenizer.json -> metadata


def read_json(path: str | os.PathLike) -> dict:
    doc = files.read_json(path, max_bytes=MAX_TOKENIZER_BYTES, streams=False)
    if not isinstance(doc, dict) or not isinstance(doc.get("model"), dict):
        raise InputError(f"{path}: not a tokenizers file (no 'model' object)")
    return doc


def _is_space_escape(norm: Any) -> bool:
    """True for ``Replace(" ", "▁")`` alone or as the only member of a ``Sequence``."""
    if not isinstance(norm, dict):
        return False
    if norm.get("type") == "Sequence" and len(norm.get("normalizers") or []) == 1:
        norm = norm["normalizers"][0]
    return (norm.get("type") == "Replace" and norm.get("pattern") == {"String": " "}
            and norm.get("content") == SPACE)


def metadata_from_tokenizer_json(path: str | os.PathLike) -> dict[str, Any]:
    """A Gemma-style ``tokenizer.json`` -> ``gemma4``-type GGUF tokenizer metadata.

    The mapping follows llama.cpp's ``LlamaHfVocab`` + ``Gemma4Model.set_vocab``
    with one change taken from transformers' GGUF conversion: an added token
    that is not special becomes user-defined (type 4), so that it is matched in
    text as HF matches it. Special added tokens become control (type 3),
    ``<0xHH>`` byte (type 6), the rest normal. Scores are -1000.0.

    Raises:
        InputError: not a BPE model with ``byte_fallback``; a normalizer other
            than ``Replace(" ", "▁")``; ids not contiguous; a token containing a
            space (GGUF merges are space-separated).
    """
    doc = read_json(path)
    model = doc["model"]
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        raise InputError(f"{path}: model type {model.get('type')!r} (byte_fallback={model.get('byte_fallback')}): "
                         "expected a BPE model with byte_fallback (Gemma)")
    if not _is_space_escape(doc.get("normalizer")):
        raise InputError(f"{path}: normalizer {json.dumps(doc.get('normalizer'))[:80]}: expected Replace(' ', '▁')")
    vocab: dict[str, int] = model.get("vocab") or {}
    by_id: dict[int, str] = {i: t for t, i in vocab.items()}
    added = {int(a["id"]): a for a in doc.get("added_tokens") or []}
    for i, a in added.items():
        by_id.setdefault(i, a["content"])
    n = max(by_id) + 1 if by_id else 0
    missing = [i for i in range(n) if i not in by_id]
    if missing:
        raise InputError(f"{path}: token ids are not contiguous (first missing id {missing[0]})")
    tokens = [by_id[i] for i in range(n)]
    types = []
    for i, t in enumerate(tokens):
        a = added.get(i)
        if a is not None and a.get("content") == t:
            types.append(CONTROL if a.get("special") else USER_DEFINED)
        elif BYTE_TOKEN_RE.fullmatch(t):
            types.append(BYTE)
        else:
            types.append(NORMAL)
    merges = []
    for m in model.get("merges") or []:
        pair = m.split(" ", 1) if isinstance(m, str) else list(m)
        if len(pair) != 2 or " " in pair[0] or " " in pair[1]:
            raise InputError(f"{path}: merge {m!r} cannot be written as a GGUF merge (tokens with spaces)")
        merges.append(f"{pair[0]} {pair[1]}")
    ids = {t: i for i, t in reversed(list(enumerate(tokens)))}
    meta: dict[str, Any] = {
        "general.architecture": "gemma4",
        "tokenizer.ggml.model": "gemma4",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [-1000.0] * n,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.ggml.add_bos_token": _post_processor_adds_bos(doc),
    }
    for key, names in (("bos_token_id", ("<bos>", "<s>")), ("eos_token_id", ("<eos>", "</s>")),
                       ("padding_token_id", ("<pad>",)), ("unknown_token_id", (model.get("unk_token"),))):
        for name in names:
            if name in ids:
                meta[f"tokenizer.ggml.{key}"] = ids[name]
                break
    return meta


def _post_processor_adds_bos(doc: Mapping[str, Any]) -> bool:
    """True when the post-processor's single-sequence template starts with a special token."""
    pp = doc.get("post_processor") or {}
    procs = pp.get("processors", [pp]) if pp.get("type") == "Sequence" else [pp]
    for p in procs:
        if p.get("type") == "TemplateProcessing":
            single = p.get("single") or []
            return bool(single) and "SpecialToken" in single[0]
    return False


# --------------------------------------------------------------------------- tokenizer.model -> metadata


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def _proto_fields(buf: bytes):
    """Yield ``(field, wire_type, value)`` of one protobuf message (value: int, bytes or float bits)."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            length, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + length], pos + length
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield field, wire, value


def metadata_from_sentencepiece(path: str | os.PathLike) -> dict[str, Any]:
    """A SentencePiece ``tokenizer.model`` -> ``llama``-type GGUF tokenizer metadata.

    Pieces, scores and types are read from the ``ModelProto`` directly (field
    numbers from sentencepiece ``sentencepiece_model.proto``: ``pieces`` = 1
    {``piece`` 1, ``score`` 2, ``type`` 3}, ``normalizer_spec`` = 3
    {``add_dummy_prefix`` 3}), as llama.cpp's ``SentencePieceVocab`` does; the
    special ids come from ``sentencepiece`` itself. Space runs stay ``▁`` runs
    (a GGUF converter may store them as spaces; both tokenize alike).

    Raises:
        InputError: the file cannot be read or parsed, or ``sentencepiece`` is
            not installed.
    """
    try:
        import sentencepiece as spm  # lazy: only to read a tokenizer.model
    except ImportError:
        raise InputError("sentencepiece is not installed: pip install sentencepiece") from None
    try:
        data = files.read_bytes(path, max_bytes=MAX_TOKENIZER_BYTES, streams=False)
        pieces: list[str] = []
        scores: list[float] = []
        types: list[int] = []
        add_dummy_prefix = True
        for field, wire, value in _proto_fields(data):
            if field == 1 and wire == 2:
                piece, score, ptype = "", 0.0, NORMAL
                for f2, w2, v2 in _proto_fields(value):
                    if f2 == 1 and w2 == 2:
                        piece = v2.decode("utf-8")
                    elif f2 == 2 and w2 == 5:
                        score = struct.unpack("<f", v2)[0]
                    elif f2 == 3 and w2 == 0:
                        ptype = int(v2)
                pieces.append(piece)
                scores.append(score)
                types.append(ptype)
            elif field == 3 and wire == 2:
                for f2, w2, v2 in _proto_fields(value):
                    if f2 == 3 and w2 == 0:
                        add_dummy_prefix = bool(v2)
        sp = spm.SentencePieceProcessor(model_file=str(path))
    except (OSError, ValueError, IndexError, UnicodeDecodeError, RuntimeError) as e:
        raise InputError(f"{path}: not a readable SentencePiece model ({e})") from None
    if not pieces or sp.vocab_size() != len(pieces):
        raise InputError(f"{path}: SentencePiece model with {len(pieces)} pieces (sentencepiece reads {sp.vocab_size()})")
    meta: dict[str, Any] = {
        "general.architecture": "gemma3",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.add_space_prefix": add_dummy_prefix,
        "tokenizer.ggml.add_bos_token": True,
    }
    for key, i in (("bos_token_id", sp.bos_id()), ("eos_token_id", sp.eos_id()),
                   ("unknown_token_id", sp.unk_id()), ("padding_token_id", sp.pad_id())):
        if i >= 0:
            meta[f"tokenizer.ggml.{key}"] = int(i)
    return meta
