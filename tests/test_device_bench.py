"""``g4h device-bench``: the GPU script, rehearsed on the CPU at toy sizes (so device time goes to measuring)."""

from __future__ import annotations

import json

import pytest
import torch

from clitools import assert_one_line_error, run_cli
from gemma4_harness.harness.cli.device_bench import FULL, SMOKE, headline


@pytest.mark.slow
def test_the_smoke_run_walks_every_step_on_the_cpu(tmp_path):
    """Every step runs (none records an error): the static~paged check passes, the kernels step runs the Triton
    source through the interpreter, and the decode steps give rows for both engines on all three shapes."""
    proc = run_cli("device-bench", "--smoke", "--device", "cpu", "--out", str(tmp_path), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    (run,) = [p for p in tmp_path.iterdir() if p.name.endswith("-device-bench")]
    rec = json.loads((run / "summary.json").read_text())
    steps = ("static~paged", "kernels", "decode", "packed decode")
    assert all("error" not in rec[s] and rec[s]["figures"] for s in steps), {s: rec[s].get("error") for s in steps}
    assert rec["static~paged"]["figures"]["pass"] is True
    assert {r["type"] for r in rec["kernels"]["figures"]} == {"Q8_0", "Q4_K"}
    for shape in SMOKE.shapes:
        rows = rec["decode"]["figures"][shape]["rows"]
        assert {(r["engine"], r["batch"]) for r in rows if r["mean_tok_s"]} == \
            {(e, b) for e in ("fast", "fast-graph") for b in SMOKE.batches}
    assert set(rec["packed decode"]["figures"]) == {f"{q} {m}" for q in ("Q8_0", "Q4_K")
                                                    for m in ("fused", "dequantize-then-multiply")}
    assert sorted(rec["headline"]) == sorted(headline(rec)) and "PASS" in rec["headline"][0]  # JSON sorts the keys
    assert (run / "report.md").read_text().count("\n- ") == len(rec["headline"])


def test_a_failed_step_is_named_in_the_headline():
    rec = {"static~paged": {"error": "RuntimeError: CUDA error: out of memory", "seconds": 1.0}}
    assert headline(rec) == ["- step static~paged FAILED: RuntimeError: CUDA error: out of memory"]


def test_no_cuda_is_one_line_and_exit_2(tmp_path):
    if torch.cuda.is_available():
        pytest.fail("this test checks the refusal on a machine without CUDA; run it on one")
    proc = run_cli("device-bench", "--device", "cuda", "--out", str(tmp_path))
    assert_one_line_error(proc, "--device cuda")


@pytest.mark.parametrize("args,name", [(["--steps", "decode,bogus"], "--steps"), (["--shapes", "e4b,99b"], "99b")])
def test_bad_steps_or_shapes_are_one_line(tmp_path, args, name):
    proc = run_cli("device-bench", "--smoke", "--device", "cpu", "--out", str(tmp_path), *args)
    assert_one_line_error(proc, name)
    assert not list(tmp_path.iterdir())  # refused before anything ran


def test_the_full_plan_measures_every_shape_and_batch():
    """The GPU run measures E4B, 31B and 26B-A4B shapes at batch 1, 8 and 64, all layers."""
    assert set(FULL.shapes) == {"e4b", "31b", "26b-a4b"} and FULL.batches == (1, 8, 64)
    assert FULL.layers is None and FULL.vocab is None and not FULL.kernel_smoke
