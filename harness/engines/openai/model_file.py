"""What the ``openai`` engine reads from the model file the harness compares with (the server holds its own copy):
its vocabulary size and the ids that end a generation. Never raises: a file that cannot be read is refused elsewhere,
with its name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gemma4_harness.reference.chat import EOS as EOS_TEXT
from gemma4_harness.reference.chat import TURN_CLOSE
from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.tokenizer import read_gguf_metadata

END_OF_TURN_TEXTS = (EOS_TEXT, TURN_CLOSE, "<|tool_response>", "<end_of_turn>")
"""Token texts that end a generation besides the stated EOS id: Gemma 4's ``<turn|>`` (the end of a turn,
``reference/chat.py`` ``TURN_CLOSE``) and ``<|tool_response>`` (the model hands over to a tool), Gemma 3's
``<end_of_turn>``; llama.cpp marks the same texts end-of-generation (``llama_vocab::impl::load``, its
``special_eog_ids`` list in ``src/llama-vocab.cpp``), transformers takes them from ``generation_config.json``'s
``eos_token_id``."""


def vocab_size(path: Any) -> int | None:
    """The vocabulary size of the model at ``path``: a GGUF's ``tokenizer.ggml.tokens``, an HF folder's
    ``vocab_size`` (``config.json``, or its ``text_config``); None where it cannot be read here."""
    if path is None:
        return None
    p = Path(str(path))
    try:
        if p.suffix == ".gguf" and p.is_file():
            return len(read_gguf_metadata(p).get("tokenizer.ggml.tokens") or []) or None
        if (p / "config.json").is_file():
            cfg = json.loads((p / "config.json").read_text(encoding="utf-8"))
            v = cfg.get("vocab_size", (cfg.get("text_config") or {}).get("vocab_size"))
            return int(v) if isinstance(v, int) else None
    except (InputError, OSError, ValueError, TypeError, AttributeError):
        return None
    return None


def end_of_generation_ids(path: Any) -> set[int]:
    """The token ids that end a generation for the model at ``path``: a GGUF's ``tokenizer.ggml.eos_token_id``,
    ``eot_token_id`` and ``eom_token_id`` and the tokens of :data:`END_OF_TURN_TEXTS`; an HF folder's
    ``eos_token_id`` of ``generation_config.json`` and ``config.json`` (an int or a list) and the added tokens of
    ``tokenizer.json`` with those texts. Empty for no path or a model without them (never raises: a file that
    cannot be read is refused elsewhere, with its name)."""
    ids: set[int] = set()
    if path is None:
        return ids
    p = Path(str(path))
    try:
        if p.suffix == ".gguf" and p.is_file():
            meta = read_gguf_metadata(p)
            for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
                if isinstance(meta.get(key), int):
                    ids.add(int(meta[key]))
            tokens = meta.get("tokenizer.ggml.tokens") or []
            ids.update(i for i, t in enumerate(tokens) if t in END_OF_TURN_TEXTS)
        elif p.is_dir():
            for name in ("generation_config.json", "config.json"):
                f = p / name
                cfg = json.loads(f.read_text(encoding="utf-8")) if f.is_file() else {}
                cfg = cfg.get("text_config", cfg) if "eos_token_id" not in cfg else cfg
                e = cfg.get("eos_token_id") if isinstance(cfg, dict) else None
                ids.update(int(x) for x in (e if isinstance(e, list) else [e]) if isinstance(x, int))
            f = p / "tokenizer.json"
            added = json.loads(f.read_text(encoding="utf-8")).get("added_tokens", []) if f.is_file() else []
            ids.update(int(a["id"]) for a in added if isinstance(a, dict) and a.get("content") in END_OF_TURN_TEXTS)
    except (InputError, OSError, ValueError, TypeError, AttributeError, KeyError):
        return ids
    return ids

