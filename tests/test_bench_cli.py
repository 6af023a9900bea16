"""``g4h bench``: the run, its report and plots, bytes per token, the ratio baseline, bad input.

These tests check what the bench *writes*, never how fast anything is: a
timing never appears in an assert (figures belong in ``pytest --bench``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from clitools import assert_one_line_error, run_cli

from gemma4_harness.harness.bench import run as B
from gemma4_harness.harness.engines.base import bench_ids
from gemma4_harness.harness import synth
from gemma4_harness.harness.core.cases import MODELS_DIR
from gemma4_harness.harness.bench.report import compare_baseline, read_baseline
from gemma4_harness.reference import load_model
from gemma4_harness.reference.errors import InputError

CASE = MODELS_DIR / "e4b.toml"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run_dir(out: Path) -> Path:
    (d,) = [p for p in out.iterdir() if p.is_dir()]
    return d


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = run_cli("bench", "--model", str(CASE), "--engines", "fast,reference,transformers", "--batch", "1,2",
                   "--pp", "6", "--tg", "3", "--depth", "0,5", "--reps", "2", "--warmup", "0",
                   "--dtype", "float32,bfloat16", "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return proc, _run_dir(out)


def test_bench_writes_results_report_and_plots(bench_run):
    proc, run = bench_run
    data = json.loads((run / "results.json").read_text())
    assert data["version"] == B.RESULT_VERSION and data["kind"] == "bench"
    assert data["read_bandwidth_gbs"] > 0
    # every configuration has a row: 2 tests x 2 depths x 2 batches, per engine-dtype
    combos = {(r["engine"], r["dtype"]) for r in data["rows"]}
    assert combos == {("fast", "float32"), ("fast", "bfloat16"), ("transformers", "float32"),
                      ("transformers", "bfloat16"), ("reference", "float64")}
    for engine, dtype in combos:
        rows = [r for r in data["rows"] if (r["engine"], r["dtype"]) == (engine, dtype)]
        assert {(r["test"], r["depth"], r["batch"]) for r in rows} == {
            (t, d, b) for t in ("pp", "tg") for d in (0, 5) for b in (1, 2)}
    for r in data["rows"]:
        if r["engine"] == "reference" and r["batch"] > 1:
            assert r["mean_tok_s"] is None and "one sequence at a time" in r["error"]
            assert "not run: reference runs one sequence at a time" in (run / "report.md").read_text()
            continue
        assert r["error"] is None and len(r["reps_tok_s"]) == 2 and r["mean_tok_s"] > 0
        if r["test"] == "tg":
            assert r["bytes_per_token"] > 0 and r["roofline_share"] > 0
    assert "tg3 @ d5" in {r["label"] for r in data["rows"]}
    # same-dtype ratios only for transformers; the batching gain of fast
    assert "tg3 b1 fast-float32/transformers-float32" in data["ratios"]
    assert "tg3 b1 fast-float32/transformers-bfloat16" not in data["ratios"]
    assert "tg3 b1 fast-bfloat16/reference-float64" in data["ratios"]
    assert "tg3 b2/b1 fast-float32" in data["ratios"]
    report = (run / "report.md").read_text()
    assert "| model" in report and "| t/s" in report and "roofline" in report
    assert report.count("\n| e4b ") == len(data["rows"])
    load = data["machine"]["load_avg"]  # the other processes' load, at the start and the end of the run
    assert all(len(load[k]) == 3 and min(load[k]) >= 0 for k in ("start", "end"))
    assert f"load average {load['start'][0]:g} at the start" in report
    for png in ("tps_vs_batch.png", "roofline.png"):
        assert (run / png).read_bytes()[:8] == PNG_MAGIC
        assert f"]({png})" in report
    assert f"report: {run / 'report.md'}" in proc.stdout


def test_weight_bytes_match_the_gguf_file():
    """Bytes a decode step reads, from the config, equal the file's tensor bytes less the gathered tables."""
    from gguf import GGUFReader

    built = synth.ensure_built(CASE)
    path = built.gguf["F32"]
    cfg, _ = load_model(path)
    sizes = {t.name: (int(t.n_bytes), [int(x) for x in t.shape]) for t in GGUFReader(str(path)).tensors}
    for batch in (1, 3):
        expected = 0
        for name, (nbytes, shape) in sizes.items():
            tied_head = name == "token_embd.weight" and "output.weight" not in sizes
            if name in ("token_embd.weight", "per_layer_token_embd.weight") and not tied_head:
                expected += 4 * shape[0] * batch  # gathered rows; a GGUF shape is [ne0, ne1], ne0 the row length
            else:
                expected += nbytes
        got = B.weight_bytes_per_step(cfg, lambda n: 4.0, batch)
        assert got == pytest.approx(expected, rel=1e-12)


def test_kv_bytes_follow_the_cache_layout():
    """KV bytes per token: sliding layers stop growing at the window; shared layers read their donor's cache."""
    cfg, _ = load_model(synth.ensure_built(CASE).gguf["F32"])
    w = cfg.sliding_window
    small, at_w, beyond = (B.kv_bytes_per_token(cfg, c) for c in (1, w, 10 * w))
    per_tok = {L.index: cfg.layers[L.kv_donor].n_kv_head * cfg.layers[L.kv_donor].head_dim * 4
               * (2 if cfg.layers[L.kv_donor].has_v_proj else 1) for L in cfg.layers}
    assert small == pytest.approx(sum(per_tok.values()))
    full = sum(v for i, v in per_tok.items() if not cfg.layers[i].is_sliding)
    assert beyond - at_w == pytest.approx(full * 9 * w)


def test_ratios_pair_same_run_rows():
    rows = [B.BenchRow("fast", "float32", "tg", 8, 0, 1, [10.0, 10.0]),
            B.BenchRow("fast", "float32", "tg", 8, 0, 4, [30.0]),
            B.BenchRow("transformers", "float32", "tg", 8, 0, 1, [4.0]),
            B.BenchRow("transformers", "bfloat16", "tg", 8, 0, 1, [5.0]),
            B.BenchRow("llamacpp", "F32", "tg", 8, 0, 1, [20.0]),
            B.BenchRow("reference", "float64", "tg", 8, 0, 4, [], error="batch 1 only")]
    r = B.ratios(rows)
    assert r == {"tg8 b1 fast-float32/transformers-float32": 2.5, "tg8 b1 fast-float32/llamacpp-F32": 0.5,
                 "tg8 b4/b1 fast-float32": 3.0}


@pytest.mark.slow
def test_baseline_round_trip_and_regression(bench_run, tmp_path):
    _, run = bench_run
    data = json.loads((run / "results.json").read_text())
    base = tmp_path / "speed.json"
    proc = run_cli("bench", "--model", str(CASE), "--engines", "fast", "--pp", "0", "--tg", "2", "--reps", "1",
                   "--warmup", "0", "--batch", "1,2", "--out", str(tmp_path / "o"), "--write-baseline", str(base))
    assert proc.returncode == 0, proc.stderr
    ratios = read_baseline(base)
    assert set(ratios) == {"tg2 b2/b1 fast-float32"}
    # judged on the stored ratios: the same figures pass, a baseline 2x higher fails
    assert compare_baseline(dict(data), data["ratios"], "x", 0.25)["pass"]
    doubled = {k: 2 * v for k, v in data["ratios"].items()}
    verdict = compare_baseline(dict(data), doubled, "x", 0.25)
    assert not verdict["pass"] and all(not v["pass"] for v in verdict["ratios"].values())
    # through the CLI: a baseline no run can reach gives exit 1 and says so
    impossible = tmp_path / "impossible.json"
    impossible.write_text(json.dumps({"version": 1, "kind": "bench-baseline",
                                      "ratios": {"tg2 b2/b1 fast-float32": 1e9}}))
    proc = run_cli("bench", "--model", str(CASE), "--engines", "fast", "--pp", "0", "--tg", "2", "--reps", "1",
                   "--warmup", "0", "--batch", "1,2", "--out", str(tmp_path / "o2"), "--baseline", str(impossible))
    assert proc.returncode == 1, proc.stderr
    assert "speed baseline: FAIL" in proc.stdout
    assert "**Speed baseline: FAIL**" in (_run_dir(tmp_path / "o2") / "report.md").read_text()
    # a baseline is never overwritten
    proc = run_cli("bench", "--model", str(CASE), "--engines", "fast", "--tg", "1", "--pp", "0", "--reps", "1",
                   "--out", str(tmp_path / "o3"), "--write-baseline", str(base))
    assert_one_line_error(proc, str(base))


@pytest.mark.parametrize("args,names", [
    (["--engines", "fast,warp"], ["warp"]),
    (["--batch", "1,x"], ["--batch"]),
    (["--dtype", "int8"], ["--dtype"]),
    (["--pp", "0", "--tg", "0"], ["--pp"]),
])
def test_bad_arguments_one_line(args, names, tmp_path):
    proc = run_cli("bench", "--model", str(CASE), *args, "--out", str(tmp_path))
    assert_one_line_error(proc, *names)


def test_bad_model_and_baseline_one_line(tmp_path):
    assert_one_line_error(run_cli("bench", "--model", str(tmp_path / "none.gguf"), "--out", str(tmp_path)),
                          "none.gguf")
    bad = tmp_path / "b.json"
    bad.write_text("{\"kind\": \"parity\"}")
    assert_one_line_error(run_cli("bench", "--model", str(CASE), "--baseline", str(bad), "--out", str(tmp_path)),
                          "b.json")


def test_missing_engine_is_skipped_with_install_hint(monkeypatch, tmp_path):
    """An engine that is not installed is listed as skipped with how to install it; the others still run."""
    import gemma4_harness.harness.engines.llamacpp as lc
    from gemma4_harness.harness.cli import bench as bench_cli
    from gemma4_harness.harness.engines.base import EngineUnavailable

    def missing():
        raise EngineUnavailable(lc.INSTALL_MSG)

    monkeypatch.setattr(lc, "_import_llama_cpp", missing)
    rc = bench_cli.run(bench_cli_args(tmp_path, engines="llamacpp,fast"))
    assert rc == 0
    data = json.loads((_run_dir(tmp_path) / "results.json").read_text())
    assert "pip install" in data["skipped"]["llamacpp"]
    assert f"**llamacpp skipped:** {data['skipped']['llamacpp']}" in (_run_dir(tmp_path) / "report.md").read_text()
    assert {r["engine"] for r in data["rows"]} == {"fast"}


def bench_cli_args(out: Path, **kw):
    """Parsed ``g4h bench`` arguments for an in-process run."""
    from gemma4_harness.harness.cli import build_parser

    argv = ["bench", "--model", str(CASE), "--engines", kw.get("engines", "fast"), "--pp", "0", "--tg", "1",
            "--reps", "1", "--warmup", "0", "--out", str(out)]
    return build_parser("bench").parse_args(argv)


def test_bandwidth_probe_is_positive_and_rejects_tiny_buffers():
    assert B.measure_read_bandwidth("cpu", nbytes=8 << 20, reps=1) > 0
    with pytest.raises(InputError):
        B.measure_read_bandwidth("cpu", nbytes=1024)


def test_bench_ids_are_fixed_and_in_range():
    a = bench_ids(100, 50, 3)
    assert a == bench_ids(100, 50, 3) and all(4 <= t < 100 for t in a)
    assert np.unique(a).size > 10


@pytest.mark.slow
def test_shape_only_model_runs_on_cpu_when_truncated(tmp_path):
    """``--shape`` builds real-dimension layers with random weights on the device; no file is read."""
    proc = run_cli("bench", "--shape", "e2b", "--layers", "2", "--engines", "fast,transformers", "--pp", "4",
                   "--tg", "2", "--reps", "1", "--warmup", "0", "--dtype", "bfloat16", "--out", str(tmp_path),
                   timeout=600)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((_run_dir(tmp_path) / "results.json").read_text())
    assert data["model"]["hidden_size"] == 1536 and data["model"]["n_layer"] == 2
    assert {r["engine"] for r in data["rows"]} == {"fast"}
    assert "only the fast engine" in data["skipped"]["transformers"]
    assert all(r["mean_tok_s"] > 0 for r in data["rows"])


def test_prefill_only_run_writes_its_report(tmp_path):
    """``--tg 0``: no decode row, so no roofline plot; the report is still written, with the batch plot."""
    proc = run_cli("bench", "--model", str(CASE), "--engines", "fast", "--batch", "1", "--pp", "5", "--tg", "0",
                   "--reps", "1", "--warmup", "0", "--dtype", "float32", "--out", str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr
    run = _run_dir(tmp_path)
    report = (run / "report.md").read_text()
    assert "](tps_vs_batch.png)" in report and "roofline.png" not in report
    assert not (run / "roofline.png").exists()
