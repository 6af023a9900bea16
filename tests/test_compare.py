"""``g4h compare``: logits and greedy outputs an engine already wrote, against a file or an engine."""

from __future__ import annotations

import json

import numpy as np
import pytest
from clitools import assert_one_line_error, run_cli


def _ids(tmp_path, ids=(2, 5, 7, 11, 13, 17)):
    p = tmp_path / "p.json"
    p.write_text(json.dumps(list(ids)))
    return p


def _reference_logits(tiny_gguf, tmp_path):
    out = tmp_path / "ref.npy"
    proc = run_cli("logits", "--model", str(tiny_gguf), "--prompt-ids", str(_ids(tmp_path)), "--out", str(out),
                   "--out-dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.slow
def test_intact_logits_pass_and_perturbed_fail(tiny_gguf, tmp_path):
    ref = _reference_logits(tiny_gguf, tmp_path)
    same = run_cli("compare", str(ref), "--against", "reference", "--model", str(tiny_gguf),
                   "--prompt-ids", str(_ids(tmp_path)))
    assert same.returncode == 0, same.stdout + same.stderr
    assert "PASS" in same.stdout.splitlines()[-1]
    z = np.load(ref)
    z[3, :] += np.linspace(0, 0.5, z.shape[1], dtype=np.float32)  # a fault at one position
    bad = tmp_path / "bad.npy"
    np.save(bad, z)
    proc = run_cli("compare", str(bad), str(ref))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "oracle~engine.max_abs_logit" in proc.stdout.splitlines()[-1]


@pytest.mark.slow
def test_generations_fault_names_request_step_and_tokens(tiny_gguf, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"r{i}", "prompt_ids": [2, 3 + i, 9]}) + "\n" for i in range(3)))
    out = tmp_path / "g.jsonl"
    proc = run_cli("generate", "--model", str(tiny_gguf), "--engine", "reference", "--prompts", str(prompts),
                   "--max-new-tokens", "6", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    same = run_cli("compare", str(out), "--against", "reference", "--model", str(tiny_gguf), "--prompts", str(prompts))
    assert same.returncode == 0, same.stdout + same.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    step = 2
    swapped = next(t for t in range(32) if t not in [i for i, _ in rows[1]["top_logprobs"][step]])
    rows[1]["tokens"][step] = swapped  # a token outside the oracle's top-5: a real fault
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = run_cli("compare", str(bad), str(out))
    assert proc.returncode == 1, proc.stdout
    last = proc.stdout.splitlines()[-1]
    assert f"request {rows[1]['id']} step {step}" in last and f"ours {swapped}" in last, last


@pytest.mark.slow
def test_bad_inputs_are_one_line(tiny_gguf, tmp_path):
    ref = _reference_logits(tiny_gguf, tmp_path)
    other = tmp_path / "other.npy"
    np.save(other, np.zeros((2, 3), dtype=np.float32))
    assert_one_line_error(run_cli("compare", str(ref), str(other)), "shape")
    assert_one_line_error(run_cli("compare", str(ref)), "--against")
    junk = tmp_path / "junk.npy"
    junk.write_text("not numpy")
    assert_one_line_error(run_cli("compare", str(junk), str(ref)), "junk.npy")
