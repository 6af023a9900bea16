"""An HF model folder from its ``config.json``, safetensors headers and tokenizer files, and their problems."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np
from safetensors import safe_open

from gemma4_harness.reference.config import ModelConfig
from gemma4_harness.reference.config_hf import config_from_hf
from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.files import read_json
from gemma4_harness.reference.names import hf_to_gguf
from gemma4_harness.reference.weights import read_hf_config

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

#: Bytes per element of the safetensors dtypes.
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                     "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def inspect_hf(path: Path) -> tuple[Inspection, ModelConfig | None]:
    raw = read_hf_config(path)
    cfg_path = path / "config.json"
    problems: list[Problem] = []
    files = sorted(path.glob("*.safetensors"))
    info = Inspection(path=str(path), format="hf", file_bytes=sum(f.stat().st_size for f in files))
    info.architecture = str_or_none(raw.get("model_type"))
    info.name = str_or_none(raw.get("_name_or_path")) or path.name
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
                                                                   f"({one_line(e)[:120]})"))
            continue
    for key, _, shape in stored:
        name = hf_to_gguf(key)
        if name is None:
            continue
        if name in canon:
            problems.append(Problem(UNUSABLE, "tensors", key, f"{path}: tensor {key} maps to {name}, which another "
                                                              "tensor already provides"))
        canon[name] = shape
    info.tensor_types = tensor_types(
        (None, dtype, shape, int(np.prod(shape, dtype=object)) * SAFETENSORS_BYTES[dtype]
         if dtype in SAFETENSORS_BYTES else None) for _, dtype, shape in stored)
    count_params(info, [(hf_to_gguf(k) or k, s) for k, _, s in stored], None, None)
    cfg = None
    try:
        cfg = config_from_hf(raw, str(cfg_path))
    except InputError as e:
        problems.append(Problem(UNUSABLE, "config", named_in(e, "config.json"), one_line(e)))
    rows = canon["token_embd.weight"][0] if len(canon.get("token_embd.weight", ())) == 2 else None
    skip: tuple[str, ...] = ()
    if cfg is not None:
        describe_config(info, cfg)
        if rows is not None and rows != cfg.vocab_size:
            problems.append(Problem(UNUSABLE, "vocab_mismatch", "vocab_size",
                                    f"{cfg_path}: vocab_size = {cfg.vocab_size} but the embedding table has {rows} "
                                    "rows: expected one row per token"))
            skip = ("token_embd.weight", "output.weight")
        if files:
            problems += tensor_problems(str(path), cfg, canon, skip=skip)
        problems += shared_kv_problems(cfg, canon)
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
            model = str_or_none(m.get("type"))
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
           "bos_id": int_or_none(ids["bos"]), "eos_id": int_or_none(ids["eos"]), "pad_id": int_or_none(ids["pad"]),
           "chat_template": template_source is not None, "chat_template_source": template_source}
    problems = []
    if model is None:
        problems.append(Problem(WARNING, "no_tokenizer", str(tok_json),
                                f"{path}: no tokenizer.json or tokenizer.model: no tokenizer (token-id prompts only)"))
    if n_tokens is not None and rows is not None and n_tokens > rows:
        problems.append(Problem(UNUSABLE, "vocab_mismatch", str(tok_json),
                                f"{tok_json}: {n_tokens} token ids but the embedding table has {rows} rows: expected "
                                "at most one token per row"))
    problems += special_id_problems(str(path / "config.json"), tok, rows, "{}_token_id",
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
