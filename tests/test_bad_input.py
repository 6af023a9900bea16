"""The CLI contract for bad input (``docs/design.md``, "Reports and errors").

``g4h logits --model PATH --engine reference --prompt-ids FILE.json --out FILE.npy``
on bad input must print exactly one non-empty line on stderr that names the
offending file, key, tensor or token id, exit with code 2, and never show a
traceback. The CLI runs in a subprocess (``python -m gemma4_harness.harness.cli``) from the
repository root, as a user would run it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from clitools import assert_one_line_error, run_cli

from conftest import TINY

REPO_ROOT = Path(__file__).resolve().parent.parent
CLI_TIMEOUT_S = 120


def run_logits(model: Path | str, prompt: Path | str, out: Path | str, engine: str = "reference"):
    """Run ``g4h logits`` in a subprocess; return the CompletedProcess (text mode)."""
    return run_cli("logits", "--model", str(model), "--engine", engine, "--prompt-ids", str(prompt),
                   "--out", str(out), timeout=CLI_TIMEOUT_S)


def write_prompt(tmp_path: Path, content, name: str = "prompt.json") -> Path:
    p = tmp_path / name
    p.write_text(content if isinstance(content, str) else json.dumps(content))
    return p


@pytest.fixture
def prompt(tmp_path) -> Path:
    """A valid prompt of 5 token ids."""
    return write_prompt(tmp_path, [2, 5, 7, 11, 13])


# --------------------------------------------------------------------------- the valid case


def test_valid_tiny_gguf_gives_logits(tiny_gguf, prompt, tmp_path):
    out = tmp_path / "logits.npy"
    proc = run_logits(tiny_gguf, prompt, out)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stderr}\n{proc.stdout}"
    assert "Traceback" not in proc.stderr
    logits = np.load(out)
    assert logits.shape == (5, TINY["vocab"])
    assert np.all(np.isfinite(logits))
    # Same numbers as the reference called in-process.
    from gemma4_harness.reference import forward, load_model

    cfg, weights = load_model(tiny_gguf)
    np.testing.assert_allclose(logits, forward(cfg, weights, [2, 5, 7, 11, 13]), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- bad model files


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.02], ids=["half", "tail-cut", "header-cut"])
def test_truncated_gguf(tiny_gguf, prompt, tmp_path, keep):
    data = tiny_gguf.read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[: int(len(data) * keep)])
    line = assert_one_line_error(run_logits(bad, prompt, tmp_path / "o.npy"), bad.name)
    assert "Traceback" not in line


def test_random_bytes_not_gguf(prompt, tmp_path):
    bad = tmp_path / "random.gguf"
    bad.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    assert_one_line_error(run_logits(bad, prompt, tmp_path / "o.npy"), bad.name)


def test_text_file_not_gguf(prompt, tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("this is not a model\n" * 10)
    assert_one_line_error(run_logits(bad, prompt, tmp_path / "o.npy"), bad.name)


def test_empty_file(prompt, tmp_path):
    bad = tmp_path / "empty.gguf"
    bad.write_bytes(b"")
    assert_one_line_error(run_logits(bad, prompt, tmp_path / "o.npy"), bad.name)


def test_wrong_architecture(make_tiny_gguf, prompt, tmp_path):
    bad = make_tiny_gguf("llama.gguf", arch="llama")
    line = assert_one_line_error(run_logits(bad, prompt, tmp_path / "o.npy"), "general.architecture", "llama")
    assert bad.name in line or "llama" in line


@pytest.mark.parametrize("tensor", ["blk.1.ffn_down.weight", "output_norm.weight", "blk.0.attn_k_norm.weight"])
def test_missing_tensor(make_tiny_gguf, prompt, tmp_path, tensor):
    bad = make_tiny_gguf("missing.gguf", drop=(tensor,))
    assert_one_line_error(run_logits(bad, prompt, tmp_path / "o.npy"), tensor)


@pytest.mark.parametrize("tensor,shape", [
    ("blk.0.attn_k.weight", (16, 16)),  # expected (8, 16)
    ("blk.1.ffn_up.weight", (16, 32)),  # transposed
    ("output_norm.weight", (15,)),
])
def test_misshaped_tensor(make_tiny_gguf, prompt, tmp_path, tensor, shape):
    bad = make_tiny_gguf("misshaped.gguf", reshape={tensor: shape})
    assert_one_line_error(run_logits(bad, prompt, tmp_path / "o.npy"), tensor)


def test_nonexistent_model_path(prompt, tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    assert_one_line_error(run_logits(missing, prompt, tmp_path / "o.npy"), missing.name)


def test_nonexistent_model_folder(prompt, tmp_path):
    missing = tmp_path / "no-such-dir" / "model"
    assert_one_line_error(run_logits(missing, prompt, tmp_path / "o.npy"), "no-such-dir")


# --------------------------------------------------------------------------- bad prompts


@pytest.mark.parametrize("content", [
    "not json at all",
    '{"ids": [1, 2]}',
    '[1, "two", 3]',
    "[1.5, 2]",
    "[[1, 2], [3]]",
    "[true, false]",
    "[1, null]",
    "42",
    "",
], ids=["not-json", "object", "string-item", "float-item", "nested", "bools", "null-item", "scalar", "empty-file"])
def test_prompt_not_a_json_list_of_ints(tiny_gguf, tmp_path, content):
    p = write_prompt(tmp_path, content, name="bad-prompt.json")
    assert_one_line_error(run_logits(tiny_gguf, p, tmp_path / "o.npy"), p.name)


def test_prompt_empty_list(tiny_gguf, tmp_path):
    p = write_prompt(tmp_path, [], name="empty-prompt.json")
    assert_one_line_error(run_logits(tiny_gguf, p, tmp_path / "o.npy"), p.name, "empty")


def test_prompt_file_missing(tiny_gguf, tmp_path):
    p = tmp_path / "no-such-prompt.json"
    assert_one_line_error(run_logits(tiny_gguf, p, tmp_path / "o.npy"), p.name)


@pytest.mark.parametrize("bad_id", [TINY["vocab"], 10**6, -1])
def test_token_id_out_of_range(tiny_gguf, tmp_path, bad_id):
    p = write_prompt(tmp_path, [2, 3, bad_id, 4])
    line = assert_one_line_error(run_logits(tiny_gguf, p, tmp_path / "o.npy"), str(bad_id))
    assert str(TINY["vocab"]) in line  # says what was expected: ids below the vocabulary size


def test_prompt_longer_than_context(tiny_gguf, tmp_path):
    p = write_prompt(tmp_path, [1] * (TINY["context"] + 1))
    assert_one_line_error(run_logits(tiny_gguf, p, tmp_path / "o.npy"), str(TINY["context"]))


# --------------------------------------------------------------------------- bad output path


def test_output_path_not_writable(tiny_gguf, prompt, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = blocker / "logits.npy"  # parent is a regular file: cannot be created
    assert_one_line_error(run_logits(tiny_gguf, prompt, out), "a-file")


def test_no_output_written_on_error(tiny_gguf, tmp_path):
    p = write_prompt(tmp_path, [2, 3, TINY["vocab"]])
    out = tmp_path / "o.npy"
    run_logits(tiny_gguf, p, out)
    assert not out.exists(), "a failed run must not leave a (partial) output file"
