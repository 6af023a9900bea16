"""Hostile input, second round (issue 26): files that are not regular files, bottomless inputs, outputs at devices and
symlinks, config values of other types, damaged tokenizer tables, keys of another architecture, and the order of a
warning and an error line. Everything runs in this process (``g4h`` through ``harness.cli.main``): cheap.

The reader is ``reference/files.py``, the writer ``harness.core.io.open_output``, the argument types
``harness/cli/_args.py`` (their every option: ``tests/test_arg_probe.py``).
"""

from __future__ import annotations

import math
import os
import socket
import stat
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, write_tiny_gguf

from gemma4_harness.harness.cli import main as g4h
from gemma4_harness.harness.core.io import OutputError, open_output, save_npy_atomic, write_text_atomic
from gemma4_harness.reference.audio_features import MelConfig
from gemma4_harness.reference.errors import ConfigError, InputError, ModelFileError
from gemma4_harness.reference.files import read_bytes, read_text
from gemma4_harness.reference.gguf_check import check_gguf
from gemma4_harness.reference.image_processing import ImageProcessorConfig


def run(capsys, *argv: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    try:
        rc = g4h([str(a) for a in argv])
    except SystemExit as e:  # argparse refusing a value
        rc = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return rc, [ln for ln in err.splitlines() if ln.strip()]


def one_line(capsys, *argv: str, names: str) -> str:
    rc, lines = run(capsys, *argv)
    assert rc == 2 and len(lines) == 1 and names in lines[0], (rc, lines)
    return lines[0]


@pytest.fixture
def fifo(tmp_path) -> Path:
    p = tmp_path / "fifo"
    os.mkfifo(p)
    return p


# --------------------------------------------------------------------------- the reader


def test_reader_takes_a_regular_file_and_a_pipe_and_refuses_the_rest(tmp_path, fifo, monkeypatch):
    monkeypatch.setenv("G4H_INPUT_TIMEOUT_S", "0.5")
    (tmp_path / "f.txt").write_bytes(b"abc")
    assert read_bytes(tmp_path / "f.txt") == b"abc"
    with pytest.raises(InputError, match="3 bytes, more than the 2 bytes"):
        read_bytes(tmp_path / "f.txt", max_bytes=2)
    t0 = time.monotonic()  # a FIFO nobody writes to: a bounded wait, then one line (it blocked forever)
    with pytest.raises(InputError, match=r"fifo: the input did not end within 0.5 s \(nothing received"):
        read_bytes(fifo)
    assert time.monotonic() - t0 < 5
    with pytest.raises(InputError, match="fifo: is a FIFO, expected a regular file"):
        read_bytes(fifo, streams=False)  # not even opened blocking

    def writer():
        with open(fifo, "wb") as w:
            w.write(b"[2, 3]")

    th = threading.Thread(target=writer)
    th.start()
    assert read_bytes(fifo) == b"[2, 3]"  # a pipe with a writer: read to its end
    th.join()
    with pytest.raises(InputError, match="/dev/zero: more than the 1 KiB this input may hold"):
        read_bytes("/dev/zero", max_bytes=1024)  # grew to 9 GB before
    assert read_bytes("/dev/null") == b""
    with pytest.raises(InputError, match="is a folder"):
        read_bytes(tmp_path)
    with pytest.raises(InputError, match="no-such: no such file"):
        read_bytes(tmp_path / "no-such")
    (tmp_path / "bad.txt").write_bytes(b"ok\xff")
    with pytest.raises(InputError, match=r"not UTF-8 text \(invalid byte 0xff at offset 2\)"):
        read_text(tmp_path / "bad.txt")
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfok\xff")  # the offset is the file's, the BOM counted
    with pytest.raises(InputError, match=r"not UTF-8 text \(invalid byte 0xff at offset 5\)"):
        read_text(tmp_path / "bom.txt")


def test_a_model_at_a_fifo_or_device_is_refused_at_once(fifo, tmp_path):
    for path in (fifo, Path("/dev/zero")):
        t0 = time.monotonic()
        with pytest.raises(ModelFileError, match=f"{path}: is a (FIFO|character device), expected a regular file"):
            check_gguf(path)  # inspect and every engine open the file here; the FIFO blocked them forever
        assert time.monotonic() - t0 < 5


def test_cli_inputs_at_pipes_and_devices(capsys, tiny_gguf, tmp_path, fifo, monkeypatch):
    out = tmp_path / "o.npy"
    one_line(capsys, "logits", "--model", tiny_gguf, "--prompt-ids", "/dev/zero", "--out", out,
             names="/dev/zero: more than the 256 MiB")
    monkeypatch.setenv("G4H_INPUT_TIMEOUT_S", "0.5")
    one_line(capsys, "logits", "--model", tiny_gguf, "--prompt-ids", fifo, "--out", out, names="did not end within")
    one_line(capsys, "inspect", fifo, names="is a FIFO")
    one_line(capsys, "logits", "--model", "/dev/zero", "--prompt-ids", fifo, "--out", out,
             names="--model: /dev/zero: is a character device")
    assert not out.exists()


# --------------------------------------------------------------------------- the writer


def test_writer_replaces_files_follows_symlinks_and_never_replaces_a_device(tmp_path, fifo):
    f = tmp_path / "a.txt"
    write_text_atomic(f, "one")
    write_text_atomic(f, "two")
    assert f.read_text() == "two"
    target, link = tmp_path / "target.txt", tmp_path / "link.txt"
    target.write_text("old")
    link.symlink_to(target)
    write_text_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "new"  # the link stays; its target was replaced
    write_text_atomic("/dev/null", "through")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)  # still a device (was replaced by a regular file)
    with pytest.raises(OutputError, match=r"/dev/full: cannot write output \(No space left on device\)"):
        save_npy_atomic("/dev/full", np.zeros((3, 4)))
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)
    with pytest.raises(OutputError, match="fifo: a FIFO with no reader"):
        write_text_atomic(fifo, "x")
    got = []
    th = threading.Thread(target=lambda: got.append(Path(fifo).read_bytes()))
    th.start()
    time.sleep(0.2)
    with open_output(fifo) as w:
        w.write(b"streamed")
    th.join(5)
    assert got == [b"streamed"] and stat.S_ISFIFO(os.stat(fifo).st_mode)
    with pytest.raises(OutputError, match="is a folder"):
        write_text_atomic(tmp_path, "x")
    sock_path = tmp_path / "s.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock_path))
    try:
        with pytest.raises(OutputError, match="s.sock: is a socket"):
            write_text_atomic(sock_path, "x")
    finally:
        s.close()
    assert isinstance(OutputError("x"), (InputError, OSError))


def test_cli_out_at_a_device(capsys, tiny_gguf, tmp_path):
    prompt = tmp_path / "p.json"
    prompt.write_text("[2, 3]")
    one_line(capsys, "logits", "--model", tiny_gguf, "--prompt-ids", prompt, "--out", "/dev/full",
             names="/dev/full: cannot write output (No space left on device)")
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)  # the finding: it became a 12 KB regular file
    rc, _ = run(capsys, "logits", "--model", tiny_gguf, "--prompt-ids", prompt, "--out", "/dev/null")
    assert rc == 0 and stat.S_ISCHR(os.stat("/dev/null").st_mode)


# --------------------------------------------------------------------------- config values of other types


def test_processor_config_values_as_transformers_takes_them():
    """``"mel_floor": "0.001"`` (transformers: ``np.array(v, dtype=np.float64)``) was a TypeError and exit 1."""
    assert MelConfig.from_dict({"mel_floor": "0.001"}, "p.json").mel_floor == 0.001
    assert MelConfig.from_dict({"sampling_rate": 16000.0}, "p.json").sampling_rate == 16000
    for key, value, says in [("mel_floor", "abc", "a number"), ("frame_length_ms", "20", "a number"),
                             ("fft_overdrive", "false", "true or false"), ("per_bin_mean", ["a"], "a list of numbers"),
                             ("feature_size", 1.5, "a positive integer"), ("dither", float("nan"), "finite")]:
        with pytest.raises(ConfigError, match=f"p.json: {key} = .*: expected (a )?{says}"):
            MelConfig.from_dict({key: value}, "p.json")


def _value_kinds(v):
    """Values of other types for a config value ``v``: its number as a string, text, a bool, null, a list, an object,
    NaN, a negative, a huge number."""
    out = ["abc", True, None, [1, 2], {"a": 1}, float("nan"), -1, 10**30, 1e308]
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        out.append(str(v))
    return out


@pytest.mark.parametrize("which", ["audio", "image"])
def test_every_processor_field_of_every_type_is_one_line_or_taken(which):
    """Generated from the configs' own fields: a new field is probed without editing this test."""
    import dataclasses

    cls = MelConfig if which == "audio" else ImageProcessorConfig
    base = {f.name: getattr(cls(), f.name) for f in dataclasses.fields(cls) if f.name != "source"}
    for key, v in base.items():
        for bad in _value_kinds(v):
            try:
                cls.from_dict({**base, key: bad}, "processor_config.json")
            except ConfigError as e:
                assert "\n" not in str(e) and "processor_config.json" in str(e), str(e)
            except Exception as e:  # noqa: BLE001 - the finding
                pytest.fail(f"{which} {key} = {bad!r}: {type(e).__name__}: {e}")


def test_every_hf_config_key_of_every_type_is_one_line_or_taken(tmp_path):
    """Every key of a Gemma 4 ``config.json`` (the e2b case's: PLE, KV sharing; generated from the file, nested
    objects one level down), given values of other types: the loader takes it or says one line naming the file."""
    import json
    import shutil

    from gemma4_harness.harness import synth
    from gemma4_harness.harness.core.cases import MODELS_DIR
    from gemma4_harness.reference.config_hf import config_from_hf

    src = synth.ensure_built(MODELS_DIR / "e2b.toml").hf_dir
    raw = json.loads((src / "config.json").read_text())
    paths = [(k,) for k in raw] + [(k, k2) for k, v in raw.items() if isinstance(v, dict) for k2 in v]
    n = 0
    for path in paths:
        v = raw[path[0]] if len(path) == 1 else raw[path[0]][path[1]]
        for bad in _value_kinds(v):
            doc = json.loads(json.dumps(raw))
            (doc if len(path) == 1 else doc[path[0]])[path[-1]] = bad
            try:
                config_from_hf(doc, str(tmp_path / "config.json"))
            except InputError as e:
                assert "\n" not in str(e) and "config.json" in str(e), (path, bad, str(e))
            except Exception as e:  # noqa: BLE001 - the finding
                pytest.fail(f"{'.'.join(path)} = {bad!r}: {type(e).__name__}: {e}")
            n += 1
    assert n > 300
    shutil.rmtree(tmp_path, ignore_errors=True)


# --------------------------------------------------------------------------- keys, context, tokenizer tables, warnings


def test_unknown_keys_allowed_unless_a_needed_key_is_misspelt(tmp_path):
    import gguf

    VT = gguf.GGUFValueType
    copy = write_tiny_gguf(tmp_path / "copy.gguf", extra_kv=[("gemma3.context_length", 64, VT.UINT32, None),
                                                             ("gemma3.block_count", 2, VT.UINT32, None)])
    check_gguf(copy)  # gemma3.* beside gemma4.*: refused as a misspelling before
    near = ("gemma4.final_logit_softcappinh", 30.0, VT.FLOAT32, None)
    check_gguf(write_tiny_gguf(tmp_path / "both.gguf", extra_kv=[near]))  # the real key is there too
    missing = write_tiny_gguf(tmp_path / "typo.gguf", extra_kv=[near], skip_kv=("gemma4.final_logit_softcapping",))
    with pytest.raises(ConfigError, match="key gemma4.final_logit_softcappinh is unknown, one character from "
                                          "gemma4.final_logit_softcapping, which the file does not hold"):
        check_gguf(missing)


def test_context_shorter_than_the_prompt_names_file_and_key(capsys, tiny_gguf, tmp_path):
    prompt = tmp_path / "long.json"
    prompt.write_text(str([2] * (TINY["context"] + 1)))
    one_line(capsys, "logits", "--model", tiny_gguf, "--prompt-ids", prompt, "--out", tmp_path / "o.npy",
             names=f"{tiny_gguf}: key gemma4.context_length = {TINY['context']}")


def _vocab(tmp_path, name, **changes):
    from gemma4_harness.harness.tokenizer.build import write_vocab_gguf

    byte = [f"<0x{i:02X}>" for i in range(256)]
    meta = {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": ["a", "b", "ab", "QQ"] + byte,
            "tokenizer.ggml.token_type": [1, 1, 1, 1] + [6] * 256, "tokenizer.ggml.merges": ["a b"]}
    for k, (i, v) in changes.items():
        meta[f"tokenizer.ggml.{k}"] = list(meta.get(f"tokenizer.ggml.{k}") or [0.0] * 260)
        meta[f"tokenizer.ggml.{k}"][i] = v
    return write_vocab_gguf(tmp_path / name, meta)


@pytest.mark.parametrize("damage,says", [
    ({"tokens": (3, "")}, "tokenizer.ggml.tokens[3] is empty"),
    ({"tokens": (3, "a")}, "tokenizer.ggml.tokens[3] = 'a' repeats tokens[0]"),
    ({"token_type": (2, 99)}, "tokenizer.ggml.token_type[2] = 99: expected a token type 0-6"),
    ({"scores": (5, math.nan)}, "tokenizer.ggml.scores[5] = nan: expected a finite number"),
    ("utf8", "tokenizer.ggml.tokens[3] is not valid UTF-8"),
], ids=["empty", "duplicate", "type-99", "nan-score", "bad-utf8"])
def test_damaged_tokenizer_tables_are_one_line(capsys, tmp_path, damage, says):
    if damage == "utf8":
        path = _vocab(tmp_path, "v.gguf")
        data = path.read_bytes()
        path.write_bytes(data.replace(b"QQ", b"\xff\xfe", 1))  # same length: only the token's bytes change
    else:
        path = _vocab(tmp_path, "v.gguf", **damage)
    text = tmp_path / "t.txt"
    text.write_text("ab\n")
    one_line(capsys, "tokenize", "--tokenizer", path, "--text-file", text, "--out", tmp_path / "o.jsonl", names=says)


def test_truncated_code_point_escape_is_named(capsys, tmp_path):
    """``\\u12`` (a truncated code point) was tokenized as text; ``\\x4`` is no escape of the format and stays."""
    from gemma4_harness.harness.tokenizer.corpus import unescape

    text = tmp_path / "t.txt"
    text.write_text("ab\\u12\n")
    one_line(capsys, "tokenize", "--tokenizer", _vocab(tmp_path, "v.gguf"), "--text-file", text, "--escapes",
             "--out", tmp_path / "o.jsonl", names="escape \\u12: expected \\u and 4 hex digits")
    assert unescape("a\\x4\\d\\u0041") == "a\\x4\\dA"


def test_a_library_warning_never_precedes_the_error_line(capsys, monkeypatch):
    """A NumPy RuntimeWarning was printed before the one error line: held, and shown only when a command succeeds."""
    import gemma4_harness.harness.cli.inspect as cmd

    def warns_then_fails(args):
        warnings.warn("overflow encountered in multiply", RuntimeWarning)
        raise InputError("x.gguf: something is wrong")

    monkeypatch.setattr(cmd, "run", warns_then_fails)
    rc, lines = run(capsys, "inspect", __file__)
    assert rc == 2 and lines == ["g4h: error: x.gguf: something is wrong"]

    def warns_and_succeeds(args):
        warnings.warn("overflow encountered in multiply", RuntimeWarning)
        return 0

    monkeypatch.setattr(cmd, "run", warns_and_succeeds)
    rc, lines = run(capsys, "inspect", __file__)
    assert rc == 0 and lines == ["g4h: warning: RuntimeWarning: overflow encountered in multiply"]
