"""reference.gguf_check and reference.weight_check: the parse, the named failures, the stored-form checks.

The faults of the hostile-input report each have a case here with the message
they must produce; the parse is compared with ``gguf.GGUFReader`` on valid
files; the scale-field offsets and magnitude factors of ``weight_check`` are
checked against gguf-py's own decoders.
"""

from __future__ import annotations

import random
import re
import struct

import gguf
import numpy as np
import pytest
from gguf_mutate import read_layout

from gemma4_harness.reference import load_model
from gemma4_harness.reference.errors import ConfigError, InputError, ModelFileError
from gemma4_harness.reference.gguf_check import check_gguf
from gemma4_harness.reference.weight_check import _SCALE_FIELDS, MAX_ABS_FP16, MAX_ABS_FP32, check_stored, check_weights


@pytest.fixture(scope="module")
def synth_files(tmp_path_factory):
    from gguf_campaign import write_bases

    return write_bases(tmp_path_factory.mktemp("bases"))


def _patched(src, dst, off: int, fmt: str, value):
    buf = bytearray(src.read_bytes())
    struct.pack_into(fmt, buf, off, value)
    dst.write_bytes(bytes(buf))
    return dst


def gguf_metadata(reader) -> dict:
    """The key/values as gguf-py's own reader decodes them (the independent oracle of the parse)."""
    return {key: f.contents() for key, f in reader.fields.items() if not key.startswith("GGUF.")}


def _error(path, cls=InputError) -> str:
    with pytest.raises(cls) as e:
        load_model(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    return msg


# --------------------------------------------------------------------------- the parse


def test_parse_matches_gguf_reader(synth_files):
    for path in synth_files.values():
        r, gf = gguf.GGUFReader(str(path)), check_gguf(path)
        assert gf.metadata == gguf_metadata(r)
        assert gf.data_offset == r.data_offset and list(gf.tensors) == [t.name for t in r.tensors]
        for t in r.tensors:
            view = gf.view(t.name)
            assert view.dtype == t.data.dtype and view.shape == t.data.shape and np.array_equal(view, t.data)


@pytest.mark.slow
def test_parse_matches_gguf_reader_on_real_gemma3():
    from gemma4_harness.harness.core.realdata import gemma3_270m_gguf
    from gemma4_harness.reference.tokenizer import read_gguf_metadata

    path = gemma3_270m_gguf()
    r, gf = gguf.GGUFReader(str(path)), check_gguf(path)
    assert gf.metadata == gguf_metadata(r)
    assert all(np.array_equal(gf.view(t.name), t.data) for t in r.tensors)
    # the tokenizer's own light metadata reader, against the same reader (one 9-12 s GGUFReader open for both)
    assert read_gguf_metadata(path) == {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    _, W = load_model(path)
    check_weights(W)
    check_weights(W, MAX_ABS_FP16)  # its largest |w| (a norm weight) is 1657


# --------------------------------------------------------------------------- the report's faults, named


def test_huge_array_count_is_refused_before_allocating(tiny_gguf, tmp_path):
    k = read_layout(tiny_gguf).keys["gemma4.attention.sliding_window_pattern"]
    bad = _patched(tiny_gguf, tmp_path / "huge.gguf", k.count_off, "<Q", 2**62)
    msg = _error(bad, ModelFileError)
    assert "gemma4.attention.sliding_window_pattern" in msg and str(2**62) in msg


@pytest.mark.parametrize("delta,match", [(4, "offset 2052 is not a multiple of general.alignment 32"),
                                         (-2048, "overlaps tensor token_embd.weight"),
                                         (10**9, "past the end of the file")])
def test_bad_tensor_offset_names_the_tensor(tiny_gguf, tmp_path, delta, match):
    t = next(t for t in read_layout(tiny_gguf).tensors if t.name == "output_norm.weight")
    bad = _patched(tiny_gguf, tmp_path / "offset.gguf", t.offset_off, "<Q", t.rel_offset + delta)
    msg = _error(bad, ModelFileError)
    assert "output_norm.weight" in msg and match in msg


def test_type_swapped_to_another_block_size_names_the_tensor(tiny_gguf, tmp_path):
    t = next(t for t in read_layout(tiny_gguf).tensors if t.name == "blk.0.ffn_up.weight")
    bad = _patched(tiny_gguf, tmp_path / "type.gguf", t.type_off, "<I", int(gguf.GGMLQuantizationType.F16))
    assert "blk.0.ffn_up.weight" in _error(bad, ModelFileError)


@pytest.mark.parametrize("key,fmt,value,match", [
    ("gemma4.final_logit_softcapping", "<f", float("inf"), "expected a positive finite number"),
    ("gemma4.rope.freq_base", "<f", -1.0, "expected a positive finite number"),
    ("gemma4.rope.freq_base_swa", "<f", float("nan"), "expected a positive finite number"),
    ("gemma4.attention.layer_norm_rms_epsilon", "<f", 0.0, "expected 0 < eps < 1"),
    ("gemma4.block_count", "<I", 4294967295, "expected at most 512"),
    ("gemma4.block_count", "<I", 1, "tensor blk.1."),
    ("gemma4.attention.head_count", "<I", 0, "expected a positive integer"),
    ("gemma4.context_length", "<I", 4294967295, "expected at most"),
    ("gemma4.attention.sliding_window", "<I", 0, "expected a positive integer"),
    ("gemma4.attention.head_count_kv", "<I", 3, "is not a multiple of"),
])
def test_nonsensical_number_names_the_key(tiny_gguf, tmp_path, key, fmt, value, match):
    k = read_layout(tiny_gguf).keys[key]
    msg = _error(_patched(tiny_gguf, tmp_path / "num.gguf", k.value_off, fmt, value), ConfigError)
    assert key in msg and match in msg


def test_key_of_the_wrong_gguf_type_is_named(tiny_gguf, tmp_path):
    k = read_layout(tiny_gguf).keys["gemma4.rope.freq_base"]  # FLOAT32 bytes read as UINT32: a huge "valid" base
    msg = _error(_patched(tiny_gguf, tmp_path / "vt.gguf", k.vtype_off, "<I", 4), ConfigError)
    assert "gemma4.rope.freq_base has GGUF type UINT32, expected FLOAT32" in msg


def test_nonzero_padding_is_refused(tiny_gguf, tmp_path):
    t = next(t for t in read_layout(tiny_gguf).tensors if t.name == "rope_freqs.weight")  # 16 bytes, 16 of padding
    msg = _error(_patched(tiny_gguf, tmp_path / "pad.gguf", t.data_start + t.n_bytes + 3, "<B", 7), ModelFileError)
    assert "tensor rope_freqs.weight" in msg and "expected 0x00" in msg


def test_bool_other_than_0_or_1_is_refused(tiny_gguf, tmp_path):
    k = read_layout(tiny_gguf).keys["gemma4.attention.sliding_window_pattern"]
    msg = _error(_patched(tiny_gguf, tmp_path / "bool.gguf", k.value_off, "<B", 2), ConfigError)
    assert "gemma4.attention.sliding_window_pattern" in msg and "expected 0 or 1" in msg


@pytest.mark.parametrize("value,what", [(float("nan"), "is NaN"), (float("-inf"), "is -Inf"),
                                        (1e35, "is 1e+35: |w| > 1e+30"), (3e38, "is 3e+38: |w| > 1e+30")])
@pytest.mark.parametrize("engine", ["reference", "fast"])
def test_bad_weight_is_named_by_both_engines(tiny_gguf, tmp_path, value, what, engine):
    t = next(t for t in read_layout(tiny_gguf).tensors if t.name == "blk.1.attn_k.weight")
    bad = _patched(tiny_gguf, tmp_path / "w.gguf", t.data_start + 4 * 17, "<f", value)
    with pytest.raises(ModelFileError, match=r"tensor blk\.1\.attn_k\.weight: element \[1, 1\] " + re.escape(what)):
        cfg, W = load_model(bad)
        if engine == "reference":
            from gemma4_harness.reference import forward

            forward(cfg, W, [2, 5, 7])
        else:
            from gemma4_harness.fast.model import FastModel

            FastModel(cfg, W, "cpu", "float32")


# --------------------------------------------------------------------------- an unreadable entry is still named


def test_huge_name_length_names_the_entry_by_its_bytes(tiny_gguf, tmp_path):
    """A damaged name length: the entry is named by the printable bytes after it, as the file spells them."""
    t = next(t for t in read_layout(tiny_gguf).tensors if t.name == "blk.1.ffn_up.weight")
    msg = _error(_patched(tiny_gguf, tmp_path / "n.gguf", t.start, "<Q", 2**40), ModelFileError)
    assert "tensor 'blk.1.ffn_up.weight' (#" in msg and f"name length {2**40}" in msg
    k = read_layout(tiny_gguf).keys["gemma4.rope.freq_base"]
    msg = _error(_patched(tiny_gguf, tmp_path / "k.gguf", k.start, "<Q", 2**63), ModelFileError)
    assert "key 'gemma4.rope.freq_base' (#" in msg and f"name length {2**63}" in msg


def test_a_value_too_short_names_its_key(tiny_gguf, tmp_path):
    """A string value's length cut short: the next 'name' is no name, and the key before is named as the fault."""
    k = read_layout(tiny_gguf).keys["general.architecture"]
    msg = _error(_patched(tiny_gguf, tmp_path / "v.gguf", k.lengths[1], "<Q", 3), ModelFileError)
    assert msg.split(": ", 1)[1].startswith("key general.architecture (#0) is followed at byte ")
    assert "its value (type, count or length), or the key entry #1 after it, is damaged" in msg


def test_a_misread_value_names_its_key_not_the_text_after_it(tiny_gguf, tmp_path):
    """BOOL items read as UINT32: the reader lands inside the next key's name, whose text is no entry's name."""
    lay = read_layout(tiny_gguf)
    k = lay.keys["gemma4.attention.sliding_window_pattern"]
    after = list(lay.keys)[list(lay.keys).index(k.name) + 1]
    msg = _error(_patched(tiny_gguf, tmp_path / "t.gguf", k.count_off - 4, "<I", 4), ModelFileError)
    assert msg.split(": ", 1)[1].startswith(f"key {k.name} (#")
    assert f"by text {after!r}: its value (type, count or length)" in msg


def test_a_name_that_is_not_utf8_is_shown(tiny_gguf, tmp_path):
    t = next(t for t in read_layout(tiny_gguf).tensors if t.name == "output_norm.weight")
    msg = _error(_patched(tiny_gguf, tmp_path / "u.gguf", t.start + 8 + 3, "<B", 0xE5), ModelFileError)
    assert "tensor 'out\\xe5ut_norm.weight' (#" in msg and "not valid UTF-8" in msg


def test_truncation_at_a_name_names_the_last_complete_entry(tiny_gguf, tmp_path):
    keys = list(read_layout(tiny_gguf).keys.values())
    k = keys[5]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:k.start + 4])
    msg = _error(cut, ModelFileError)
    assert f"inside the length of key #5; the last complete entry is key {keys[4].name} (#4)" in msg
    cut.write_bytes(tiny_gguf.read_bytes()[:k.start + 12])
    msg = _error(cut, ModelFileError)
    assert f"key '{k.name[:4]}' (#5, after key {keys[4].name}): the file ends inside its name" in msg


# --------------------------------------------------------------------------- stored-form checks against gguf-py


def _blocks(type_name: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` blocks of random bytes whose fp16 scale fields hold random finite values."""
    block, fields = _SCALE_FIELDS[type_name]
    raw = rng.integers(0, 256, size=(n, block), dtype=np.uint8)
    for off, _ in fields:
        raw[:, off:off + 2] = rng.uniform(-2.0, 2.0, n).astype("<f2").view(np.uint8).reshape(n, 2)
    return raw


@pytest.mark.parametrize("type_name", sorted(_SCALE_FIELDS))
def test_scale_fields_are_where_gguf_py_reads_them(type_name):
    qtype = gguf.GGMLQuantizationType[type_name]
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = _blocks(type_name, 4, np.random.default_rng(0))
    clean = gguf.quants.dequantize(raw.reshape(1, -1), qtype).reshape(4, block_elems)
    assert np.all(np.isfinite(clean))
    fields = _SCALE_FIELDS[type_name][1]
    if all(f is not None for _, f in fields):  # the factors bound what the fields can scale to
        bound = sum(np.abs(raw[:, o:o + 2].copy().view("<f2").astype(np.float64)[:, 0]) * f for o, f in fields)
        assert np.all(np.abs(clean).max(axis=1) <= bound * (1 + 1e-6))
    for off, _ in fields:
        bad = raw.copy()
        bad[2, off:off + 2] = np.array([0x7C00], dtype="<u2").view(np.uint8)  # +Inf in block 2
        with np.errstate(invalid="ignore"):  # gguf-py multiplies the Inf by zero codes
            out = gguf.quants.dequantize(bad.reshape(1, -1), qtype).reshape(4, block_elems)
        assert not np.all(np.isfinite(out[2])) and np.all(np.isfinite(out[[0, 1, 3]]))
        with pytest.raises(ModelFileError, match=f"block 2 \\({type_name}\\) has a scale field of Inf"):
            check_stored("f.gguf", "w", type_name, bad.reshape(1, -1), (1, 4 * block_elems))


def test_fp16_limit_uses_scale_times_code():
    rng = np.random.default_rng(1)
    raw = _blocks("Q8_0", 8, rng)
    raw[:, 2:] = 127  # every code at its largest
    raw[5, 0:2] = np.array([1000.0], dtype="<f2").view(np.uint8)  # |w| = 127000 > 65504
    check_stored("f.gguf", "w", "Q8_0", raw.reshape(1, -1), (1, 256), MAX_ABS_FP32)
    with pytest.raises(ModelFileError, match=r"block 5 \(Q8_0\) has scales that allow \|w\| up to 128000"):
        check_stored("f.gguf", "w", "Q8_0", raw.reshape(1, -1), (1, 256), MAX_ABS_FP16)


@pytest.mark.parametrize("type_name,bits", [("F16", 0x7E00), ("BF16", 0x7F80), ("BF16", 0x7F7F)])
def test_half_types_checked_on_their_bits(type_name, bits):
    vals = np.full(64, 0x3C00 if type_name == "F16" else 0x3F80, dtype="<u2")
    vals[37] = bits
    with pytest.raises(ModelFileError, match=r"element \[1, 5\]"):
        check_stored("f.gguf", "w", type_name, vals.view(np.uint8).reshape(2, 64), (2, 32))


def test_rope_freqs_must_be_positive():
    check_stored("f.gguf", "rope_freqs.weight", "F32", np.array([1.0, 1e30, 1e30], dtype=np.float32), (3,))
    with pytest.raises(ModelFileError, match="rope_freqs.weight: element \\[1\\] is 0: expected a positive factor"):
        check_stored("f.gguf", "rope_freqs.weight", "F32", np.array([1.0, 0.0], dtype=np.float32), (2,))


def test_random_garbage_never_escapes_as_another_error(tmp_path):
    """Random bytes behind a valid magic and version: always an InputError (a smoke test of the bounds)."""
    rnd = random.Random(0)
    for i in range(200):
        body = bytes(rnd.getrandbits(8) for _ in range(rnd.randrange(0, 300)))
        p = tmp_path / f"g{i}.gguf"
        p.write_bytes(b"GGUF" + struct.pack("<I", 3) + body)
        with pytest.raises(InputError):
            load_model(p)
