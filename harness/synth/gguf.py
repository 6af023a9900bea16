"""Writing a synthetic case as GGUF, through ``gguf.GGUFWriter``, with llama.cpp's ``gemma4`` keys.

Every file type in :data:`~harness.synth.spec.QTYPES` is written from the same float32 weights; a
matrix whose rows do not fill a quant block falls back to F16, as llama.cpp's converter does. The
vocabulary is a synthetic SentencePiece-style one: 4 specials, 256 byte tokens, then fillers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import gguf
import numpy as np
from gguf import GGUFValueType as VT

from .spec import FULL, QTYPES, SLIDING, Spec, text_config
from .weights import rope_freqs

#: Special token ids of the synthetic vocabulary (Gemma's layout).
PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
#: First byte token ``<0x00>``; bytes occupy ids 4..259.
BYTE_BASE = 4

_FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7, "BF16": 32}



def _gguf_qtype(qtype: str):
    if qtype not in QTYPES:
        raise ValueError(f"qtype {qtype!r} not supported; expected one of {', '.join(QTYPES)}")
    return gguf.GGMLQuantizationType[qtype]


def gguf_tensor_type(name: str, shape: Sequence[int], qtype: str) -> str:
    """The GGML type :func:`write_gguf` stores a tensor in.

    Args:
        name: canonical tensor name (unused today; kept so a per-tensor rule
            can be added without changing callers).
        shape: numpy shape of the tensor.
        qtype: the file type requested, one of :data:`QTYPES`.

    Returns:
        ``"F32"`` for 1-D tensors (norms, scales, ``rope_freqs``,
        ``layer_output_scale``); ``"F16"`` for a matrix whose row length is not a
        multiple of the quant block size (llama.cpp's converter falls back to F16
        the same way); ``qtype`` otherwise.
    """
    if len(shape) < 2 or qtype == "F32":
        return "F32"
    block = gguf.GGML_QUANT_SIZES[_gguf_qtype(qtype)][0]
    if shape[-1] % block:
        return "F16"
    return qtype


def _vocab(vocab_size: int) -> tuple[list[str], list[float], list[int]]:
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"]
    types = [gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    n_fill = vocab_size - len(tokens)
    if n_fill < 0:
        raise ValueError(f"vocab_size {vocab_size} < {len(tokens)} (4 specials + 256 byte tokens)")
    tokens += [f"\u2581t{i}" for i in range(len(tokens), vocab_size)]
    types += [gguf.TokenType.NORMAL] * n_fill
    scores = [0.0] * (BYTE_BASE + 256) + [-float(i) for i in range(1, n_fill + 1)]
    return tokens, scores, [int(t) for t in types]


def gguf_metadata(spec: Spec) -> dict[str, tuple[Any, str, str | None]]:
    """The model keys :func:`write_gguf` writes (tokenizer keys excluded).

    Args:
        spec: the spec.

    Returns:
        Ordered dict ``key -> (value, GGUFValueType name, array sub-type name or
        None)``, following llama.cpp ``convert_hf_to_gguf.py``
        (``TextModel``/``Gemma3Model``/``Gemma4Model.set_gguf_parameters``):
        per-layer arrays are UINT32 (``feed_forward_length`` when
        ``use_double_wide_mlp``, ``attention.head_count_kv`` when ``attention_k_eq_v``
        with ``num_global_key_value_heads``) and BOOL
        (``attention.sliding_window_pattern``, true = sliding layer).
    """
    c = spec.config
    a = "gemma4"
    layers = text_config(spec).layers
    rp = c["rope_parameters"]
    md: dict[str, tuple[Any, str, str | None]] = {}
    md["general.name"] = (spec.name, "STRING", None)
    md["general.file_type"] = (0, "UINT32", None)  # replaced per qtype in write_gguf
    md[f"{a}.context_length"] = (int(c.get("max_position_embeddings", 131072)), "UINT32", None)
    md[f"{a}.embedding_length"] = (c["hidden_size"], "UINT32", None)
    md[f"{a}.block_count"] = (c["num_hidden_layers"], "UINT32", None)
    if c.get("use_double_wide_mlp", False):
        md[f"{a}.feed_forward_length"] = ([L.n_ff for L in layers], "ARRAY", "UINT32")
    else:
        md[f"{a}.feed_forward_length"] = (c["intermediate_size"], "UINT32", None)
    md[f"{a}.attention.head_count"] = (c["num_attention_heads"], "UINT32", None)
    if c.get("attention_k_eq_v", False) and c.get("num_global_key_value_heads") is not None:
        md[f"{a}.attention.head_count_kv"] = ([L.n_kv_head for L in layers], "ARRAY", "UINT32")
    else:
        md[f"{a}.attention.head_count_kv"] = (c["num_key_value_heads"], "UINT32", None)
    md[f"{a}.attention.key_length"] = (c["global_head_dim"], "UINT32", None)
    md[f"{a}.attention.value_length"] = (c["global_head_dim"], "UINT32", None)
    md[f"{a}.attention.key_length_swa"] = (c["head_dim"], "UINT32", None)
    md[f"{a}.attention.value_length_swa"] = (c["head_dim"], "UINT32", None)
    md[f"{a}.attention.layer_norm_rms_epsilon"] = (float(c.get("rms_norm_eps", 1e-6)), "FLOAT32", None)
    md[f"{a}.attention.sliding_window"] = (c["sliding_window"], "UINT32", None)
    md[f"{a}.attention.sliding_window_pattern"] = ([L.is_sliding for L in layers], "ARRAY", "BOOL")
    md[f"{a}.attention.shared_kv_layers"] = (int(c.get("num_kv_shared_layers", 0)), "UINT32", None)
    md[f"{a}.embedding_length_per_layer_input"] = (int(c["hidden_size_per_layer_input"]), "UINT32", None)
    md[f"{a}.rope.freq_base"] = (float(rp.get(FULL, rp.get(SLIDING))["rope_theta"]), "FLOAT32", None)
    md[f"{a}.rope.freq_base_swa"] = (float(rp.get(SLIDING, rp.get(FULL))["rope_theta"]), "FLOAT32", None)
    md[f"{a}.rope.dimension_count"] = (c["global_head_dim"], "UINT32", None)
    md[f"{a}.rope.dimension_count_swa"] = (c["head_dim"], "UINT32", None)
    if c.get("final_logit_softcapping") is not None:
        md[f"{a}.final_logit_softcapping"] = (float(c["final_logit_softcapping"]), "FLOAT32", None)
    if c.get("enable_moe_block", False):
        md[f"{a}.expert_count"] = (c["num_experts"], "UINT32", None)
        md[f"{a}.expert_used_count"] = (c["top_k_experts"], "UINT32", None)
        md[f"{a}.expert_feed_forward_length"] = (c["moe_intermediate_size"], "UINT32", None)
    return md


def write_gguf(spec: Spec, weights: Mapping[str, np.ndarray], path: str | os.PathLike[str], qtype: str = "F32",
               arch: str = "gemma4", metadata: Mapping[str, tuple[Any, str, str | None]] | None = None,
               special_tokens: Mapping[int, str] | None = None) -> Path:
    """Write a ``gemma4`` GGUF file with llama.cpp's tensor names and keys.

    ``arch`` and ``metadata`` (in the form of :func:`gguf_metadata`) let the drafter writer
    (:mod:`harness.synth.drafter`) write a ``gemma4-assistant`` file through the same code.

    Keys: see :func:`gguf_metadata`, plus ``general.architecture = "gemma4"``,
    ``general.file_type``, ``general.quantization_version`` and a minimal
    SentencePiece-style vocabulary (``tokenizer.ggml.model = "llama"``: ``<pad>``,
    ``<eos>``, ``<bos>``, ``<unk>`` (ids 0-3), byte tokens ``<0x00>``..``<0xFF>``
    (ids 4-259, type BYTE), filler pieces ``▁t<id>`` up to ``vocab_size``, with
    scores, token types, special ids and ``add_bos_token = true``).

    Tensors: ``rope_freqs.weight`` (see :func:`rope_freqs`), then ``weights`` in
    their order; a tied head has no ``output.weight``. Types per
    :func:`gguf_tensor_type`; data goes through ``gguf.quants.quantize``. The file
    is written beside ``path`` and renamed into place, then read back with
    ``gguf.GGUFReader``: every tensor must have its shape, its type, and dequantize
    to exactly ``dequantize(quantize(x))`` (bit-exact ``x`` for F32).

    Args:
        spec: the spec.
        weights: canonical name -> float32 array, as from :func:`make_weights`.
        path: output file.
        qtype: one of :data:`QTYPES`.
        special_tokens: id -> token string written at that id as a CONTROL token (a multimodal case's
            ``<|image|>`` ... strings, which the reference and llama.cpp's mtmd look up by string).

    Returns:
        ``Path(path)``.

    Raises:
        ValueError: unknown ``qtype``; ``vocab_size`` < 260.
        RuntimeError: the read-back check fails.
    """

    _gguf_qtype(qtype)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")

    tensors: dict[str, np.ndarray] = {"rope_freqs.weight": rope_freqs(spec.config)}
    tensors.update(weights)
    if spec.config.get("tie_word_embeddings", True):
        tensors.pop("output.weight", None)
    tokens, scores, ttypes = _vocab(spec.config["vocab_size"])
    for tid, text in (special_tokens or {}).items():
        tokens[tid], ttypes[tid] = text, int(gguf.TokenType.CONTROL)

    w = gguf.GGUFWriter(str(tmp), arch)
    try:
        for key, (val, vtype, sub) in (gguf_metadata(spec) if metadata is None else metadata).items():
            if key == "general.file_type":
                val = _FILE_TYPES[qtype]
            w.add_key_value(key, val, VT[vtype], sub_type=VT[sub] if sub else None)
        w.add_key_value("general.quantization_version", gguf.GGML_QUANT_VERSION, VT.UINT32)
        w.add_key_value("tokenizer.ggml.model", "llama", VT.STRING)
        w.add_key_value("tokenizer.ggml.tokens", tokens, VT.ARRAY, sub_type=VT.STRING)
        w.add_key_value("tokenizer.ggml.scores", scores, VT.ARRAY, sub_type=VT.FLOAT32)
        w.add_key_value("tokenizer.ggml.token_type", ttypes, VT.ARRAY, sub_type=VT.INT32)
        w.add_key_value("tokenizer.ggml.bos_token_id", BOS_ID, VT.UINT32)
        w.add_key_value("tokenizer.ggml.eos_token_id", EOS_ID, VT.UINT32)
        w.add_key_value("tokenizer.ggml.unknown_token_id", UNK_ID, VT.UINT32)
        w.add_key_value("tokenizer.ggml.padding_token_id", PAD_ID, VT.UINT32)
        w.add_key_value("tokenizer.ggml.add_bos_token", True, VT.BOOL)
        w.add_key_value("tokenizer.ggml.add_eos_token", False, VT.BOOL)

        expected: dict[str, tuple[str, np.ndarray]] = {}
        for name, arr in tensors.items():
            arr = np.ascontiguousarray(arr, dtype=np.float32)
            tname = gguf_tensor_type(name, arr.shape, qtype)
            ttype = gguf.GGMLQuantizationType[tname]
            if tname == "F32":
                w.add_tensor(name, arr)
                expected[name] = (tname, arr)
                continue
            data = gguf.quants.quantize(arr, ttype)
            # F16 comes back as a float16 array (numpy shape); BF16 and Q* as uint8
            # with the row length in bytes, which add_tensor turns back into elements.
            w.add_tensor(name, data, raw_dtype=ttype)
            expected[name] = (tname, gguf.quants.dequantize(data, ttype))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    try:
        _verify_gguf(tmp, expected, spec.name, qtype)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _verify_gguf(path: Path, expected: Mapping[str, tuple[str, np.ndarray]], name: str, qtype: str) -> None:
    reader = gguf.GGUFReader(str(path))
    got = {t.name: t for t in reader.tensors}
    if set(got) != set(expected):
        raise RuntimeError(f"{name} {qtype}: GGUF tensor set differs: missing {sorted(set(expected) - set(got))[:5]}, "
                           f"unexpected {sorted(set(got) - set(expected))[:5]}")
    for tname, (ttype, ref) in expected.items():
        t = got[tname]
        if t.tensor_type.name != ttype:
            raise RuntimeError(f"{name} {qtype}: {tname}: type {t.tensor_type.name}, expected {ttype}")
        if tuple(int(x) for x in t.shape[::-1]) != ref.shape:
            raise RuntimeError(f"{name} {qtype}: {tname}: ne {list(t.shape)} does not match numpy shape {ref.shape}")
        back = gguf.quants.dequantize(t.data, t.tensor_type)
        if back.shape != ref.shape or back.dtype != np.float32:
            back = back.reshape(ref.shape) if back.size == ref.size else back
        if back.shape != ref.shape or not np.array_equal(back.view(np.uint32), ref.view(np.uint32)):
            raise RuntimeError(f"{name} {qtype}: {tname}: data read back differs from what was written")
    del reader
