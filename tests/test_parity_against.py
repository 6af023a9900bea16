"""``g4h parity --model M [--against ENGINE[,ENGINE...]]``: every engine as the other side, each pair gated.

On a built case (cases/models/26b-a4b.toml, through harness.synth.ensure_built): its F32 GGUF and its HF
folder, against every engine name; the default (no ``--against``) compares what can read the model; an
engine that cannot run is a failing ``reference~<kind>.runs`` and the verdict names it; the example engine
(examples/llamacpp_engine.py, llama-cpp-python behind the subprocess protocol) passes, and its perturbed
variant fails on the prompt and position it perturbs.

llama.cpp comes from the build cache (nox -s tests installs it); without it these tests fail, unless the
user opts out with ``G4H_SKIP_LLAMACPP=1`` (the tests that need it are then skipped, each saying so).
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest
from servers import require_llamacpp

from gemma4_harness.harness import synth
from gemma4_harness.harness.cli import main as g4h
from gemma4_harness.harness.core.cases import MODELS_DIR
from gemma4_harness.harness.core.gates import DEFAULT_GATES
from gemma4_harness.harness.core.paths import REPO_ROOT
from gemma4_harness.harness.engines.base import EngineUnavailable
from gemma4_harness.harness.parity import run as run_parity
from gemma4_harness.harness.parity.cases import default_against

CASE = "26b-a4b"
EXAMPLE = REPO_ROOT / "examples" / "llamacpp_engine.py"
METRICS = ("runs", "max_abs_logit", "mean_kld", "same_top1_decisive", "layer_rel_l2", "greedy", "max_abs_logprob")


def require_llama_cpp() -> None:
    """llama-cpp-python must import here, unless the user opted out with ``G4H_SKIP_LLAMACPP=1`` (then skip)."""
    if not require_llamacpp():
        pytest.skip("opted out with G4H_SKIP_LLAMACPP=1")
    import llama_cpp  # noqa: F401  (missing: nox -s tests installs it from the build cache; the test fails)


def example(*args: str) -> str:
    """The engine name of the example engine with ``args``."""
    return "cmd:" + shlex.join([sys.executable, str(EXAMPLE), "--threads", "2", *args])


@pytest.fixture(scope="module")
def built():
    return synth.ensure_built(MODELS_DIR / f"{CASE}.toml")


def checks(data: dict, pair: str) -> list[dict]:
    return [c for case in data["cases"] for c in case["checks"] if c["gate"].rsplit(".", 1)[0] == pair]


def assert_pair_passes(data: dict, pair: str, metrics=METRICS) -> None:
    got = checks(data, pair)
    assert {c["gate"].rsplit(".", 1)[1] for c in got} == set(metrics), (pair, sorted({c["gate"] for c in got}))
    bad = [c for c in got if not c["pass"]]
    assert not bad, bad[:2]


def assert_not_run(data: dict, pair: str, why: str) -> None:
    got = checks(data, pair)
    assert [c["gate"] for c in got] == [f"{pair}.runs"], got
    assert not got[0]["pass"] and got[0]["got"].startswith("not run:") and why in got[0]["got"], got[0]


# --------------------------------------------------------------------------- quick: what cannot run


def test_missing_llamacpp_fails_the_run_unless_opted_out(tiny_gguf, tmp_path, monkeypatch):
    """The default on a GGUF asks for llama.cpp; when it is missing the run is not a PASS (exit 1, the verdict
    names the check that did not run); --skip llamacpp opts out (informational)."""
    import gemma4_harness.harness.engines.llamacpp as lcp

    def missing():
        raise EngineUnavailable(lcp.INSTALL_MSG)

    monkeypatch.setattr(lcp, "_import_llama_cpp", missing)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "p", "prompt_ids": [2, 7, 9, 4, 30]}) + "\n")
    data, status = run_parity(models=[str(tiny_gguf)], against=["reference", "llamacpp"], out=str(tmp_path),
                              prompts=prompts, quiet=True)
    assert status == 1
    assert_not_run(data, "reference~llamacpp", "llama.cpp engine not installed")
    assert "or opt out: g4h parity --skip llamacpp" in checks(data, "reference~llamacpp")[0]["got"]
    assert "did not run (tiny.gguf/reference~llamacpp.runs)" in data["verdict"], data["verdict"]
    data, status = run_parity(models=[str(tiny_gguf)], against=["reference", "llamacpp"], out=str(tmp_path),
                              prompts=prompts, quiet=True, skip=("llamacpp",))
    assert status == 0, data["verdict"]
    (opted,) = checks(data, "reference~llamacpp")
    assert opted["informational"] and opted["got"] == "opted out"
    assert_pair_passes(data, "reference~reference")


def test_unknown_against_is_refused_before_any_work(tiny_gguf, tmp_path, capsys):
    out = tmp_path / "runs"
    assert g4h(["parity", "--model", str(tiny_gguf), "--against", "fast,nope", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["g4h: error: --against: unknown engine 'nope' (available: reference, transformers, fast, "
                   "llamacpp, cmd:..., openai:...)"], err
    assert not out.exists()


# --------------------------------------------------------------------------- slow: a built case, every engine


@pytest.mark.slow
def test_default_on_a_gguf_compares_reference_with_fast_and_llamacpp(built, tmp_path):
    require_llama_cpp()
    data, status = run_parity(models=[str(built.gguf["F32"])], out=str(tmp_path), quiet=True)
    assert status == 0, data["verdict"]
    assert data["cases"][0]["info"]["against"] == ["fast", "llamacpp"]
    assert_pair_passes(data, "reference~fast")
    assert_pair_passes(data, "reference~llamacpp")
    assert all(c["pass"] for c in checks(data, "reference.cached~uncached"))


@pytest.mark.slow
def test_against_every_engine_on_a_gguf(built, tmp_path, capsys):
    """One comma list through the CLI: each engine that reads a GGUF passes its pair; transformers cannot read a
    Gemma 4 GGUF, so its pair did not run: the run fails (exit 1) and the verdict says which."""
    require_llama_cpp()
    names = ["reference", "fast", "transformers", "llamacpp", example()]
    status = g4h(["parity", "--model", str(built.gguf["F32"]), "--against", ",".join(names), "--out", str(tmp_path),
                  "--quiet"])
    data = json.loads(next(tmp_path.glob("*-parity/results.json")).read_text())
    assert status == 1
    for pair in ("reference~reference", "reference~fast", "reference~llamacpp"):
        assert_pair_passes(data, pair)
    # the example answers logits, generate and tokenize, not trace: no per-layer figure
    assert_pair_passes(data, "reference~cmd", [m for m in METRICS if m != "layer_rel_l2"])
    assert_not_run(data, "reference~transformers", "needs an HF model folder")
    assert data["verdict"].startswith("FAIL: 1 gating check(s) failed (reference~transformers.runs)")
    assert "did not run (26b-a4b-F32.gguf/reference~transformers.runs)" in data["verdict"]
    assert capsys.readouterr().out.rstrip().endswith("(exit 1)")


@pytest.mark.slow
def test_against_every_engine_on_an_hf_folder(built, tmp_path):
    """The same on the HF folder: reference, fast and transformers pass; llama.cpp and the llama.cpp-based
    example read only GGUF files, so their pairs did not run. The default on a folder is fast and transformers."""
    require_llama_cpp()
    names = ["reference", "fast", "transformers", "llamacpp", example()]
    data, status = run_parity(models=[str(built.hf_dir)], against=names, out=str(tmp_path), quiet=True)
    assert status == 1
    for pair in ("reference~reference", "reference~fast", "reference~transformers"):
        assert_pair_passes(data, pair)
    assert_not_run(data, "reference~llamacpp", "the llamacpp engine needs a GGUF file")
    assert_not_run(data, "reference~cmd", "this engine reads GGUF files only")
    assert default_against(built.hf_dir) == ["fast", "transformers"]  # both passed above


@pytest.mark.slow
def test_example_engine_perturbed_fails_at_the_prompt_and_position(built, tmp_path):
    """examples/llamacpp_engine.py --perturb 5 --perturb-len 17: the logits of position 5 of the 17-token prompt
    get noise; exactly that prompt fails, and its worst logit is at position 5 (the intact engine passes in
    test_against_every_engine_on_a_gguf)."""
    require_llama_cpp()
    data, status = run_parity(models=[str(built.gguf["F32"])], against=[example("--perturb", "5", "--perturb-len",
                                                                                "17")],
                              out=str(tmp_path), quiet=True)
    assert status == 1
    logit = checks(data, "reference~cmd")
    failed = [c for c in logit if not c["pass"]]
    assert failed and {c["prompt"] for c in failed} == {"len17-window+1"}, failed
    worst = next(c for c in failed if c["gate"] == "reference~cmd.max_abs_logit")
    assert worst["max_abs_logit_at"][0] == 5 and worst["why"].startswith("worst at position 5 ")
    assert worst["first_divergence"] == "logits@position 5"
    assert worst["measured"] > DEFAULT_GATES["reference~cmd.max_abs_logit"].limit
    assert all(c["pass"] for c in logit if c["prompt"] != "len17-window+1")
    report = (Path(data["run_dir"]) / "report.md").read_text()
    assert "len17-window+1: worst at position 5" in report
    assert re.search(r"`reference~cmd.max_abs_logit` = \S+ \(limit \S+\) at request len17-window\+1 position 5 "
                     r"token \d+; first diverging point: logits@position 5", report), report


# --------------------------------------------------------------------------- --oracle fast


def test_oracle_fast_is_refused_where_it_cannot_apply(tiny_gguf, tmp_path, capsys):
    """--oracle fast goes with --model, and not with --against reference (that pair is reference~fast)."""
    out = tmp_path / "runs"
    assert g4h(["parity", "--oracle", "fast", "--case", "e2b", "--out", str(out)]) == 2
    assert g4h(["parity", "--model", str(tiny_gguf), "--oracle", "fast", "--against", "reference",
                "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["g4h: error: --oracle fast goes with --model (the built-in cases compare every engine with the "
                   "reference)",
                   "g4h: error: --against reference with --oracle fast: that pair is reference~fast; run --against "
                   "fast with the default oracle"], err
    assert not out.exists()


def test_oracle_fast_pairs_are_gated_like_the_reference_ones(tiny_gguf, tmp_path):
    """With --oracle fast the pairs are fast~<kind>, every metric gated with the bound of reference~<kind>; a
    second fast engine is bit-identical to the oracle (fast~fast, the bounds of reference~reference); the
    reference's float64 self-check is left out and the case says so."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{n}", "prompt_ids": [2] + [(7 * k + n) % 31 + 1 for k in
                                                                               range(n)]}) + "\n" for n in (4, 9)))
    stub = shlex.join([sys.executable, str(REPO_ROOT / "tests" / "cmd_stub.py")])
    data, status = run_parity(models=[str(tiny_gguf)], against=["fast", f"cmd:{stub}"], out=str(tmp_path),
                              prompts=prompts, quiet=True, oracle="fast")
    assert status == 0, data["verdict"]
    assert_pair_passes(data, "fast~fast")
    assert_pair_passes(data, "fast~cmd")
    assert all(c["measured"] == 0.0 for c in checks(data, "fast~fast")
               if c["gate"].rsplit(".", 1)[1] in ("max_abs_logit", "mean_kld", "max_abs_logprob", "layer_rel_l2"))
    for metric in METRICS:
        assert DEFAULT_GATES[f"fast~cmd.{metric}"].limit == DEFAULT_GATES[f"reference~cmd.{metric}"].limit
    info = data["cases"][0]["info"]
    assert info["oracle"]["name"] == "fast" and "reference.cached~uncached" in info["oracle"]["left_out"]
    assert not checks(data, "reference.cached~uncached") and not checks(data, "reference~fast")


@pytest.mark.slow
def test_oracle_fast_on_a_gguf_against_llamacpp(built, tmp_path):
    """The default with --oracle fast on a GGUF is llama.cpp alone; its pair passes with llama.cpp's fp16 GELU
    table emulated in fast (harness.engines.llamacpp.numerics.gelu_fp16_table_fast)."""
    require_llama_cpp()
    data, status = run_parity(models=[str(built.gguf["F32"])], out=str(tmp_path), quiet=True, oracle="fast")
    assert status == 0, data["verdict"]
    assert data["cases"][0]["info"]["against"] == ["llamacpp"]
    assert_pair_passes(data, "fast~llamacpp")
    logit = checks(data, "fast~llamacpp.max_abs_logit")
    assert all(c["vs_exact_reference"] >= c["measured"] for c in logit), logit  # the emulation removes a difference
