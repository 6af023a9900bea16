"""Trace files (harness/traces/, docs/trace-format.md): write/read, diff, llama.cpp dump import, bad input.

Engine traces come from the tiny 2-layer GGUF of conftest (reference engine,
milliseconds); the CLI runs in a subprocess as a user would run it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from gemma4_harness.harness.traces import compare as tc
from gemma4_harness.harness.traces import format as tf
from gemma4_harness.harness.traces import llama_dump as td
from gemma4_harness.reference.errors import InputError
from clitools import assert_one_line_error, run_cli
from gemma4_harness.harness.traces.compare import DivergenceRule
from gemma4_harness.harness.traces.format import TraceWriter

REPO_ROOT = Path(__file__).resolve().parent.parent
PROMPT = [2, 5, 7, 11, 13, 17, 19, 23, 29, 30]  # 10 tokens: > 6 rows, so eval-callback text elides rows


def reference_trace(model: Path, ids=PROMPT, keep: bool = True) -> TraceWriter:
    from gemma4_harness.reference import forward, load_model

    cfg, W = load_model(model)
    w = TraceWriter("reference", ids, case="tiny", model=str(model), dtype="float64", keep_tensors=keep)
    forward(cfg, W, ids, trace=w)
    return w


def perturbed(w: TraceWriter, point: str, layer: int, factor: float, engine: str = "perturbed") -> TraceWriter:
    """A copy of ``w`` whose (point, layer) tensor is scaled by ``factor`` (a fault localised there)."""
    out = TraceWriter(engine, w.prompt_ids, case=w.case, dtype="float32", keep_tensors=True)
    for r in w.records:
        t = w.tensors[tf.tensor_name(r["point"], r["layer"])]
        out(r["point"], r["layer"], t * factor if (r["point"], r["layer"]) == (point, layer) else t)
    return out


# --------------------------------------------------------------------------- checksums and the file


def test_checksums_values():
    a = np.arange(12, dtype=np.float32).reshape(3, 4) - 5.0
    c = tf.checksums(a)
    assert c["sum"] == pytest.approx(float(a.sum()))
    assert c["mean"] == pytest.approx(float(a.mean()))
    assert c["l2"] == pytest.approx(float(np.linalg.norm(a)))
    assert c["absmax"] == 6.0
    assert c["first"] == [-5.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0]  # row-major: token 0 first


def test_write_read_roundtrip_with_dump(tiny_gguf, tmp_path):
    w = reference_trace(tiny_gguf)
    w("extra_point", 7, np.array([[np.nan, np.inf, -np.inf, 1.0]]))  # non-finite values survive the file
    path = w.write(tmp_path / "t" / "ref.jsonl", tmp_path / "dumps")
    head = json.loads(path.read_text().splitlines()[0])
    assert list(head)[:2] == ["format", "version"] and head["format"] == "g4h-trace" and head["version"] == 1
    assert head["prompt_ids"] == PROMPT and head["n_records"] == len(w.records)
    assert head["tensors"] == os.path.join("..", "dumps", "ref.safetensors")
    tr = tf.read_trace(path)
    keys = [(r["point"], r["layer"]) for r in tr.records]
    assert keys[:2] == [("inp_scaled", -1), ("attn_out", 0)]
    assert ("result_output", -1) in keys
    for r, r0 in zip(tr.records, w.records):
        assert r["shape"] == r0["shape"]
        for k in ("sum", "l2", "absmax"):
            a, b = r["checksums"][k], r0["checksums"][k]
            assert (math.isnan(a) and math.isnan(b)) or a == b
    ex = tr.by_key()[("extra_point", 7)]["checksums"]["first"]
    assert math.isnan(ex[0]) and ex[1] == math.inf and ex[2] == -math.inf
    np.testing.assert_array_equal(tr.tensor("l_out", 1), w.tensors["l_out.1"])
    res = tc.compare(tr, w.trace())
    assert res.first is None and {r.basis for r in res.rows} == {"tensors"}


def test_diff_names_first_divergence_in_canonical_order(tiny_gguf):
    w = reference_trace(tiny_gguf)
    bad = perturbed(w, "attn_out", 1, 1.01)
    # also break the output: the first divergence in trace order is still attn_out@1
    bad.tensors["result_output.-1"] = bad.tensors["result_output.-1"] + 1.0
    bad.records = [r if r["point"] != "result_output" else {**r, "checksums": tf.checksums(
        bad.tensors["result_output.-1"])} for r in bad.records]
    bad.records.reverse()  # file order must not matter
    for use_tensors in (True, False):
        res = tc.compare(bad.trace(), w.trace(), DivergenceRule(tol=1e-3), use_tensors=use_tensors)
        assert res.first is not None and res.first.where == "attn_out@1"
        assert res.first.basis == ("tensors" if use_tensors else "checksums")
        if use_tensors:
            assert res.first.rel_l2 == pytest.approx(0.01, rel=1e-9)
        growth = res.growth()
        assert [g["layer"] for g in growth] == ["input", 0, 1, "output"]
        assert growth[1]["diverged"] == 0 and growth[2]["diverged"] == 1  # only attn_out@1 was altered
    # cosine rule: a pure scale keeps cosine 1; the rel-L2 rule sees it, the cosine rule alone does not
    res = tc.compare(perturbed(w, "attn_out", 1, 1.01).trace(), w.trace(),
                         DivergenceRule(tol=None, min_cosine=0.99999))
    assert res.first is None


def test_checksum_bounds_are_lower_bounds():
    rng = np.random.default_rng(0)
    for trial in range(200):
        shape = (int(rng.integers(1, 9)), int(rng.integers(1, 40)))
        b = rng.standard_normal(shape) * rng.uniform(0.1, 10)
        kind = trial % 4
        if kind == 0:
            a = b + rng.standard_normal(shape) * 10.0 ** rng.uniform(-6, 0)
        elif kind == 1:
            a = b * rng.uniform(0.5, 1.5)
        elif kind == 2:
            a = b + rng.uniform(-1, 1)
        else:
            a = b.copy()
            a[rng.integers(0, shape[0]), rng.integers(0, shape[1])] += rng.standard_normal()
        bounds = tc.checksum_error(tf.checksums(a), tf.checksums(b), a.size)
        L = max(np.linalg.norm(a), np.linalg.norm(b))
        M = max(np.abs(a).max(), np.abs(b).max())
        true_l2, true_max = np.linalg.norm(a - b) / L, np.abs(a - b).max() / M
        assert bounds["l2"] <= true_l2 * (1 + 1e-9) + 1e-15
        assert bounds["sum"] <= true_l2 * (1 + 1e-9) + 1e-15
        assert bounds["absmax"] <= true_max * (1 + 1e-9) + 1e-15
        assert bounds["first"] <= true_max * (1 + 1e-9) + 1e-15


def test_shape_mismatch_and_missing_points(tiny_gguf):
    w = reference_trace(tiny_gguf)
    other = TraceWriter("other", PROMPT, keep_tensors=True)
    for r in w.records:
        t = w.tensors[tf.tensor_name(r["point"], r["layer"])]
        if r["point"] == "result_output":
            t = t[-1:]  # an engine that kept only the last position's logits
        if r["point"] != "result_norm":
            other(r["point"], r["layer"], t)
    res = tc.compare(other.trace(), w.trace())
    assert res.first.where == "result_output@-1" and res.first.basis == "shape"
    assert res.only_b == ["result_norm@-1"]
    res = tc.compare(other.trace(), w.trace(), skip=["result_output"])
    assert res.first is None and res.skipped == ["result_output@-1"]


# --------------------------------------------------------------------------- llama.cpp dumps


def test_ne_layout_and_names():
    assert td.ne_to_shape([64, 48, 1, 1], "l_out", "x") == [48, 64]
    assert td.ne_to_shape([16, 10, 48, 1], "inp_per_layer", "x") == [48, 10, 16]
    assert td.ne_to_shape([512, 1, 1, 1], "result_output", "x") == [1, 512]
    with pytest.raises(InputError, match="more than 2 dimensions"):
        td.ne_to_shape([4, 5, 6, 1], "l_out", "x")
    assert td.parse_llama_name("l_out-12") == ("l_out", 12)
    assert td.parse_llama_name("result_output") == ("result_output", -1)
    assert td.parse_llama_name("inp_scaled") == ("inp_scaled", -1)
    for other in ("Qcur-0", "attn_norm-3", "l_out", "result_output-2", "l_out-0 (reshaped)"):
        assert td.parse_llama_name(other) is None
    assert td.llama_name("attn_out", 3) == "attn_out-3" and td.llama_name("result_norm", -1) == "result_norm"


def test_text_dump_three_d_layout_lines_up():
    """A [T, L, P] array printed as ggml would ({P, L, T}) comes back with our shape and leading values."""
    rng = np.random.default_rng(1)
    for shape in ([9, 3, 4], [2, 10, 5], [3, 2, 2]):
        arr = rng.standard_normal(shape)
        text = td.render_eval_callback_text([("inp_per_layer", -1, arr)])
        assert f"= {{{shape[2]}, {shape[1]}, {shape[0]}, 1}}" in text.splitlines()[0]
        recs, skipped = td.parse_eval_callback_text(text, "mem")
        assert skipped == 0 and recs[0]["shape"] == shape
        flat = arr.astype(np.float32).ravel()
        first = recs[0]["checksums"]["first"]
        np.testing.assert_allclose(first, flat[:len(first)], atol=5e-5)
        assert len(first) == (min(8, flat.size) if shape[2] <= 6 else 3)
        assert recs[0]["checksums"]["sum"] == pytest.approx(float(flat.sum()), abs=1e-5)


def test_text_dump_old_eval_callback_layout():
    """The 2024 examples/eval-callback layout: ``ggml_debug:`` prefix, 37-space indents, sum of printed values."""
    ind = " " * 37
    text = "\n".join([
        "llama_new_context_with_model: graph splits = 2",
        "ggml_debug:                 l_out-0 = (f32)        ADD(ffn_out-0{8, 2, 1, 1}, attn_out-0{8, 2, 1, 1}}) = {8, 2, 1, 1}",
        ind + "[",
        ind + " [",
        ind + "  [      1.0000,       2.0000,       3.0000, ...,       6.0000,       7.0000,       8.0000],",
        ind + "  [     -1.0000,      -2.0000,      -3.0000, ...,      -6.0000,      -7.0000,      -8.0000],",
        ind + " ],",
        ind + "]",
        ind + "sum = 0.000000",
        "ggml_debug:                  norm-1 = (f32)       NORM(l_out-0{8, 2, 1, 1}, }) = {8, 2, 1, 1}",
        ind + "[", ind + " [", ind + "  [      0.1000,       0.2000,       0.3000, ...,       0.6000,       0.7000,       0.8000],",
        ind + "  [      0.1000,       0.2000,       0.3000, ...,       0.6000,       0.7000,       0.8000],",
        ind + " ],", ind + "]", ind + "sum = 4.200000",
    ])
    recs, skipped = td.parse_eval_callback_text(text, "old.txt", sum_scope="printed")
    assert skipped == 1 and len(recs) == 1
    r = recs[0]
    assert (r["point"], r["layer"], r["shape"]) == ("l_out", 0, [2, 8])
    assert r["checksums"]["first"] == [1.0, 2.0, 3.0]
    assert r["checksums"]["sum"] is None  # printed-values sum of a truncated tensor is not the tensor's sum
    recs, _ = td.parse_eval_callback_text(text, "old.txt", sum_scope="all")
    assert recs[0]["checksums"]["sum"] == 0.0


def test_text_dump_errors(tmp_path):
    arr = np.ones((2, 3))
    text = td.render_eval_callback_text([("l_out", 0, arr), ("l_out", 0, arr)])
    with pytest.raises(InputError, match="appears twice"):
        td.parse_eval_callback_text(text, "dup.txt")
    broken = td.render_eval_callback_text([("l_out", 0, arr)]).replace("1.0000,", "", 1)
    with pytest.raises(InputError, match="expected 6 printed values"):
        td.parse_eval_callback_text(broken, "broken.txt")
    with pytest.raises(InputError, match="no eval-callback tensor"):
        td.parse_eval_callback_text("just a log line\n", "empty.txt")


def test_import_text_dump_of_reference_lines_up_and_finds_a_fault(tiny_gguf, tmp_path):
    w = reference_trace(tiny_gguf)
    ref = w.trace()
    items = [(r["point"], r["layer"], w.tensors[tf.tensor_name(r["point"], r["layer"])]) for r in w.records]
    noise = [("Qcur", 0, np.ones((10, 4)))]  # a tensor that is not a trace point: skipped
    (tmp_path / "good.txt").write_text("llama.cpp log line\n" + td.render_eval_callback_text(noise + items))
    imp = td.import_llama_dump(tmp_path / "good.txt", PROMPT, case="tiny")
    assert imp.header["skipped_tensors"] == 1 and imp.header["engine"] == "llama.cpp"
    assert [(r["point"], r["layer"]) for r in imp.records] == [(r["point"], r["layer"]) for r in w.records]
    res = tc.compare(imp, ref, DivergenceRule(tol=1e-4), use_tensors=False)
    assert res.first is None, tc.render_diff(res, imp, ref)
    # a 2 % fault at l_out@0 (token 0 included) is named from the text alone
    bad_items = [(p, l, t * 1.02 if (p, l) == ("l_out", 0) else t) for p, l, t in items]
    (tmp_path / "bad.txt").write_text(td.render_eval_callback_text(bad_items))
    imp = td.import_llama_dump(tmp_path / "bad.txt", PROMPT)
    res = tc.compare(imp, ref, DivergenceRule(tol=1e-3), use_tensors=False)
    assert res.first is not None and res.first.where == "l_out@0"
    # written and read back as a trace file, it still lines up
    out = tf.write_trace(tmp_path / "imp.jsonl", imp.header, imp.records)
    back = tf.read_trace(out)
    assert back.records[0]["abs_precision"] == td.TEXT_ABS_PRECISION
    assert tc.compare(back, ref, DivergenceRule(tol=1e-3)).first.where == "l_out@0"


def test_import_jsonl_dump_with_data_gives_full_comparison(tiny_gguf, tmp_path):
    w = reference_trace(tiny_gguf)
    lines = [json.dumps({"format": "llama.cpp-eval-jsonl", "version": 1, "prompt_ids": PROMPT})]
    for r in w.records:
        t = w.tensors[tf.tensor_name(r["point"], r["layer"])].astype(np.float32)
        ne = list(reversed(t.shape)) + [1] * (4 - t.ndim)
        if r["point"] == "attn_out":  # stats only, as a callback could compute them
            lines.append(json.dumps({"name": td.llama_name(r["point"], r["layer"]), "type": "f32", "ne": ne,
                                     "sum": float(t.sum(dtype=np.float64)), "sumsq": float(np.sum(t.astype(np.float64) ** 2)),
                                     "absmax": float(np.abs(t).max()), "first": t.ravel()[:8].tolist()}))
        else:
            lines.append(json.dumps({"name": td.llama_name(r["point"], r["layer"]), "type": "f32", "ne": ne,
                                     "data": t.ravel().tolist()}))
    (tmp_path / "dump.jsonl").write_text("\n".join(lines) + "\n")
    imp = td.import_llama_dump(tmp_path / "dump.jsonl")  # prompt ids from the dump's header
    assert imp.prompt_ids == PROMPT and imp.tensors is not None and "attn_out.0" not in imp.tensors
    res = tc.compare(imp, w.trace(), DivergenceRule(tol=1e-6))
    assert res.first is None
    by = {r.where: r for r in res.rows}
    assert by["l_out@1"].basis == "tensors" and by["l_out@1"].rel_l2 < 1e-6
    assert by["attn_out@0"].basis == "checksums"


# --------------------------------------------------------------------------- the CLI


@pytest.fixture
def prompt_file(tmp_path) -> Path:
    p = tmp_path / "prompt.json"
    p.write_text(json.dumps(PROMPT))
    return p


def test_cli_trace_and_diff(tiny_gguf, prompt_file, tmp_path):
    a = tmp_path / "a.jsonl"
    proc = run_cli("trace", "--model", str(tiny_gguf), "--engine", "reference", "--prompt-ids", str(prompt_file),
                   "--out", str(a), "--dump-tensors", str(tmp_path / "dumps"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "dumps" / "a.safetensors").is_file()
    proc = run_cli("diff", str(a), str(a))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no divergence" in proc.stdout and "| layer" in proc.stdout
    # a faulty engine's trace: diverges at attn_out@1; exit 1
    w = reference_trace(tiny_gguf)
    bad = perturbed(w, "attn_out", 1, 1.05)
    bad.write(tmp_path / "bad.jsonl", tmp_path / "dumps")
    proc = run_cli("diff", str(tmp_path / "bad.jsonl"), str(a), "--json", str(tmp_path / "d.json"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FIRST DIVERGENCE: attn_out@1" in proc.stdout
    assert json.loads((tmp_path / "d.json").read_text())["first_divergence"] == "attn_out@1"
    # import a llama.cpp text dump through the CLI and diff it
    items = [(r["point"], r["layer"], w.tensors[tf.tensor_name(r["point"], r["layer"])]) for r in w.records]
    (tmp_path / "llama.txt").write_text(td.render_eval_callback_text(items))
    proc = run_cli("trace", "--llama-dump", str(tmp_path / "llama.txt"), "--prompt-ids", str(prompt_file),
                   "--out", str(tmp_path / "llama.jsonl"))
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("diff", str(tmp_path / "llama.jsonl"), str(a), "--tol", "1e-4")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cli_bad_trace_input(tiny_gguf, prompt_file, tmp_path):
    w = reference_trace(tiny_gguf, keep=False)
    good = w.write(tmp_path / "good.jsonl")
    assert_one_line_error(run_cli("diff", str(tmp_path / "missing.jsonl"), str(good)), "missing.jsonl")
    text = good.read_text().splitlines()
    head = json.loads(text[0])
    (tmp_path / "v2.jsonl").write_text("\n".join([json.dumps({**head, "version": 2})] + text[1:]) + "\n")
    line = assert_one_line_error(run_cli("diff", str(tmp_path / "v2.jsonl"), str(good)), "v2.jsonl")
    assert "version" in line
    (tmp_path / "notrace.jsonl").write_text('{"hello": 1}\n')
    assert_one_line_error(run_cli("diff", str(good), str(tmp_path / "notrace.jsonl")), "notrace.jsonl")
    (tmp_path / "cut.jsonl").write_text("\n".join(text[:-3]) + "\n")
    line = assert_one_line_error(run_cli("diff", str(tmp_path / "cut.jsonl"), str(good)), "cut.jsonl")
    assert "truncated" in line
    (tmp_path / "half.jsonl").write_text("\n".join(text[:-1] + [text[-1][:20]]) + "\n")
    assert_one_line_error(run_cli("diff", str(tmp_path / "half.jsonl"), str(good)), "half.jsonl")
    other = reference_trace(tiny_gguf, ids=PROMPT[:-1], keep=False).write(tmp_path / "other.jsonl")
    line = assert_one_line_error(run_cli("diff", str(other), str(good)), "other.jsonl")
    assert "different prompts" in line
    (tmp_path / "nodump.jsonl").write_text("\n".join([json.dumps({**head, "tensors": "gone.safetensors"})]
                                                     + text[1:]) + "\n")
    assert_one_line_error(run_cli("diff", str(tmp_path / "nodump.jsonl"), str(tmp_path / "nodump.jsonl")),
                          "gone.safetensors")
    (tmp_path / "junk.txt").write_text("no tensors here\n")
    assert_one_line_error(run_cli("trace", "--llama-dump", str(tmp_path / "junk.txt"), "--prompt-ids",
                                  str(prompt_file), "--out", str(tmp_path / "x.jsonl")), "junk.txt")
