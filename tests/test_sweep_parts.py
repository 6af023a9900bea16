"""The parts of ``g4h sweep`` that need no Ray cluster: finding and grouping files, prompts, the row figures, the
8-bit rounding of the yardstick, the gates, and llama.cpp's quantizer tools (``llama-quantize``, ``llama-imatrix``).

The Ray side (two nodes, dead tasks, resuming, the local cluster's life) is in ``tests/test_sweep.py``.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import sweep_models as models
from rich.console import Console

from gemma4_harness.harness.core.gates import DEFAULT_GATES, SWEEP_DIVERGENCE_REL_L2
from gemma4_harness.harness.core.prompts import load_prompts
from gemma4_harness.harness.engines.llamacpp import tools
from gemma4_harness.harness.sweep import files, judge, prompts, tasks
from gemma4_harness.harness.sweep.progress import Progress
from gemma4_harness.reference.errors import InputError

if os.environ.get("G4H_SKIP_LLAMACPP") == "1":
    pytest.skip("opted out with G4H_SKIP_LLAMACPP=1 (llama-quantize is part of the llama.cpp build)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def case_a():
    return models.build("sweep-a", models.SPEC_A)


@pytest.fixture(scope="module")
def case_b():
    return models.build("sweep-b", models.SPEC_B)


@pytest.fixture(scope="module")
def quants(case_a):
    return models.quantized(case_a, ("Q8_0", "Q4_K_M", "IQ4_XS"))


# --------------------------------------------------------------------------- files and groups


def test_files_are_found_by_folder_glob_and_name_once(case_a, quants, tmp_path):
    folder = quants["Q8_0"].parent
    found = files.find_models([str(folder), str(folder / "*Q8_0.gguf"), str(quants["Q8_0"])])
    assert set(found) == {p.resolve() for p in folder.glob("*.gguf")} and len(found) == len(set(found))
    with pytest.raises(InputError, match="no such file"):
        files.find_models([str(tmp_path / "nope.gguf")])
    with pytest.raises(InputError, match="matches no GGUF"):
        files.find_models([str(tmp_path / "*.gguf")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no \\*.gguf file"):
        files.find_models([str(tmp_path / "empty")])


def test_groups_follow_the_model_and_the_base_is_the_highest_precision(case_a, case_b, quants):
    paths = [quants["Q4_K_M"], case_a.gguf["BF16"], quants["Q8_0"], case_b.gguf["Q4_0"], case_a.gguf["F32"],
             case_b.gguf["BF16"], case_a.hf_dir]
    described = [files.describe(p) for p in paths]
    groups, bad = files.group_files(described)
    assert not bad and len(groups) == 2
    by_file = {f.path: g for g in groups for f in g.files}
    a = by_file[str(case_a.gguf["F32"])]  # the HF folder is the same model: one group, F32 both (the path decides)
    assert by_file[str(case_a.hf_dir)] is a and a.base.label in ("F32", "hf (F32)")
    assert [f.label for f in a.files][2:] == ["BF16", "Q8_0", "Q4_K_M"]  # precision order
    hf = next(f for f in a.files if f.path == str(case_a.hf_dir))
    assert hf.engines["llamacpp"] == {"can_run": False, "reason": "llama.cpp needs a GGUF file"}
    by_base = {g.base.path: g for g in groups}
    assert by_base[str(case_b.gguf["BF16"])].base.file_type == "BF16"  # the best of that group
    assert a.base.bpw == pytest.approx(32.0) and quants["Q4_K_M"].stat().st_size < case_a.gguf["F32"].stat().st_size
    # --base picks another file of its group; one outside the sweep, or unusable, is bad input
    groups, _ = files.group_files(described, base=case_a.gguf["BF16"])
    assert {g.base.label for g in groups} == {"BF16"}
    with pytest.raises(InputError, match="not among the swept files"):
        files.group_files(described, base=case_a.gguf["F16"])


def test_an_unusable_file_joins_no_group_and_keeps_its_problem(case_a, tmp_path):
    cut = tmp_path / "cut.gguf"
    data = case_a.gguf["Q8_0"].read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    try:
        f = files.describe(cut)
    except InputError:
        pytest.skip("the header itself is cut: unreadable, refused before grouping (covered by g4h inspect's tests)")
    groups, bad = files.group_files([f, files.describe(case_a.gguf["F32"])])
    assert bad == [f] and f.unusable is not None and len(groups) == 1


# --------------------------------------------------------------------------- prompts


def test_prompts_by_ids_or_text_kept_inside_the_model(case_a, tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "prompt_ids": [2, 10, 700]}\n{"prompt_ids": [2, 5, 6]}\n\n{"text": "hello world"}\n')
    raw = load_prompts(p)
    assert [r["id"] for r in raw] == ["a", 2, 4]  # as written, or the line number
    with pytest.raises(InputError, match=rf"^{p}:1: prompt 'a': token id 700 is outside the vocabulary"):
        prompts.for_model(raw, case_a.gguf["F32"], vocab=512, context=4096, new_tokens=4, source=p)  # never dropped
    with pytest.raises(InputError, match=rf"^{p}:2: prompt 2: 3 tokens and 4 new tokens"):
        prompts.for_model(raw[1:], case_a.gguf["F32"], vocab=512, context=6, new_tokens=4, source=p)
    kept = prompts.for_model(raw[1:], case_a.gguf["F32"], vocab=512, context=4096, new_tokens=4, source=p)
    assert [r["id"] for r in kept] == ["2", "4"]  # the sweep keys its rows by the id as text
    assert kept[1]["prompt_ids"][0] == 2 and len(kept[1]["prompt_ids"]) > 2  # BOS, then the text's tokens
    for bad in ('{"prompt_ids": []}', '{"text": 3}', '{"prompt_ids": [1], "text": "x"}', "nope",
                '{"id": 1, "prompt_ids": [1]}\n{"id": 1, "prompt_ids": [2]}'):
        p.write_text(bad + "\n")
        with pytest.raises(InputError, match=str(p)):
            load_prompts(p)
    assert prompts.digest(kept) != prompts.digest(kept[:1])


# --------------------------------------------------------------------------- figures


def test_first_divergence_is_the_first_layer_past_the_limit():
    errs = [0.01, 0.05, None, SWEEP_DIVERGENCE_REL_L2 * 1.01, 0.5]
    assert tasks.first_divergence(errs) == 3
    assert tasks.first_divergence([0.01, float("nan")]) == 1  # a non-finite error is past any limit
    assert tasks.first_divergence([0.01, 0.02]) is None and tasks.first_divergence(None) is None
    a = {0: np.ones((3, 4), np.float32), 1: np.ones((3, 4), np.float32)}
    b = {0: np.ones((3, 4), np.float32), 1: 2 * np.ones((3, 4), np.float32)}
    assert tasks.layer_errors(a, b) == [0.0, pytest.approx(0.5)]


def test_greedy_figures_count_identical_streams_and_the_first_step_that_differs():
    base = {"x": {"tokens": [1, 2, 3], "top": [[1, 9], [2, 9], [3, 9]]},
            "y": {"tokens": [4, 5, 6], "top": [[4, 8], [5, 8], [6, 8]]}}
    ours = {"x": {"tokens": [1, 2, 3], "top": [[1, 9], [2, 9], [3, 9]]},
            "y": {"tokens": [4, 8, 6], "top": [[4, 8], [8, 5], [6, 8]]}}
    g = tasks.greedy_figures(ours, base, top_n=2)
    assert g["greedy_identical_pct"] == 50.0 and g["greedy_agree_pct"] == 100.0
    assert (g["greedy_first_diff_step"], g["greedy_first_diff_prompt"]) == (1, "y")
    assert g["greedy_mean_first_diff_step"] == 2.0  # (3 for the identical stream + 1) / 2


def test_q8_0_rounding_is_ggml_s(tmp_path):
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(0).normal(size=(5, 96)).astype(np.float32)  # 96: blocks of 32 (not of 256)
    ours = tasks.round_activations_q8(torch.from_numpy(x)).numpy()
    ggml = gguf.quants.dequantize(gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                                  gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(ours, ggml)


def test_q8_k_rounding_keeps_the_extreme_and_half_a_step():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(1).normal(size=(3, 512)).astype(np.float32)
    x[0, :256] = 0.0  # an all-zero block stays zero
    y = tasks.round_activations_q8(torch.from_numpy(x)).numpy()
    assert not y[0, :256].any()
    for r in range(3):
        for b in range(2):
            blk, out = x[r, 256 * b:256 * (b + 1)], y[r, 256 * b:256 * (b + 1)]
            if not blk.any():
                continue
            i = int(np.argmax(np.abs(blk)))
            d = np.float32(1.0) / np.float32(-127.0 / blk[i])
            assert out[i] == pytest.approx(blk[i], rel=1e-6)  # the extreme maps to -127 exactly
            assert np.max(np.abs(out - blk)) <= abs(d) * 0.5 * (1 + 1e-5)  # every other value within half a step
            assert len(np.unique(np.round(out / d))) <= 255
    odd = torch.ones((2, 33))
    assert torch.equal(tasks.round_activations_q8(odd), odd)  # neither 32 nor 256 divides 33: left as it is


# --------------------------------------------------------------------------- gates and exit status


def _row(engine, kind=None, **kw):
    return {"engine": engine, "engine_kind": kind or engine, "status": "ok", **kw}


def test_pair_gates_follow_what_the_engines_declare_and_the_file_holds():
    fast, llama = _row("fast"), _row("llamacpp")
    assert judge.pair_gate(fast, llama, {"F32": 30}).name == "sweep~engines.mean_kld"
    assert judge.pair_gate(fast, llama, {"Q4_K": 24, "F32": 30}).name == "sweep~engines_q8.mean_kld_ratio"
    assert judge.pair_gate(fast, llama, {"BF16": 24, "F32": 30}).name == "sweep~engines_q8.mean_kld_ratio"
    cmd = _row("cmd:x", "cmd", approximations=["quantized_activations"])
    assert judge.pair_gate(fast, cmd, {"Q8_0": 3}).name == "sweep~engines_q8.mean_kld_ratio"
    bf16 = _row("cmd:y", "cmd", dtype="bfloat16")
    assert judge.pair_gate(fast, bf16, {"Q8_0": 3}).name == "sweep~engines_bf16.mean_kld"
    for g in ("sweep~engines.mean_kld", "sweep~engines_bf16.mean_kld", "sweep~engines_q8.mean_kld_ratio"):
        assert DEFAULT_GATES[g].reason


def test_agreement_ratio_needs_the_yardstick():
    rng = np.random.default_rng(2)
    z = {"p": rng.normal(size=(6, 50))}
    w = {"p": z["p"] + rng.normal(scale=0.05, size=(6, 50))}
    pr = [{"id": "p", "prompt_ids": [1, 2, 3, 4, 5, 6]}]
    ok = judge.agreement(_row("fast"), _row("llamacpp"), z, w, pr, {"Q4_K": 1}, sensitivity=1.0)
    assert ok["passed"] and ok["measured"] == pytest.approx(ok["mean_kld"])
    bad = judge.agreement(_row("fast"), _row("llamacpp"), z, w, pr, {"Q4_K": 1}, sensitivity=ok["mean_kld"] / 3)
    assert not bad["passed"] and bad["measured"] == pytest.approx(3.0)
    info = judge.agreement(_row("fast"), _row("llamacpp"), z, w, pr, {"Q4_K": 1}, sensitivity=None)
    assert info["passed"] and info["informational"]


def test_exit_status_bad_input_then_failures():
    ok = {"status": "ok"}
    declared = {"status": "not_run", "declared": True}
    assert judge.exit_status([ok, declared], [{"passed": True}]) == 0
    assert judge.exit_status([ok, {"status": "not_run"}], []) == 1  # llama.cpp missing on a node: not declared
    assert judge.exit_status([ok, {"status": "timeout"}], []) == 1
    assert judge.exit_status([ok], [{"passed": False}]) == 1
    assert judge.exit_status([{"status": "crashed"}, {"status": "bad_input"}], []) == 2


def test_a_rows_status_is_read_from_its_g4h_parity_pair(case_a):
    """A row's status is what its parity pair's ``.runs`` says (one vocabulary with ``g4h parity``): an engine that
    answers wrongly is ``ok`` with failing checks (exit 1), one that dies is ``crashed`` (parity's ENGINE FAILED), a
    command that cannot start ``bad_input`` (parity's exit 2)."""
    from gemma4_harness.harness.core.paths import REPO_ROOT
    stub = f"cmd:{sys.executable} {REPO_ROOT / 'tests' / 'cmd_stub.py'}"
    path = str(case_a.gguf["F32"])
    pr = [{"id": "a", "prompt_ids": [2, 5, 9, 11, 40, 7]}, {"id": "b", "prompt_ids": [2, 8, 3]}]
    base = tasks.base_run(path, pr, 2, 5, 1)
    row = {}
    for name in ("right", "wrong", "dies", "absent"):
        engine = {"right": stub, "wrong": f"{stub} --perturb-layer 1", "dies": f"{stub} --fault die",
                  "absent": "cmd:/nonexistent/engine"}[name]
        row[name], _ = tasks.engine_run(path, engine, pr, base, 2, 5, 1)
    assert row["right"]["status"] == "ok" and row["right"]["pair"] == "reference~cmd"
    assert all(c["pass"] for c in row["right"]["checks"]) and judge.exit_status([row["right"]], []) == 0
    assert row["right"]["mean_kld"] < 1e-9  # and the sweep's own figures against the base, on the same engine
    assert row["wrong"]["status"] == "ok" and judge.pair_failures(row["wrong"])
    assert judge.exit_status([row["wrong"]], []) == 1
    assert row["dies"]["status"] == "crashed" and "ENGINE FAILED" in row["dies"]["reason"], row["dies"]["reason"]
    assert row["dies"]["checks"][0]["engine_failure"] and judge.exit_status([row["dies"]], []) == 1
    assert row["absent"]["status"] == "bad_input" and row["absent"]["checks"][0]["bad_input"]
    assert judge.exit_status([row["absent"]], []) == 2


def test_an_earlier_stores_row_without_the_pair_is_measured_again():
    """A run directory of an earlier sweep (results version 1: rows without their parity pair) still reads: on
    ``--resume`` its rows that ran are measured again (their pair's figures are missing), its failed rows are kept as
    they were (``--retry-failed`` reruns them, as before), and a row that has its pair is done."""
    from gemma4_harness.harness.sweep.run import SweepOptions, _Sweep
    sweep = _Sweep.__new__(_Sweep)  # the resume decision alone: no cluster, no run directory
    sweep.opts = SweepOptions()
    old = {"kind": "row", "status": "ok", "mean_kld": 1e-6, "against_base": []}
    sweep.records = {"old": old, "new": dict(old, pair="reference~fast", checks=[]),
                     "old-crashed": {"kind": "row", "status": "crashed"}, "base": {"kind": "base", "status": "ok"}}
    assert [k for k in sweep.records if sweep.done(k)] == ["new", "old-crashed", "base"]
    sweep.opts = SweepOptions(retry_failed=True)
    assert not sweep.done("old-crashed") and sweep.done("new")


# --------------------------------------------------------------------------- llama.cpp's quantizer


def test_quantize_every_family_and_an_imatrix_type(case_a, tmp_path):
    src = case_a.gguf["F32"]
    text = tmp_path / "calibration.txt"
    words = "the quick brown fox jumps over the lazy dog while seven wizards hex jolly boxers".split()
    text.write_text(" ".join(words[i % len(words)] for i in range(2500)))
    t = tools.ensure_tools()
    # beside llama-server, against its libraries (the same vendored tree and cache), made once and then reused
    assert t.quantize.parent == t.build.server.parent and t.imatrix.is_file()
    assert tools.ensure_tools().stamp["built_at"] == t.stamp["built_at"]
    assert t.stamp["flags"] == [f for f in t.build.stamp["flags"] if not f.startswith("-DCMAKE_INSTALL_RPATH=")]
    im = tools.make_imatrix(src, text, tmp_path / "imatrix.gguf", ctx=128, chunks=4, tools=t)
    out = tools.quantize(src, tmp_path / "iq2.gguf", "iq2_xxs", imatrix=im, tools=t)
    reader = gguf.GGUFReader(out)
    types = {gguf.GGMLQuantizationType(int(x.tensor_type)).name for x in reader.tensors}
    assert "IQ2_XXS" in types
    with pytest.raises(InputError, match="needs an importance matrix"):
        tools.quantize(src, tmp_path / "x.gguf", "IQ2_XXS", tools=t)
    with pytest.raises(InputError, match="not a llama-quantize file type"):
        tools.canonical_type("Q9_9")
    assert tools.canonical_type("q4_k") == "Q4_K_M"
    # a failure is one line naming the input; nothing is left at the destination
    with pytest.raises(tools.QuantizeError, match=str(tmp_path / "calibration.txt")) as e:
        tools.quantize(text, tmp_path / "y.gguf", "Q4_0", tools=t)
    assert "\n" not in str(e.value) and not (tmp_path / "y.gguf").exists()


def test_g4h_quantize_and_sweep_bad_input_are_one_line(tmp_path, case_a):
    def g4h(*args):
        return subprocess.run([sys.executable, "-m", "gemma4_harness.harness.cli", *args], capture_output=True, text=True,
                              timeout=300)
    p = g4h("quantize", str(case_a.gguf["F32"]), "--types", "Q4_K_M,Q9", "--out-dir", str(tmp_path))
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Q9" in p.stderr
    p = g4h("quantize", str(case_a.gguf["F32"]), "--types", "Q5_K_S", "--out-dir", str(tmp_path / "q"))
    assert p.returncode == 0, p.stderr
    made = tmp_path / "q" / "sweep-a-Q5_K_S.gguf"
    assert p.stdout.strip() == f"Q5_K_S: {made}" and made.is_file()
    p = g4h("sweep", "--out", str(tmp_path))
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "name the model files" in p.stderr
    p = g4h("sweep", str(tmp_path / "missing.gguf"), "--out", str(tmp_path))
    assert p.returncode == 2 and "missing.gguf: no such file" in p.stderr
    p = g4h("sweep", str(case_a.gguf["F32"]), "--against", "fast,nope", "--out", str(tmp_path))
    assert p.returncode == 2 and "unknown engine 'nope'" in p.stderr
    plan = tmp_path / "not-a-run"
    plan.mkdir()
    p = g4h("sweep", "--resume", str(plan))
    assert p.returncode == 2 and "not a sweep run directory" in p.stderr


def test_progress_lines_in_a_log_and_a_panel_on_a_terminal():
    log = io.StringIO()
    p = Progress(stream=log)
    node = SimpleNamespace(node_id="ab" * 28, short="abababab", address="10.0.0.2", host="box", cpus=4.0,
                           memory=8e9, object_store=1e9)
    p.nodes([node])
    p.start(3, 1)
    p.row({"kind": "row", "label": "Q4_K_M", "engine": "fast", "status": "ok", "mean_kld": 0.42,
           "same_top_p_pct": 66.0, "node": "abababab", "seconds": 3.2})
    p.row({"kind": "row", "label": "Q2_K", "engine": "llamacpp", "status": "timeout", "reason": "ran past 60 s"})
    p.stop()
    text = log.getvalue()
    assert "node abababab (box, 10.0.0.2): 4 CPUs" in text and "1 row(s) already" in text
    assert re.search(r"\[1/3, about \d+s left\] Q4_K_M fast: ok: mean KLD 0.42, same top 66 % on abababab", text)
    assert re.search(r"\[2/3, about \d+s left\] Q2_K llamacpp: timeout: ran past 60 s", text), text
    assert (p.done, p.failed) == (2, 1)
    p.tick([("row", "Q8_0", "llamacpp", "ab" * 28, True), ("row", "Q6_K", "fast", None, False)])
    term = io.StringIO()
    Console(file=term, width=120).print(p._panel())
    assert "rows done 2/3" in term.getvalue() and "running 1, queued 1" in term.getvalue()
    assert "Q8_0/llamacpp" in term.getvalue() and "left)" in term.getvalue()
    quiet = io.StringIO()
    q = Progress(quiet=True, stream=quiet)
    q.say("nothing")
    assert quiet.getvalue() == ""
