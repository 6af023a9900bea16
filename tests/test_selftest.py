"""Mutation self-test (harness/selftest/): every injected fault is caught and its first point named.

The full check runs the 11 mutants (and the 3 equivalent ones) on e2b (PLE,
KV sharing, softcap) and 26b-a4b (MoE), which together exercise every fault, on
the 17- and 48-token prompts (both longer than the sliding window of 16).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gemma4_harness.harness import selftest

REPO_ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["len17-window+1", "len48-3xwindow"]


def test_each_mutant_overrides_one_block_function(tiny_gguf):
    """A mutant class overrides one of FastModel's block functions (LayerScalarBranch also passes the layer's
    input through decoder_layer, which it does not change), and the override is live."""
    import inspect

    from gemma4_harness.fast.model import FastModel
    from gemma4_harness.harness.selftest import mutants as M
    from gemma4_harness.reference import load_model

    fault = {M.AttnScale: {"attend"}, M.ExpertsSwiGLU: {"moe_experts"}, M.RouterPrenormed: {"moe_route"},
             M.RouterRMSNormed: {"moe_route"}, M.PleTokenUnscaled: {"ple_token"},
             M.PleNoInvSqrt2: {"per_layer_inputs"}, M.LayerScalarBranch: {"layer_scale", "decoder_layer"}}
    for cls, names in fault.items():
        own = {n for n, v in vars(cls).items() if inspect.isfunction(v)}
        assert own == names and own <= set(dir(FastModel)), (cls.__name__, own)
    cfg, W = load_model(tiny_gguf)
    ids = [2, 5, 7, 11, 13, 17, 19]
    a = FastModel(cfg, W, "cpu", "float32").logits(ids).numpy()
    for cls in (M.AttnScale, M.LayerScalarBranch):
        assert not np.allclose(a, cls(cfg, W, "cpu", "float32").logits(ids).numpy(), atol=1e-3), cls.__name__


def test_catalogue_is_complete_and_explained():
    names = {m.name for m in selftest.MUTANTS}
    assert names == {"attn_scale", "v_norm_dropped", "kv_donor_first", "rope_exponent_rotated", "experts_swiglu",
                     "softcap_dropped", "norm_plus_one", "router_prenormed", "ple_token_unscaled",
                     "layer_scalar_branch", "window_off_by_one"}
    assert all(m.expected is not None and m.equivalent is None for m in selftest.MUTANTS)
    assert {m.name for m in selftest.EQUIVALENT} == {"rope_factors_fp16", "ple_no_inv_sqrt2", "router_rmsnormed"}
    assert all(m.equivalent and len(m.equivalent) > 80 for m in selftest.EQUIVALENT)


@pytest.mark.slow
def test_every_mutant_detected_with_the_right_first_point(tmp_path):
    data, status = selftest.run_selftest(["e2b", "26b-a4b"], PROMPTS, out=str(tmp_path), quiet=True)
    problems = []
    for m in data["mutants"]:
        if not m["runs"]:
            problems.append(f"{m['name']}: no case exercised it")
        for r in m["runs"]:
            if not r["detected"] or r["first"] != r["expected"]:
                problems.append(f"{m['name']} on {r['case']}/{r['prompt']}: first {r['first']}, "
                                f"expected {r['expected']}")
    assert not problems, "\n".join(problems)
    by = {m["name"]: m for m in data["mutants"]}
    assert by["experts_swiglu"]["cases"] == ["26b-a4b"] and by["router_prenormed"]["cases"] == ["26b-a4b"]
    assert by["ple_token_unscaled"]["cases"] == ["e2b"] and by["kv_donor_first"]["cases"] == ["e2b"]
    assert by["kv_donor_first"]["first"] == "attn_out@5"  # e2b: first shared layer (sliding, donor 3 -> 0)
    assert by["rope_exponent_rotated"]["first"] == "e2b: attn_out@4; 26b-a4b: attn_out@5"  # first full layers
    assert by["softcap_dropped"]["first"] == "result_output@-1"
    for e in data["excluded"]:
        assert e["runs"] and not e["any_detected"], e["name"]
    eq = {e["name"]: e for e in data["excluded"]}
    assert eq["rope_factors_fp16"]["max_abs_logit_vs_control"] == 0.0  # bit-identical: truly equivalent
    assert all(c["pass"] for c in data["controls"])
    assert status == 0
    run_dir = Path(data["run_dir"])
    assert run_dir.parent == tmp_path and run_dir.name.endswith("-selftest")
    report = (run_dir / "report.md").read_text()
    assert "| kv_donor_first" in report and "Excluded: mathematically equivalent mutants" in report
    saved = json.loads((run_dir / "results.json").read_text())
    assert saved["kind"] == "selftest" and saved["status"] == 0


def test_cli_selftest_bad_case_is_one_line_exit_2():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-m", "gemma4_harness.harness.cli", "selftest", "--case", "no-such-case", "--quiet"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "no-such-case" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
