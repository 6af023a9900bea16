"""What a model file holds, what is wrong with it, and which engines can run it: the facts behind ``g4h inspect``.

:func:`inspect_model` reads a GGUF file's header (metadata and tensor table, through
:func:`reference.gguf_check.check_gguf`) or an HF folder's ``config.json``, safetensors headers and
tokenizer files; the tensor data is read once, for the weight problems (``weights``, ``weight_not_carried``: about
a second per GB, :func:`.weights.weight_problems`), everything else comes from the header. It returns an
:class:`Inspection`: architecture and size label, the per-layer table (:class:`reference.config.LayerSpec`),
tensor types with counts and bytes, tokenizer facts, one :class:`EngineRow` per engine setting and
the :class:`Problem` list. ``Inspection.as_dict()`` is the ``g4h inspect --json`` document, specified
field by field in ``docs/inspect-json.md`` (:data:`SCHEMA_VERSION`).

Problems (``code``: severity):

* ``file_check``: unusable. :func:`reference.gguf_check.check_gguf` refuses the file (its message), or an
  HF folder's safetensors header cannot be read. When the GGUF header can still be listed (a tensor of a
  type id ``gguf`` does not know, a bad padding byte, a key of the wrong GGUF type), the rest of the
  report is filled from a plain listing of the header (:func:`.gguf_header._list_gguf`); otherwise the file is
  *unreadable* and :func:`inspect_model` raises.
* ``config``: unusable. :func:`reference.config_gguf.config_from_gguf` / ``config_from_hf`` /
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

Engines: every plain kind of the registry (:data:`harness.core.engine_kinds.KINDS`), one row per setting:
``reference`` (float64), ``transformers`` (fp32), ``fast`` for each dtype and, for GGUF, each weight mode, and
``llamacpp``. An unusable file runs on none (the harness compares every engine with the
reference, which refuses it). Otherwise each engine's own limits apply, read from its row (:mod:`.runnable`): the
fast path decodes
its row's ``gguf_types`` only (:data:`fast.quant_blocks.SUPPORTED`); transformers reads HF folders and Gemma 3 GGUFs,
not Gemma 4 GGUFs; llama.cpp needs a GGUF, llama-cpp-python installed, a ``tokenizer.ggml.model`` key and type ids its
ggml knows (:data:`LLAMACPP_TYPE_IDS`), and its KV donor rule must give each shared layer a cache of
the right shape (:func:`llamacpp_donors`; :mod:`harness.engines.llamacpp.support`). The memory column of each row that can run is its memory plan
(:func:`_memory_estimates`, :func:`harness.core.memory.plan`).

The modules: :mod:`.model` (the document), :mod:`.gguf_header` and :mod:`.hf_folder`
(each format's reading and problems), :mod:`.common` (what both share), :mod:`.runnable`
(the engine rows), :mod:`.weights` (the problems only the tensor data shows); this module is the entry point.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gemma4_harness.reference.errors import InputError, ModelFileError

from ..core import memory
from ..core.engine_kinds import KIND
from .common import compact_names, shared_kv_tensors
from .gguf_header import gguf_can_dequantize, inspect_gguf
from .hf_folder import inspect_hf
from .model import SCHEMA_VERSION, UNUSABLE, WARNING, EngineRow, Inspection, Problem, TensorType, unreadable_dict
from .runnable import LLAMACPP_TYPE_IDS, engine_rows, llamacpp_donors
from .weights import note_carry, weight_problems

__all__ = ["ESTIMATE_TOKENS", "LLAMACPP_TYPE_IDS", "SCHEMA_VERSION",
           "UNUSABLE", "WARNING", "EngineRow", "Inspection", "Problem", "TensorType", "compact_names", "engine_rows",
           "gguf_can_dequantize", "inspect_model", "llamacpp_donors", "shared_kv_tensors", "unreadable_dict"]


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
    info, cfg = inspect_hf(p) if p.is_dir() else inspect_gguf(p)
    if cfg is not None and not any(q.severity == UNUSABLE for q in info.problems):
        info.problems += weight_problems(p)
    info.engines = engine_rows(info, cfg)
    note_carry(info)
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
        if "dtype" in KIND[r.engine].options:  # the row's setting (fast: each dtype and weight mode)
            options.update(dtype=r.dtype, weights=r.weights or "dequantized")
        out.append(memory.plan(r.engine, facts, **options).as_dict())
    return out
