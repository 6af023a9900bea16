"""``g4h inspect``: facts from the metadata and tensor table, the named problems, engine rows, JSON and exit codes.

Expected facts are read from the files with an independent reader (``gguf.GGUFReader``, ``safetensors``) or
from the spec they were built from, never from ``harness.inspect`` itself. Each named problem has a
small file made for it (from ``write_tiny_gguf`` or a built-in case, rewritten through ``gguf``'s writer;
an unknown type id is patched into the header at the offset ``gguf_mutate.read_layout`` finds), and where
an engine row says an engine can or cannot run a file, the engine is run to show it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping

import gguf
import numpy as np
import pytest
from clitools import REPO_ROOT, assert_one_line_error, run_cli
from conftest import write_tiny_gguf
from gguf_mutate import read_layout
from safetensors import safe_open

from gemma4_harness.harness.core import memory_machine
from gemma4_harness.harness.core.cases import builtin_specs
from gemma4_harness.harness.core.engine_kinds import KIND
from gemma4_harness.harness.engines.llamacpp import INSTALL_MSG
from gemma4_harness.harness.inspect import (
    ESTIMATE_TOKENS,
    SCHEMA_VERSION,
    Inspection,
    compact_names,
    engine_rows,
    inspect_model,
    llamacpp_donors,
)
from gemma4_harness.harness.synth import ensure_built, text_config

FAST = KIND["fast"]  # the fast engine's registry row: its dtypes, GGUF weight modes and GGUF types
from gemma4_harness.reference.config_hf import config_from_hf
from gemma4_harness.reference.errors import InputError, ModelFileError
from gemma4_harness.reference.weights import load_model

CASES = builtin_specs()  # the target cases (a drafter spec, *-assistant.toml, builds only beside its target)
VT = gguf.GGUFValueType
T = gguf.GGMLQuantizationType
LLAMACPP = os.environ.get("G4H_SKIP_LLAMACPP", "") in ("", "0")


def codes(info) -> list[str]:
    return [p.code for p in info.problems]


def only(info, code: str):
    found = [p for p in info.problems if p.code == code]
    assert len(found) == 1, info.problems
    return found[0]


def row(info, engine: str, dtype: str | None = None, weights: str | None = None):
    rows = [r for r in info.engines if r.engine == engine and (dtype is None or r.dtype == dtype)
            and (weights is None or r.weights == weights)]
    assert rows, info.engines
    return rows[0]


# --------------------------------------------------------------------------- writing small files


def rewrite_gguf(src: Path, dst: Path, *, drop_keys: tuple[str, ...] = (), set_keys: Mapping[str, tuple] | None = None,
                 add_tensors: Mapping[str, tuple[np.ndarray, Any]] | None = None,
                 retype: Mapping[str, Any] | None = None) -> Path:
    """Copy ``src`` through ``gguf.GGUFReader`` and ``gguf.GGUFWriter`` with keys dropped or set
    (``key -> (value, GGUFValueType, sub_type)``), tensors added (``name -> (float32 array, GGML type)``) and
    F32 tensors stored in another type (``name -> GGML type``: quantized with ``gguf.quants``, or zero bytes
    for a type gguf cannot quantize)."""
    set_keys, add_tensors, retype = dict(set_keys or {}), dict(add_tensors or {}), dict(retype or {})
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop_keys or name in set_keys:
            continue
        sub = f.types[-1] if f.types[0] == VT.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    for key, (val, vt, sub) in set_keys.items():
        w.add_key_value(key, val, vt, sub_type=sub)

    def put(name: str, arr: np.ndarray, qtype) -> None:
        if qtype == T.F32:
            w.add_tensor(name, np.asarray(arr, dtype=np.float32))
            return
        try:
            data = gguf.quants.quantize(np.asarray(arr, dtype=np.float32), qtype)
        except NotImplementedError:  # no quantizer (Q8_1): zero bytes of the right size
            data = np.zeros(gguf.quants.quant_shape_to_byte_shape(arr.shape, qtype), dtype=np.uint8)
        w.add_tensor(name, data, raw_dtype=qtype)

    for t in r.tensors:
        assert t.tensor_type == T.F32, "rewrite_gguf copies F32 files"
        put(t.name, np.array(t.data), retype.get(t.name, T.F32))
    for name, (arr, qtype) in add_tensors.items():
        put(name, arr, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def tiny_with_tokenizer(path: Path, model: str = "gemma4", n_tokens: int = 32, template: str | None = "{{ x }}",
                        drop_keys: tuple[str, ...] = ()) -> Path:
    """The tiny gemma4 model (vocabulary 32) with tokenizer keys; by default a file with no problem at all."""
    src = write_tiny_gguf(path.with_suffix(".src.gguf"))
    keys = {"tokenizer.ggml.model": (model, VT.STRING, None),
            "tokenizer.ggml.tokens": ([f"t{i}" for i in range(n_tokens)], VT.ARRAY, VT.STRING),
            "tokenizer.ggml.bos_token_id": (2, VT.UINT32, None), "tokenizer.ggml.eos_token_id": (1, VT.UINT32, None),
            "tokenizer.ggml.padding_token_id": (0, VT.UINT32, None)}
    if template is not None:
        keys["tokenizer.chat_template"] = (template, VT.STRING, None)
    out = rewrite_gguf(src, path, set_keys=keys, drop_keys=drop_keys)
    src.unlink()
    return out


@pytest.fixture(scope="module")
def e2b():
    return ensure_built(REPO_ROOT / "cases" / "models" / "e2b.toml")


# --------------------------------------------------------------------------- the copies of other modules' constants


def test_copied_constants_match_their_sources():
    """The registry's copy of the fast engine's GGUF types (read without importing torch) is the decoder's own."""
    from gemma4_harness.fast.quant_blocks import SUPPORTED
    assert FAST.gguf_types == SUPPORTED


# --------------------------------------------------------------------------- built-in cases


def _check_memory_column(info, reader: gguf.GGUFReader) -> None:
    """Every row that runs carries the plan of its own setting; the fast rows' weight terms match the file as
    ``gguf``'s reader lists it: 4 bytes per element in float32, the stored bytes of quantized matrices and (the
    plan is the CPU's) of MoE expert stacks packed."""
    elements = sum(int(t.n_elements) for t in reader.tensors)
    packed = sum(int(t.n_bytes) for t in reader.tensors
                 if len(t.shape) in (2, 3) and t.tensor_type.name not in ("F32", "F16", "BF16"))
    for r in info.engines:
        if not r.can_run:
            assert r.memory is None, r
            continue
        m = r.memory
        assert m["engine"] == r.engine and m["need_bytes"] == sum(m["breakdown"].values()) > 0, r
        assert m["fits"] and not m["advice"]  # a tiny case fits any machine that runs the tests
        assert m["options"]["tokens"] == m["options"]["new_tokens"] == ESTIMATE_TOKENS
        if r.engine == "fast":
            assert (m["options"]["dtype"], m["options"]["weights"]) == (r.dtype, r.weights)
    fp32 = row(info, "fast", "float32", "dequantized").memory["breakdown"]
    assert fp32["weights"] == 4 * elements and fp32["packed weights"] == 0
    assert row(info, "fast", "float32", "packed").memory["breakdown"]["packed weights"] == packed
    assert row(info, "reference").memory["breakdown"]["weight cache"] > 0  # 16 generated tokens: read again


def _reader_types(reader: gguf.GGUFReader) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for t in reader.tensors:
        c, b = out.get(t.tensor_type.name, (0, 0))
        out[t.tensor_type.name] = (c + 1, b + int(t.n_bytes))
    return out


@pytest.mark.parametrize("spec", CASES, ids=lambda p: p.stem)
def test_built_in_case(spec):
    case = ensure_built(spec)
    cfg = text_config(case.spec)  # the spec's own per-layer table (through the HF config)
    expected_layers = [(L.is_sliding, L.head_dim, L.n_kv_head, None if L.has_kv else L.kv_donor, L.n_ff, L.has_moe)
                       for L in cfg.layers]
    for qtype, path in case.gguf.items():
        info = inspect_model(path)
        reader = gguf.GGUFReader(str(path))
        assert info.format == "gguf" and info.architecture == "gemma4"
        assert [(L["type"] == "sliding", L["head_dim"], L["n_kv_head"], L["kv_donor"], L["n_ff"], L["moe"] is not None)
                for L in info.layers] == expected_layers, qtype
        for L in info.layers:
            if L["moe"]:
                assert (L["moe"]["experts"], L["moe"]["top_k"]) == (cfg.n_expert, cfg.n_expert_used)
        assert {t.type: (t.count, t.bytes) for t in info.tensor_types} == _reader_types(reader)
        assert info.n_params == sum(int(np.prod(t.shape)) for t in reader.tensors)
        assert info.size_label_source == "computed" and info.size_label
        fields = reader.fields
        want = {"chat_template_missing"} if "tokenizer.chat_template" not in fields else set()
        if fields["tokenizer.ggml.model"].contents() != "gemma4":
            want.add("tokenizer_model")
        if "gemma4.final_logit_softcapping" not in fields:
            want.add("softcap_missing")
        assert set(codes(info)) == want and info.exit_code == (1 if want else 0), (qtype, info.problems)
        assert info.tokenizer["tokens"] == info.tokenizer["embedding_rows"] == cfg.vocab_size
        assert row(info, "reference").can_run
        assert all(r.can_run for r in info.engines if r.engine == "fast")
        assert {(r.dtype, r.weights) for r in info.engines if r.engine == "fast"} == \
            {(d, w) for d in FAST.dtypes for w in FAST.weights}
        assert not row(info, "transformers").can_run and "HF model folder" in row(info, "transformers").reason
        llama = row(info, "llamacpp")
        if LLAMACPP:  # the one layout here whose donors llama.cpp cannot serve (see test_llamacpp_rows_...)
            assert llama.can_run == (case.spec.name != "edge-keqv-shared-donor"), llama
        _check_memory_column(info, reader)
        assert json.loads(json.dumps(info.as_dict())) == info.as_dict()
    info = inspect_model(case.hf_dir)
    assert info.format == "hf" and info.architecture == "gemma4_text"
    assert [(L["type"] == "sliding", L["head_dim"], L["n_kv_head"], L["kv_donor"], L["n_ff"], L["moe"] is not None)
            for L in info.layers] == expected_layers
    with safe_open(str(case.hf_dir / "model.safetensors"), "numpy") as h:
        n = sum(int(np.prod(h.get_slice(k).get_shape())) for k in h.keys())
    assert info.n_params == n == sum(t.elements for t in info.tensor_types)
    assert set(codes(info)) == {"no_tokenizer", "chat_template_missing"}  # the synthetic folders carry no tokenizer
    assert row(info, "transformers").can_run and row(info, "reference").can_run
    assert {(r.dtype, r.weights) for r in info.engines if r.engine == "fast"} == {(d, None) for d in FAST.dtypes}
    assert not row(info, "llamacpp").can_run and "GGUF" in row(info, "llamacpp").reason


def test_memory_column_says_when_a_setting_does_not_fit(monkeypatch):
    """With the memory test hook at 50 MB, no engine setting fits the e2b case (each needs its runtime at least):
    every runnable row says so, with that figure as what is available, and the file's own verdict is unchanged."""
    path = ensure_built(next(p for p in CASES if p.stem == "e2b")).gguf["Q8_0"]
    before = inspect_model(path).exit_code
    monkeypatch.setenv(memory_machine.AVAILABLE_ENV, "0.05")
    proc = run_cli("inspect", str(path), "--json")
    doc = json.loads(proc.stdout)
    assert proc.returncode == doc["exit_code"] == before, proc.stderr
    runnable = [r for r in doc["engines"] if r["can_run"]]
    assert runnable and all(not r["memory"]["fits"] and r["memory"]["available_bytes"] == 50_000_000
                            and r["memory"]["available_from"] == memory_machine.AVAILABLE_ENV for r in runnable), runnable
    text = run_cli("inspect", str(path))
    assert text.stdout.count("does not fit") == len(runnable), text.stdout


@pytest.mark.slow
def test_real_gemma3_270m():
    from gemma4_harness.harness.core.realdata import gemma3_270m_gguf

    path = gemma3_270m_gguf()
    info = inspect_model(path)
    reader = gguf.GGUFReader(str(path))  # 10-25 s on a 262k vocabulary: read once
    fields = reader.fields
    assert info.architecture == "gemma3" and info.size_label == fields["general.size_label"].contents() == "270M"
    assert info.size_label_source == "general.size_label"
    assert len(info.layers) == fields["gemma3.block_count"].contents()
    assert {t.type: (t.count, t.bytes) for t in info.tensor_types} == _reader_types(reader)
    assert info.tokenizer["model"] == "llama"
    n_tokens = len(fields["tokenizer.ggml.tokens"].contents())
    assert info.tokenizer["tokens"] == n_tokens == info.tokenizer["embedding_rows"]
    assert (info.tokenizer["bos_id"], info.tokenizer["eos_id"]) == (fields["tokenizer.ggml.bos_token_id"].contents(),
                                                                    fields["tokenizer.ggml.eos_token_id"].contents())
    assert codes(info) == ["chat_template_missing"] and info.exit_code == 1  # this file carries no template
    assert row(info, "transformers").can_run  # transformers reads a Gemma 3 GGUF with its own loader
    assert all(r.can_run for r in info.engines if r.engine in ("reference", "fast"))


# --------------------------------------------------------------------------- one file per named problem


def test_clean_file_is_usable(tmp_path):
    info = inspect_model(tiny_with_tokenizer(tmp_path / "clean.gguf"))
    assert info.problems == [] and info.verdict == "usable" and info.exit_code == 0
    assert info.tokenizer["chat_template"] and info.tokenizer["chat_template_source"] == "tokenizer.chat_template"


def test_unknown_type_id_is_unusable_and_still_listed(tmp_path):
    path = write_tiny_gguf(tmp_path / "fork.gguf")
    lay = read_layout(path)
    target = next(t for t in lay.tensors if t.name == "blk.1.ffn_up.weight")
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, target.type_off, 140)  # an id gguf does not know (a fork's type)
    path.write_bytes(bytes(data))
    with pytest.raises(InputError) as refused:
        load_model(path)
    info = inspect_model(path)
    assert info.verdict == "unusable" and info.exit_code == 2
    p = only(info, "tensor_type")
    assert p.where == "blk.1.ffn_up.weight" and "140" in p.message
    assert only(info, "file_check").message == str(refused.value).splitlines()[0]  # check_gguf's own line
    assert len(info.layers) == 2  # the header was still listed: the config and the table are there
    assert any(t.type == "type 140" and t.bytes is None for t in info.tensor_types)
    assert not any(r.can_run for r in info.engines)


def test_type_without_dequantizer_is_unusable(tmp_path, e2b):
    path = rewrite_gguf(e2b.gguf["F32"], tmp_path / "q81.gguf", retype={"blk.0.attn_q.weight": T.Q8_1})
    info = inspect_model(path)
    p = only(info, "tensor_type")
    assert p.severity == "unusable" and p.where == "blk.0.attn_q.weight" and "Q8_1" in p.message
    assert "file_check" not in codes(info)  # check_gguf knows its layout; only the dequantizer is missing
    from gemma4_harness.harness.engines.reference import ReferenceEngine
    with pytest.raises(InputError, match="Q8_1"):  # the reference indeed cannot read it
        ReferenceEngine(path).logits([2, 5, 7])


def test_tq2_0_is_usable_but_not_by_the_fast_engine(tmp_path, e2b):
    row_len = text_config(e2b.spec).layers[5].n_ff  # double-wide shared layer: ffn_down rows of 256, one TQ block
    assert row_len % 256 == 0
    path = rewrite_gguf(e2b.gguf["F32"], tmp_path / "tq2.gguf", retype={"blk.5.ffn_down.weight": T.TQ2_0})
    info = inspect_model(path)
    assert "tensor_type" not in codes(info) and info.verdict != "unusable"  # gguf 0.19 dequantizes TQ2_0
    assert row(info, "reference").can_run
    for r in info.engines:
        if r.engine == "fast":
            assert not r.can_run and "TQ2_0" in r.reason
    from gemma4_harness.harness.engines.fast import FastEngine
    from gemma4_harness.harness.engines.reference import ReferenceEngine
    assert np.isfinite(ReferenceEngine(path).logits([2, 5, 7])).all()
    with pytest.raises(InputError, match="TQ2_0"):
        FastEngine(path, device="cpu")


def test_vocab_mismatch(tmp_path):
    path = tiny_with_tokenizer(tmp_path / "vocab.gguf", n_tokens=20)  # token_embd.weight has 32 rows
    info = inspect_model(path)
    p = only(info, "vocab_mismatch")
    assert p.severity == "unusable" and p.where == "tokenizer.ggml.tokens"
    assert "20" in p.message and "32" in p.message and "token_embd.weight" in p.message
    assert len(info.layers) == 2 and info.exit_code == 2
    with pytest.raises(InputError, match="tokenizer.ggml.tokens"):  # the loader refuses it too
        load_model(path)


def test_sentencepiece_tokenizer_in_gemma4_file(tmp_path):
    info = inspect_model(tiny_with_tokenizer(tmp_path / "spm.gguf", model="llama"))
    p = only(info, "tokenizer_model")
    assert p.severity == "warning" and p.where == "tokenizer.ggml.model" and "'llama'" in p.message
    assert info.exit_code == 1 and codes(info) == ["tokenizer_model"]


def test_missing_chat_template(tmp_path):
    info = inspect_model(tiny_with_tokenizer(tmp_path / "notemplate.gguf", template=None))
    p = only(info, "chat_template_missing")
    assert p.severity == "warning" and p.where == "tokenizer.chat_template"
    assert info.exit_code == 1 and not info.tokenizer["chat_template"]


def test_no_tokenizer(tmp_path):
    info = inspect_model(write_tiny_gguf(tmp_path / "notok.gguf"))
    assert only(info, "no_tokenizer").where == "tokenizer.ggml.model"
    if LLAMACPP:
        assert not row(info, "llamacpp").can_run and "tokenizer.ggml.model" in row(info, "llamacpp").reason


def test_shared_kv_tensors_shipped(tmp_path, e2b):
    cfg = text_config(e2b.spec)
    shared = [L for L in cfg.layers if not L.has_kv]
    extra = {}
    for L in shared[:2] + shared[-1:]:
        extra[f"blk.{L.index}.attn_k.weight"] = (np.zeros((L.n_kv_head * L.head_dim, cfg.hidden_size)), T.F32)
        extra[f"blk.{L.index}.attn_v.weight"] = (np.zeros((L.n_kv_head * L.head_dim, cfg.hidden_size)), T.F32)
    path = rewrite_gguf(e2b.gguf["F32"], tmp_path / "sharedkv.gguf", add_tensors=extra)
    info = inspect_model(path)
    p = only(info, "shared_kv_tensors")
    assert p.severity == "warning" and info.verdict == "warnings"
    a, b, c = (L.index for L in shared[:2] + shared[-1:])
    assert f"blk.{a}-{b}.attn_k.weight" in p.message and f"blk.{c}.attn_k.weight" in p.message
    assert f"blk.{a}-{b}.attn_v.weight" in p.message and f"{len(extra)} K/V tensors" in p.message
    load_model(path)  # the loader accepts and ignores them, as llama.cpp does


def test_missing_softcap(tmp_path):
    path = tiny_with_tokenizer(tmp_path / "nosoftcap.gguf", drop_keys=("gemma4.final_logit_softcapping",))
    info = inspect_model(path)
    p = only(info, "softcap_missing")
    assert p.severity == "warning" and p.where == "gemma4.final_logit_softcapping" and "30" in p.message
    assert info.model["final_logit_softcap"] is None and info.exit_code == 1
    if LLAMACPP:
        assert any("softcap of 30" in n for n in row(info, "llamacpp").notes)


def test_gguf_check_refusal(tmp_path):
    src = write_tiny_gguf(tmp_path / "src.gguf")
    path = rewrite_gguf(src, tmp_path / "badtype.gguf", set_keys={"gemma4.block_count": (2, VT.INT32, None)})
    with pytest.raises(InputError) as refused:
        load_model(path)
    info = inspect_model(path)
    p = only(info, "file_check")
    assert p.severity == "unusable" and p.message == str(refused.value) and p.where == "gemma4.block_count"
    assert info.exit_code == 2 and len(info.layers) == 2  # listed all the same


def test_config_refusal(tmp_path):
    path = tiny_with_tokenizer(tmp_path / "nopattern.gguf", drop_keys=("gemma4.attention.sliding_window_pattern",))
    with pytest.raises(InputError) as refused:
        load_model(path)
    info = inspect_model(path)
    p = only(info, "config")
    assert p.message == str(refused.value) and p.where == "gemma4.attention.sliding_window_pattern"
    assert info.layers == [] and info.model is None and info.exit_code == 2


def test_missing_tensor(tmp_path):
    path = write_tiny_gguf(tmp_path / "missing.gguf", drop=("blk.1.ffn_up.weight",))
    with pytest.raises(InputError, match="blk.1.ffn_up.weight"):
        load_model(path)
    p = only(inspect_model(path), "tensors")
    assert p.where == "blk.1.ffn_up.weight" and "missing" in p.message


def test_truncated_data_is_unusable_header_cut_is_unreadable(tmp_path):
    path = tiny_with_tokenizer(tmp_path / "clean.gguf")
    data = path.read_bytes()
    cut = tmp_path / "cut-data.gguf"
    cut.write_bytes(data[:-100])
    info = inspect_model(cut)
    assert only(info, "file_check").severity == "unusable" and info.exit_code == 2 and len(info.layers) == 2
    head = tmp_path / "cut-head.gguf"
    head.write_bytes(data[:200])
    with pytest.raises(ModelFileError, match="cut-head.gguf"):
        inspect_model(head)
    with pytest.raises(ModelFileError, match="no such file"):
        inspect_model(tmp_path / "absent.gguf")


def test_hf_problems_and_tokenizer_files(tmp_path, e2b):
    hf = tmp_path / "hf"
    shutil.copytree(e2b.hf_dir, hf)
    raw = json.loads((hf / "config.json").read_text())
    vocab = raw["vocab_size"]
    (hf / "tokenizer.json").write_text(json.dumps(
        {"model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(vocab - 2)}},
         "added_tokens": [{"id": vocab - 2, "content": "<a>"}, {"id": vocab - 1, "content": "<b>"}]}))
    (hf / "chat_template.jinja").write_text("{{ messages }}")
    info = inspect_model(hf)
    assert info.problems == [] and info.exit_code == 0
    assert info.tokenizer["model"] == "BPE" and info.tokenizer["tokens"] == vocab == info.tokenizer["embedding_rows"]
    assert info.tokenizer["chat_template_source"] == "chat_template.jinja"
    (hf / "config.json").write_text(json.dumps(dict(raw, vocab_size=vocab - 12)))
    p = only(inspect_model(hf), "vocab_mismatch")
    assert p.severity == "unusable" and str(vocab - 12) in p.message and str(vocab) in p.message
    (hf / "config.json").write_text(json.dumps(dict(raw, attention_bias=True)))
    with pytest.raises(InputError) as refused:
        load_model(hf)
    p = only(inspect_model(hf), "config")
    assert p.message == str(refused.value)


# --------------------------------------------------------------------------- engine rows against the engines


@pytest.mark.slow
def test_llamacpp_rows_agree_with_llamacpp(tmp_path):
    """Where inspect says llama.cpp runs a built-in case, it does; where it says llama.cpp aborts, it does."""
    if not LLAMACPP:
        pytest.skip("opted out with G4H_SKIP_LLAMACPP=1")
    from gemma4_harness.harness.core.workers import EngineCrashed
    from gemma4_harness.harness.engines.llamacpp import LlamaCppEngine
    for name in ("e2b", "edge-keqv-shared-donor"):
        path = ensure_built(REPO_ROOT / "cases" / "models" / f"{name}.toml").gguf["F32"]
        info = inspect_model(path)
        if row(info, "llamacpp").can_run:
            assert np.isfinite(LlamaCppEngine(path, n_ctx=64).logits([2, 5, 7])).all()
        else:
            with pytest.raises(EngineCrashed):
                LlamaCppEngine(path, n_ctx=64).logits([2, 5, 7])


def test_llamacpp_donor_rule():
    cfg = text_config(ensure_built(REPO_ROOT / "cases" / "models" / "edge-keqv-shared-donor.toml").spec)
    n_kv = cfg.n_layer - cfg.n_kv_shared
    assert llamacpp_donors(cfg) == {i: n_kv - (2 if cfg.layers[i].is_sliding else 1) for i in range(n_kv, cfg.n_layer)}


def test_llamacpp_row_refuses_a_donor_of_the_other_type():
    """Same head_dim on both layer types, so only the type tells llama.cpp's donor apart: it still aborts."""
    raw = json.loads((ensure_built(REPO_ROOT / "cases" / "models" / "edge-keqv-shared-donor.toml").hf_dir
                      / "config.json").read_text())
    raw = dict(raw, attention_k_eq_v=False, per_layer_config={str(i): {"head_dim": 32} for i in (0, 3)})
    cfg = config_from_hf(raw, "config.json")
    assert llamacpp_donors(cfg) == {3: 2} and cfg.layers[3].kv_donor == 0
    assert (cfg.layers[2].head_dim, cfg.layers[2].n_kv_head) == (cfg.layers[3].head_dim, cfg.layers[3].n_kv_head)
    info = Inspection(path="x.gguf", format="gguf", file_bytes=0, tokenizer={"model": "gemma4"})
    (llama,) = [r for r in engine_rows(info, cfg) if r.engine == "llamacpp"]
    if LLAMACPP:
        assert not llama.can_run and "shared layer 3" in llama.reason and "layer 2" in llama.reason
    else:
        assert llama.reason == INSTALL_MSG


def test_compact_names():
    names = ["blk.5.attn_k.weight", "blk.6.attn_k.weight", "blk.7.attn_k.weight", "blk.9.attn_k.weight",
             "blk.5.attn_v.weight", "rope_freqs.weight"]
    assert compact_names(names) == "blk.5-7.attn_k.weight, blk.9.attn_k.weight, blk.5.attn_v.weight, rope_freqs.weight"


# --------------------------------------------------------------------------- the CLI and the JSON document


def _cli_json(path: Path, code: int) -> dict:
    with pytest.MonkeyPatch.context() as mp:  # the memory column against a fixed figure: both runs see the same
        mp.setenv(memory_machine.AVAILABLE_ENV, "8")
        proc = run_cli("inspect", str(path), "--json")
        assert proc.returncode == code, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc == json.loads(json.dumps(inspect_model(path).as_dict()))
    assert doc["schema"] == "g4h-inspect" and doc["schema_version"] == SCHEMA_VERSION
    assert doc["exit_code"] == code and proc.stderr == ""
    return doc


def test_cli_json_round_trip(e2b):
    doc = _cli_json(e2b.gguf["Q8_0"], 1)
    assert doc["verdict"] == "warnings" and len(doc["layers"]) == text_config(e2b.spec).n_layer


def test_cli_unreadable_is_one_line(tmp_path):
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()[:100])
    proc = run_cli("inspect", str(truncated), "--json")
    line = assert_one_line_error(proc, "cut.gguf")
    doc = json.loads(proc.stdout)
    assert doc["verdict"] == "unreadable" and doc["exit_code"] == 2 and doc["problems"][0]["message"] in line
    assert_one_line_error(run_cli("inspect", str(tmp_path / "absent")), "absent")


@pytest.mark.slow
def test_cli_exit_codes(tmp_path, e2b):
    clean = tiny_with_tokenizer(tmp_path / "clean.gguf")
    bad = tiny_with_tokenizer(tmp_path / "vocab.gguf", n_tokens=20)
    for path, code in ((clean, 0), (e2b.hf_dir, 1), (bad, 2)):
        _cli_json(path, code)
        text = run_cli("inspect", str(path))
        assert text.returncode == code and f"(exit {code})" in text.stdout and text.stderr == ""


#: Objects whose keys are names, not fields (documented as "name -> value", with the names listed).
NAME_MAPS = {"engines[].memory.breakdown"}


def _paths(value: Any, prefix: str = "") -> set[str]:
    out: set[str] = set()
    if isinstance(value, dict) and prefix not in NAME_MAPS:
        for k, v in value.items():
            p = f"{prefix}.{k}" if prefix else k
            out |= {p} | _paths(v, p)
    elif isinstance(value, list):
        for v in value:
            out |= _paths(v, prefix + "[]")
    return out


def test_every_json_field_is_documented(tmp_path):
    doc = (REPO_ROOT / "docs" / "inspect-json.md").read_text()
    documented, in_field_table = set(), False
    for line in doc.splitlines():  # the first cell of every table whose header is "| field | type | meaning |"
        if line.startswith("| field |"):
            in_field_table = True
        elif not line.startswith("|"):
            in_field_table = False
        elif in_field_table:
            documented |= set(re.findall(r"`([\w.\[\]]+)`", line.split("|")[1]))
    moe = ensure_built(REPO_ROOT / "cases" / "models" / "26b-a4b.toml").gguf["Q8_0"]
    seen: set[str] = set()
    for path in (moe, tiny_with_tokenizer(tmp_path / "v.gguf", n_tokens=20)):
        seen |= _paths(inspect_model(path).as_dict())
    assert seen - documented == set(), "fields missing from docs/inspect-json.md"
    assert documented - seen == set(), "documented fields the document does not have"
    assert f"now **{SCHEMA_VERSION}**" in doc


def test_g4h_help_lists_inspect():
    proc = subprocess.run([sys.executable, "-m", "gemma4_harness.harness.cli", "--help"], cwd=REPO_ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=60)
    assert "inspect" in proc.stdout
