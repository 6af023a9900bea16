"""Hostile input at the edge of every command: each gets exit 2 and one line naming what is wrong, before
any work starts (and never a traceback, an allocator error, or exit 0 with a wrong result).

Each test below is one item a user tried as an adversary (the "hostile input" issue): a prompt file that
is not UTF-8, token ids beyond int64 or nested, out-of-range ids and over-long prompts in the transformers
engine, ``--device tpu``, an escape that names no character, ``--max-new-tokens 10**12``, ``--out`` at a
folder or under a file, unknown cases and engines, negative bench sizes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clitools import assert_one_line_error, run_cli
from conftest import TINY


def _prompt(tmp_path: Path, content, name: str = "p.json") -> Path:
    p = tmp_path / name
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content if isinstance(content, str) else json.dumps(content))
    return p


def _logits(model, prompt, out, *extra):
    return run_cli("logits", "--model", str(model), "--prompt-ids", str(prompt), "--out", str(out), *extra)


def test_prompt_file_not_utf8(tiny_gguf, tmp_path):
    p = _prompt(tmp_path, b"[2, 3, \xff\xfe]")
    assert_one_line_error(_logits(tiny_gguf, p, tmp_path / "o.npy"), "p.json")


@pytest.mark.parametrize("ids", [[2, 2**63], [2, 10**30], [2, -2**64]])
def test_token_id_beyond_int64(tiny_gguf, tmp_path, ids):
    line = assert_one_line_error(_logits(tiny_gguf, _prompt(tmp_path, ids), tmp_path / "o.npy"), str(ids[1]))
    assert str(TINY["vocab"]) in line


def test_token_id_that_is_a_list(tiny_gguf, tmp_path):
    assert_one_line_error(_logits(tiny_gguf, _prompt(tmp_path, [2, [3, 4]]), tmp_path / "o.npy"), "p.json")


def test_transformers_engine_ids_out_of_range_and_too_long(tmp_path):
    """The transformers engine checks ids and length itself (it would index out of range, or run past its
    positions and exit 0)."""
    from gemma4_harness.harness import synth
    from gemma4_harness.harness.core.cases import MODELS_DIR

    built = synth.ensure_built(MODELS_DIR / "e2b.toml")
    vocab = built.spec.config["vocab_size"]
    line = assert_one_line_error(run_cli("logits", "--model", str(built.hf_dir), "--engine", "transformers",
                                         "--prompt-ids", str(_prompt(tmp_path, [2, vocab + 5])),
                                         "--out", str(tmp_path / "o.npy")), str(vocab + 5))
    assert str(vocab) in line
    context = json.loads((built.hf_dir / "config.json").read_text())["max_position_embeddings"]
    long = _prompt(tmp_path, [2] + [5] * context, "long.json")
    assert_one_line_error(run_cli("logits", "--model", str(built.hf_dir), "--engine", "transformers",
                                  "--prompt-ids", str(long), "--out", str(tmp_path / "o.npy")), str(context))


def test_unknown_device(tiny_gguf, tmp_path):
    p = _prompt(tmp_path, [2, 3])
    assert_one_line_error(_logits(tiny_gguf, p, tmp_path / "o.npy", "--engine", "fast", "--device", "tpu"), "tpu")


def test_escape_that_names_no_character(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("a\\uD800b\n")
    gguf = Path(__file__).resolve().parents[1] / "cases" / "data" / "gemma3-tokenizer" / "tokenizer.model"
    assert_one_line_error(run_cli("tokenize", "--tokenizer", str(gguf), "--engine", "ours", "--text-file", str(text),
                                  "--escapes", "--out", str(tmp_path / "o.jsonl")), "uD800")


def test_max_new_tokens_beyond_the_context(tiny_gguf, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt_ids": [2, 3, 4]}) + "\n")
    for engine in ("fast", "reference"):
        proc = run_cli("generate", "--model", str(tiny_gguf), "--engine", engine, "--prompts", str(prompts),
                       "--max-new-tokens", str(10**12), "--out", str(tmp_path / "o.jsonl"), timeout=60)
        assert_one_line_error(proc, str(TINY["context"]))


@pytest.mark.slow
def test_out_is_checked_before_any_work(tiny_gguf, tmp_path):
    p = _prompt(tmp_path, [2, 3])
    assert_one_line_error(_logits(tiny_gguf, p, tmp_path), "--out")  # a folder
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_one_line_error(_logits(tiny_gguf, p, blocker / "o.npy"), "is a file")
    assert_one_line_error(run_cli("parity", "--model", str(tiny_gguf), "--out", str(blocker)), "--out")


@pytest.mark.slow
def test_out_of_bench_and_selftest_is_checked_before_any_work(tmp_path):
    """The other commands whose --out is a folder of run directories: an existing file is refused up front."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_one_line_error(run_cli("bench", "--model", "e2b", "--engines", "reference", "--out", str(blocker)), "--out")
    assert_one_line_error(run_cli("selftest", "--out", str(blocker)), "--out")
    assert blocker.read_text() == "x"


@pytest.mark.slow
def test_unknown_case_and_engine(tiny_gguf, tmp_path):
    runs = tmp_path / "runs"
    assert_one_line_error(run_cli("parity", "--case", "nosuchcase", "--out", str(runs)), "nosuchcase")
    assert_one_line_error(run_cli("parity", "--model", str(tiny_gguf), "--against", "nosuch", "--out",
                                  str(runs)), "nosuch")
    assert_one_line_error(run_cli("parity", "--skip", "nosuch", "--out", str(runs)), "nosuch")
    assert not runs.exists() or not any(runs.iterdir())  # nothing ran, no run directory


@pytest.mark.parametrize("flag,value", [("--pp", "-5"), ("--tg", "-1"), ("--batch", "0"), ("--batch", "100000"),
                                        ("--depth", "-3"), ("--reps", "0")])
def test_bench_sizes_are_bounded(tmp_path, flag, value):
    proc = run_cli("bench", "--model", "e2b", "--engines", "reference", flag, value, "--out", str(tmp_path),
                   timeout=120)
    assert_one_line_error(proc, flag.lstrip("-"), value)


# --------------------------------------------------------------------------- damaged GGUFs, end to end


def _damaged(tiny: Path, out: Path, damage: str) -> Path:
    """The tiny GGUF with one of the report's damages (field offsets from ``gguf.GGUFReader`` on the clean file)."""
    import struct

    from gguf_mutate import read_layout

    lay = read_layout(tiny)
    keys, tensors = lay.keys, {t.name: t for t in lay.tensors}
    where = {
        "huge array count": (keys["gemma4.attention.sliding_window_pattern"].count_off, "<Q", 2**62),
        "misaligned offset": (tensors["output_norm.weight"].offset_off, "<Q",
                              tensors["output_norm.weight"].rel_offset + 4),
        "offset into another tensor": (tensors["output_norm.weight"].offset_off, "<Q",
                                       tensors["token_embd.weight"].rel_offset),
        "type of another block size": (tensors["blk.0.ffn_up.weight"].type_off, "<I", 1),  # F32 -> F16
        "softcap inf": (keys["gemma4.final_logit_softcapping"].value_off, "<f", float("inf")),
        "freq_base -1": (keys["gemma4.rope.freq_base"].value_off, "<f", -1.0),
        "block_count 2**32-1": (keys["gemma4.block_count"].value_off, "<I", 2**32 - 1),
        "NaN weight": (tensors["blk.1.attn_k.weight"].data_start + 4 * 17, "<f", float("nan")),
        "3e38 weight": (tensors["blk.1.attn_k.weight"].data_start + 4 * 17, "<f", 3e38),
    }
    off, fmt, value = where[damage]
    buf = bytearray(tiny.read_bytes())
    struct.pack_into(fmt, buf, off, value)
    out.write_bytes(bytes(buf))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("damage,engine,named", [
    ("huge array count", "reference", "gemma4.attention.sliding_window_pattern"),  # was: a hang
    ("misaligned offset", "fast", "output_norm.weight"),  # was: exit 0 with wrong logits
    ("offset into another tensor", "reference", "output_norm.weight"),
    ("type of another block size", "fast", "blk.0.ffn_up.weight"),
    ("softcap inf", "fast", "gemma4.final_logit_softcapping"),  # was: exit 0 with NaN
    ("freq_base -1", "reference", "gemma4.rope.freq_base"),
    ("NaN weight", "fast", "blk.1.attn_k.weight"),
    ("3e38 weight", "fast", "blk.1.attn_k.weight"),
    ("block_count 2**32-1", "reference", "gemma4.block_count"),  # was: a MemoryError traceback
])
def test_damaged_gguf_is_one_line_and_exit_2(tiny_gguf, tmp_path, damage, engine, named):
    """Each damaged file of the report, through ``g4h logits`` with the engine it fooled: exit 2, one line."""
    bad = _damaged(tiny_gguf, tmp_path / "bad.gguf", damage)
    p = _prompt(tmp_path, [2, 5, 7])
    line = assert_one_line_error(_logits(bad, p, tmp_path / "o.npy", "--engine", engine, "--device", "cpu"), named)
    assert "bad.gguf" in line and not (tmp_path / "o.npy").exists()


@pytest.mark.slow
@pytest.mark.parametrize("value,says", [(float("nan"), "is NaN"), (3e38, "3e+38")], ids=["nan", "3e38"])
def test_transformers_engine_checks_its_weights(tmp_path, value, says):
    """The oracle too: a NaN weight in an HF folder gave 1536/1536 NaN logits and exit 0; now one line naming
    the parameter (as transformers names it) and the element."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from gemma4_harness.harness import synth
    from gemma4_harness.harness.core.cases import MODELS_DIR

    hf = shutil.copytree(synth.ensure_built(MODELS_DIR / "e2b.toml").hf_dir, tmp_path / "hf")
    tensors = load_file(hf / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = value
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "o.npy"
    line = assert_one_line_error(run_cli("logits", "--model", str(hf), "--engine", "transformers", "--prompt-ids",
                                         str(_prompt(tmp_path, [2, 5, 7])), "--out", str(out)),
                                 "model.layers.1.mlp.up_proj.weight")
    assert "[3, 5]" in line and says in line and not out.exists()


@pytest.mark.slow
def test_transformers_engine_generation_beyond_the_context(tmp_path):
    """Generation included: prompt + --max-new-tokens past the context is refused before any step (transformers
    would run past its positions)."""
    from gemma4_harness.harness import synth
    from gemma4_harness.harness.core.cases import MODELS_DIR

    built = synth.ensure_built(MODELS_DIR / "e2b.toml")
    context = json.loads((built.hf_dir / "config.json").read_text())["max_position_embeddings"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt_ids": [2, 3, 4]}) + "\n")
    out = tmp_path / "o.jsonl"
    proc = run_cli("generate", "--model", str(built.hf_dir), "--engine", "transformers", "--prompts", str(prompts),
                   "--max-new-tokens", str(context), "--out", str(out), timeout=120)
    assert_one_line_error(proc, str(context))
    assert not out.exists()
