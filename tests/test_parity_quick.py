"""``g4h parity --quick`` (a few short prompts, short greedy streams) and the names cases go by in reports
(harness/parity/job.py, harness/parity/cases.py ``case_name``)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from gemma4_harness.harness.cli import main
from gemma4_harness.harness.core.prompts import load_prompts
from gemma4_harness.harness.parity.cases import case_name, case_names
from gemma4_harness.harness.parity.job import QUICK_NEW_TOKENS, QUICK_PROMPTS, quick_prompts

STUB = Path(__file__).resolve().parent / "cmd_stub.py"


def test_quick_prompts_are_the_shortest_in_file_order():
    prompts = load_prompts()
    quick = quick_prompts(prompts)
    assert len(quick) == QUICK_PROMPTS == 3
    assert [len(p["prompt_ids"]) for p in quick] == sorted(len(p["prompt_ids"]) for p in prompts)[:3]
    assert [p["id"] for p in quick] == [p["id"] for p in prompts if p in quick]  # file order kept
    mixed = [{"id": 1, "text": "a long text prompt"}, {"id": 2, "prompt_ids": [2, 5]}, {"id": 3, "text": "hi"},
             {"id": 4, "prompt_ids": [2, 5, 6, 7, 8, 9]}]
    assert [p["id"] for p in quick_prompts(mixed)] == [2, 3, 4]


def test_quick_run_on_a_model(tiny_gguf, tmp_path, capsys):
    """--quick: the 3 shortest prompts, greedy streams of 4 tokens, said in the verdict; no baseline with it."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"n{n}", "prompt_ids": [2] + list(range(3, 2 + n))}) + "\n"
                               for n in (9, 1, 5, 17, 3)))
    engine = "cmd:" + shlex.join([sys.executable, str(STUB)])
    out = tmp_path / "runs"
    assert main(["parity", "--model", str(tiny_gguf), "--against", engine, "--prompts", str(prompts), "--quick",
                 "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert printed.startswith("PASS: every gate passed (1 cases, ") and \
        f"quick: 3 of 5 prompts, greedy streams of {QUICK_NEW_TOKENS} tokens" in printed, printed
    (run,) = out.glob("*-parity*")
    data = json.loads((run / "results.json").read_text())
    logits = [c["prompt"] for c in data["cases"][0]["checks"] if c["gate"] == "reference~cmd.max_abs_logit"]
    assert logits == ["n1", "n5", "n3"]
    greedy = next(c for c in data["cases"][0]["checks"] if c["gate"] == "reference~cmd.greedy")
    assert greedy["streams"] == 3 and data["quick"].startswith("quick: 3 of 5 prompts")
    capsys.readouterr()
    assert main(["parity", "--model", str(tiny_gguf), "--quick", "--write-baseline", str(tmp_path / "b.json"),
                 "--out", str(out)]) == 2
    assert "--quick runs a few short prompts: it cannot be compared with a baseline" in capsys.readouterr().err


def test_case_names(tmp_path):
    """A case is named after the model, not after the folder it is stored in."""
    gguf = tmp_path / "my-e4b" / "gemma-4-e4b-it-Q4_K_M.gguf"
    generic = tmp_path / "my-e4b" / "model.gguf"
    hf = tmp_path / "e4b-0123abcd" / "hf"
    snapshot = tmp_path / "hub" / "models--google--gemma-4-e4b-it" / "snapshots" / ("ab12" * 10)
    plain = tmp_path / "gemma-4-e2b-it"
    synth = tmp_path / "synth" / "e4b-0123456789ab" / "hf"
    for d in (hf, snapshot, plain, synth, gguf.parent):
        d.mkdir(parents=True)
    for f in (gguf, generic):
        f.write_bytes(b"GGUF")
    (synth.parent / "manifest.json").write_text('{"name": "e4b", "builder_version": "synth-2"}')
    (synth.parent / "spec.toml").write_text((Path(__file__).parents[1] / "cases" / "models" / "e4b.toml").read_text())
    assert case_name(gguf) == "gemma-4-e4b-it-Q4_K_M.gguf"
    assert case_name(generic) == "my-e4b/model.gguf"
    assert case_name(hf) == "e4b-0123abcd"
    assert case_name(snapshot) == "google/gemma-4-e4b-it"
    assert case_name(plain) == "gemma-4-e2b-it"
    assert case_name(synth) == "e4b"
    assert case_names([hf, hf, gguf]) == ["e4b-0123abcd", "e4b-0123abcd#2", "gemma-4-e4b-it-Q4_K_M.gguf"]


@pytest.mark.parametrize("name", ["hf", "model", "checkpoint"])
def test_generic_folder_takes_the_name_above(tmp_path, name):
    d = tmp_path / "gemma4-e4b-run3" / name
    d.mkdir(parents=True)
    assert case_name(d) == "gemma4-e4b-run3"
