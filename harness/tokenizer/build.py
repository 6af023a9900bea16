"""Tokenizer files for the tests: a ``gemma4``-type vocabulary built from the real Gemma 3 one.

No Gemma 4 vocabulary can be had offline, so :func:`build_gemma4_test_tokenizer`
builds one that has Gemma 4's *shape* on a real 262,144-token vocabulary:

* tokens, merges (514,906, in rank order) and byte tokens from the real Gemma 3
  ``tokenizer.json`` (derived from the ``tokenizer.model`` carried in ``cases/data/gemma3-tokenizer/``);
* Gemma 4's special tokens written over Gemma 3 placeholders, at the ids real
  Gemma 4 files use (:data:`GEMMA4_SPECIALS`; every one of them is an
  ``<unusedN>`` slot in Gemma 3, except 105/106 and 255999/256000, which were
  Gemma 3's turn and image markers);
* token types the way llama.cpp's ``Gemma4Model.set_vocab`` writes them: the
  seven markers a chat parser must see (``<|channel>``, ``<channel|>``,
  ``<|tool_call>``, ``<tool_call|>``, ``<|tool_response>``,
  ``<tool_response|>``, ``<|"|>``) are user-defined (type 4), the other
  specials are control (type 3), ``<0xHH>`` are byte (type 6). One deliberate
  difference: the remaining placeholders (``<unusedN>``, ``<mask>``,
  ``[multimodal]``) are control here, so that the GGUF and the
  ``tokenizer.json`` agree on what text can produce (a real Gemma 4 GGUF marks
  them normal; :mod:`harness.tokenizer.checks` shows what that changes);
* scores: -1000.0 for every token, as llama.cpp's ``LlamaHfVocab`` writes them
  (``gemma4`` tokenization ranks merges, it never reads scores);
* ``tokenizer.ggml.model = "gemma4"``, BOS 2, EOS 1, EOT 106, unknown 3,
  padding 0, ``add_bos_token`` true, ``add_space_prefix`` false, and a chat
  template (``cases/tokenizer/gemma4_chat_template.jinja``).

The matching ``tokenizer.json`` (HF ``tokenizers``) holds the same vocabulary
and merges: BPE with ``byte_fallback``, normalizer ``Replace(" ", "▁")``,
pre-tokenizer ``Split(Regex("\\n+"), "isolated")`` (runs of newlines split off),
decoder ``Replace("▁", " ")`` + ``ByteFallback`` + ``Fuse``, a post-processor
that puts ``<bos>`` in front, and as added tokens exactly the GGUF's control
tokens (``special: true``) and user-defined tokens (``special: false``, as
transformers' own GGUF conversion adds them), all ``normalized: false``.

Both files are written deterministically (same bytes for the same source)
under ``<cache>/tok/gemma4-test-<hash>/`` where ``<cache>`` is
:func:`harness.core.paths.cache_root` (``$G4H_CACHE``, else the user cache
directory ``~/.cache/gemma4-harness``); the hash covers the source file, the template and
:data:`BUILDER_VERSION`. Writes go through a temporary name and ``os.replace``.

The other tokenizer files are read into GGUF-style metadata by :mod:`harness.tokenizer.files`.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import tempfile
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.tokenizer import BYTE, CONTROL, NORMAL, SPACE, UNKNOWN, USER_DEFINED

from ..core.paths import CASES_DIR, cache_root
from .files import BYTE_TOKEN_RE, read_json

#: Bump when the built files change for the same source.
BUILDER_VERSION = 1

#: Gemma 4 special tokens: id -> (text, GGUF token type). Ids as in real Gemma 4 files.
GEMMA4_SPECIALS: dict[int, tuple[str, int]] = {
    46: ("<|tool>", CONTROL),
    47: ("<tool|>", CONTROL),
    48: ("<|tool_call>", USER_DEFINED),
    49: ("<tool_call|>", USER_DEFINED),
    50: ("<|tool_response>", USER_DEFINED),
    51: ("<tool_response|>", USER_DEFINED),
    52: ('<|"|>', USER_DEFINED),
    98: ("<|think|>", CONTROL),
    100: ("<|channel>", USER_DEFINED),
    101: ("<channel|>", USER_DEFINED),
    105: ("<|turn>", CONTROL),
    106: ("<turn|>", CONTROL),
    255999: ("<|image>", CONTROL),
    256000: ("<|audio>", CONTROL),
    258880: ("<|image|>", CONTROL),
    258881: ("<|audio|>", CONTROL),
    258882: ("<image|>", CONTROL),
    258883: ("<audio|>", CONTROL),
    258884: ("<|video|>", CONTROL),
}

GEMMA4_VOCAB_SIZE = 262_144
CHAT_TEMPLATE_PATH = CASES_DIR / "tokenizer" / "gemma4_chat_template.jinja"


GEMMA3_TOKENIZER_DIR = CASES_DIR / "data" / "gemma3-tokenizer"
"""The real Gemma 3 ``tokenizer.model`` the project carries (with its terms; README there)."""


def gemma3_tokenizer_files(cache_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """The real Gemma 3 tokenizer: ``{"spm": tokenizer.model, "json": tokenizer.json}``.

    ``tokenizer.model`` is carried in ``cases/data/gemma3-tokenizer/``; ``tokenizer.json`` is derived
    from it on first use (:func:`derive_tokenizer_json`) and cached under ``<cache>/tok/``.

    Raises:
        InputError: the carried ``tokenizer.model`` is missing, or the converter is not installed
            (it needs ``transformers``, ``sentencepiece`` and ``protobuf``).
    """
    spm = GEMMA3_TOKENIZER_DIR / "tokenizer.model"
    if not spm.is_file():
        raise InputError(f"{spm}: missing (the project carries the real Gemma 3 tokenizer.model there)")
    digest = hashlib.sha256(f"g4h-spm2json-v{BUILDER_VERSION}\0".encode() + spm.read_bytes()).hexdigest()[:12]
    out = cache_root(cache_dir) / "tok" / f"gemma3-{digest}" / "tokenizer.json"
    if not out.is_file():
        derive_tokenizer_json(spm, out)
    return {"spm": spm, "json": out}


def derive_tokenizer_json(spm_path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the ``tokenizer.json`` transformers makes of a Gemma SentencePiece ``tokenizer.model``.

    transformers' own slow-to-fast converter (``GemmaConverter``: BPE, merges ordered by piece
    score, ``Replace(" ", "▁")`` normaliser, byte fallback, user-defined and control pieces as added
    tokens), then what a ``GemmaTokenizer`` adds around it: ``<pad>``/``<eos>``/``<bos>``/``<unk>``
    as special added tokens and a post-processor that puts ``<bos>`` first (``add_bos_token=True``,
    ``add_eos_token=False``). transformers 5.23's ``GemmaSentencePieceExtractor`` reads a
    SentencePiece processor (``self.sp``) that its ``__init__`` never creates; the subclass here gives
    it one and changes nothing else.

    Checked once against the real EmbeddingGemma ``tokenizer.json`` (``docs/design.md``, "Tokenizer
    data"): same vocabulary, merges in the same order, and the same ids on every corpus line.

    Raises:
        InputError: transformers, sentencepiece or protobuf is not installed.
    """
    try:  # optional heavy dependencies: only this derivation needs them
        import sentencepiece  # lazy: only to derive tokenizer.json
        from tokenizers import AddedToken, processors  # lazy: only to derive tokenizer.json

        cst = importlib.import_module("transformers.convert_slow_tokenizer")
        importlib.import_module("google.protobuf")
    except ImportError as e:
        raise InputError(f"deriving tokenizer.json from {spm_path} needs transformers, sentencepiece and protobuf "
                         f"({e}); pip install 'gemma4-harness[test]'") from None

    class _Extractor(cst.GemmaSentencePieceExtractor):
        def __init__(self, model: str):
            super().__init__(model)
            self.sp = sentencepiece.SentencePieceProcessor(model_file=model)

    class _Converter(cst.GemmaConverter):
        SpmExtractor = _Extractor

    specials = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>"}
    tok = _Converter(types.SimpleNamespace(vocab_file=str(spm_path), **specials)).converted()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials.values()])
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos>:0 $A:0", pair="<bos>:0 $A:0 <bos>:1 $B:1",
                                                       special_tokens=[("<bos>", bos)])
    dest = Path(out)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(dest, lambda tmp: tok.save(str(tmp)))
    return dest


# --------------------------------------------------------------------------- the gemma4 test vocabulary


def gemma4_test_metadata(source_json: str | os.PathLike, chat_template: str | None = None) -> dict[str, Any]:
    """The ``gemma4``-type test vocabulary (module docstring) as GGUF tokenizer metadata.

    Args:
        source_json: the real Gemma 3 ``tokenizer.json``.
        chat_template: stored as ``tokenizer.chat_template`` when given.

    Raises:
        InputError: the source is not a 262,144-token Gemma vocabulary, or a
            Gemma 4 special collides with an existing token.
    """
    doc = read_json(source_json)
    vocab: dict[str, int] = doc["model"].get("vocab") or {}
    by_id = {i: t for t, i in vocab.items()}
    if len(by_id) != GEMMA4_VOCAB_SIZE or set(by_id) != set(range(GEMMA4_VOCAB_SIZE)):
        raise InputError(f"{source_json}: expected the Gemma 3 vocabulary of {GEMMA4_VOCAB_SIZE} contiguous ids, "
                         f"got {len(by_id)}")
    tokens = [by_id[i] for i in range(GEMMA4_VOCAB_SIZE)]
    added = {int(a["id"]): a for a in doc.get("added_tokens") or []}
    present = set(tokens)
    for i, (text, _) in GEMMA4_SPECIALS.items():
        if text in present:
            raise InputError(f"{source_json}: Gemma 4 special {text!r} already in the vocabulary")
        tokens[i] = text
    types: list[int] = []
    for i, t in enumerate(tokens):
        if i in GEMMA4_SPECIALS:
            types.append(GEMMA4_SPECIALS[i][1])
        elif BYTE_TOKEN_RE.fullmatch(t):
            types.append(BYTE)
        elif i in added and (added[i].get("special") or (t.startswith("<unused") or t in ("<mask>", "[multimodal]"))):
            types.append(CONTROL)  # <pad> <eos> <bos> <unk>, <mask>, [multimodal], <unusedN>
        else:
            types.append(NORMAL)
    merges = [f"{a} {b}" for a, b in (m.split(" ", 1) if isinstance(m, str) else m for m in doc["model"]["merges"])]
    meta: dict[str, Any] = {
        "general.architecture": "gemma4",
        "general.name": "g4h gemma4-type test tokenizer (Gemma 3 vocabulary, Gemma 4 specials)",
        "tokenizer.ggml.model": "gemma4",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [-1000.0] * GEMMA4_VOCAB_SIZE,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.eot_token_id": 106,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": False,
    }
    if chat_template is not None:
        meta["tokenizer.chat_template"] = chat_template
    return meta


# --------------------------------------------------------------------------- writers


def _atomic_write(dest: Path, write) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=dest.suffix, dir=dest.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; these are ordinary shared cache files
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_vocab_gguf(path: str | os.PathLike, metadata: Mapping[str, Any]) -> Path:
    """Write a vocabulary-only GGUF (no tensors) holding ``metadata``'s ``general.*``/``tokenizer.*`` keys.

    Keys are written in a fixed order with the types llama.cpp uses (tokens and
    merges string arrays, scores float32, types int32, ids uint32, flags bool);
    anything else is written as a string. Keys may be missing or malformed on
    purpose (tests write bad files this way). The write is atomic.

    Raises:
        OSError: the destination cannot be written.
    """
    VT = gguf.GGUFValueType
    dest = Path(path)
    arch = str(metadata.get("general.architecture", "gemma4"))

    def write(tmp: Path) -> None:
        w = gguf.GGUFWriter(str(tmp), arch)
        for key in sorted(metadata):
            if key == "general.architecture":
                continue
            v = metadata[key]
            if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
                w.add_key_value(key, [str(x) for x in v], VT.ARRAY, sub_type=VT.STRING)
            elif key == "tokenizer.ggml.scores":
                w.add_key_value(key, [float(x) for x in v], VT.ARRAY, sub_type=VT.FLOAT32)
            elif key == "tokenizer.ggml.token_type":
                w.add_key_value(key, [int(x) for x in v], VT.ARRAY, sub_type=VT.INT32)
            elif isinstance(v, bool):
                w.add_key_value(key, v, VT.BOOL)
            elif isinstance(v, int):
                w.add_key_value(key, v, VT.UINT32)
            elif isinstance(v, float):
                w.add_key_value(key, v, VT.FLOAT32)
            else:
                w.add_key_value(key, str(v), VT.STRING)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    _atomic_write(dest, write)
    return dest


def tokenizer_json_document(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The HF ``tokenizers`` document (module docstring) for ``gemma4``-type ``metadata``.

    Raises:
        InputError: ``metadata`` is not ``gemma4``-type or has no merges.
    """
    if metadata.get("tokenizer.ggml.model") != "gemma4" or not metadata.get("tokenizer.ggml.merges"):
        raise InputError("tokenizer.json can be written for gemma4-type metadata with merges only")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = list(metadata["tokenizer.ggml.token_type"])
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": ty in (CONTROL, UNKNOWN)}
             for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (CONTROL, UNKNOWN, USER_DEFINED)]
    post = None
    if bos is not None and metadata.get("tokenizer.ggml.add_bos_token", True):
        bt = tokens[bos]
        post = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bt, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": bt, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": bt, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bt: {"id": bt, "ids": [bos], "tokens": [bt]}}}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": SPACE},
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\n+"}, "behavior": "Isolated", "invert": False},
        "post_processor": post,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": tokens[unk] if unk is not None else None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": True, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in metadata["tokenizer.ggml.merges"]]},
    }


def write_tokenizer_json(path: str | os.PathLike, metadata: Mapping[str, Any]) -> Path:
    """Write :func:`tokenizer_json_document` of ``metadata`` to ``path`` (atomic, deterministic bytes)."""
    text = json.dumps(tokenizer_json_document(metadata), ensure_ascii=False, indent=None, separators=(",", ":"))
    dest = Path(path)
    _atomic_write(dest, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return dest


# --------------------------------------------------------------------------- the cached build


@dataclass(frozen=True)
class BuiltTokenizer:
    """The two files of the ``gemma4``-type test tokenizer."""

    gguf: Path
    json: Path

    @property
    def folder(self) -> Path:
        """The cache folder holding both files."""
        return self.gguf.parent


def build_gemma4_test_tokenizer(source_json: str | os.PathLike | None = None,
                                cache_dir: str | os.PathLike | None = None) -> BuiltTokenizer:
    """Build (once) and return the ``gemma4``-type test GGUF and its ``tokenizer.json``.

    Args:
        source_json: the Gemma 3 ``tokenizer.json`` to build from (default: the one derived from the
            carried ``tokenizer.model``, :func:`gemma3_tokenizer_files`).
        cache_dir: the harness cache (default :func:`harness.core.paths.cache_root`).

    Returns:
        paths of ``vocab.gguf`` and ``tokenizer.json`` under ``<cache>/tok/gemma4-test-<hash>/``.
        Existing files are reused.

    Raises:
        InputError: the source ``tokenizer.json`` is missing or not the Gemma 3 vocabulary.
    """
    src_json = Path(source_json) if source_json is not None else gemma3_tokenizer_files(cache_dir)["json"]
    if not src_json.is_file():
        raise InputError(f"{src_json}: the real Gemma 3 tokenizer.json is not there (needed to build the gemma4 test tokenizer)")
    template = CHAT_TEMPLATE_PATH.read_text(encoding="utf-8") if CHAT_TEMPLATE_PATH.is_file() else None
    digest = hashlib.sha256()
    digest.update(f"g4h-tokbuild-v{BUILDER_VERSION}\0".encode())
    digest.update(hashlib.sha256(src_json.read_bytes()).digest())
    digest.update((template or "").encode("utf-8"))
    folder = cache_root(cache_dir) / "tok" / f"gemma4-test-{digest.hexdigest()[:12]}"
    out = BuiltTokenizer(folder / "vocab.gguf", folder / "tokenizer.json")
    if out.gguf.is_file() and out.json.is_file():
        return out
    meta = gemma4_test_metadata(src_json, template)
    write_tokenizer_json(out.json, meta)
    write_vocab_gguf(out.gguf, meta)
    return out
