"""Throughput benchmarks (``pytest --bench``): the ``g4h bench`` run, figures to a report, never into asserts.

Each test runs the same code as ``g4h bench`` and writes ``reports/<ts>-bench/``
(``report.md``, ``results.json``, PNGs). Sizes are smaller than llama-bench's
defaults so the pair of runs fits in a few minutes on 2 cores; set
``G4H_BENCH_REPS``, ``G4H_BENCH_TG``, ``G4H_BENCH_PP`` and ``G4H_BENCH_BATCH`` for
longer runs, or call ``g4h bench`` directly.
"""

from __future__ import annotations

import json
import os

import pytest

from gemma4_harness.harness.core.paths import REPO_ROOT

BENCH_SPEC = REPO_ROOT / "cases" / "bench" / "e4b-1024.toml"


def _bench(model: str, engines: str) -> dict:
    from gemma4_harness.harness.cli import bench as bench_cli
    from gemma4_harness.harness.cli import build_parser
    from gemma4_harness.harness.core.paths import default_reports_dir

    argv = ["bench", "--model", model, "--engines", engines, "--dtype", "float32,bfloat16",
            "--batch", os.environ.get("G4H_BENCH_BATCH", "1,2,4,8"), "--pp", os.environ.get("G4H_BENCH_PP", "64"),
            "--tg", os.environ.get("G4H_BENCH_TG", "32"), "--reps", os.environ.get("G4H_BENCH_REPS", "3")]
    reports = default_reports_dir()
    before = set(reports.glob("*-bench*")) if reports.exists() else set()
    assert bench_cli.run(build_parser("bench").parse_args(argv)) == 0
    (run,) = set(reports.glob("*-bench*")) - before
    print((run / "report.md").read_text())
    return json.loads((run / "results.json").read_text())


@pytest.mark.bench
def test_bench_model_cpu():
    """The ~0.4 B bench model: fast fp32/bf16 against transformers eager, llama.cpp and the reference."""
    data = _bench(str(BENCH_SPEC), "fast,transformers,llamacpp,reference")
    assert any(r["mean_tok_s"] for r in data["rows"] if r["engine"] == "fast")


@pytest.mark.bench
@pytest.mark.slow
def test_bench_gemma3_270m_gguf_cpu():
    """The real Gemma 3 270M Q4_K_M GGUF: the same engines (transformers through its GGUF loader)."""
    from gemma4_harness.harness.core.realdata import gemma3_270m_gguf

    data = _bench(str(gemma3_270m_gguf()), "fast,transformers,llamacpp,reference")
    assert any(r["mean_tok_s"] for r in data["rows"] if r["engine"] == "fast")
