"""Explaining a divergence (harness/parity/explain.py, docs/spec-variants.md): an engine built as the reference under a
spec variant (tests/cmd_stub.py --spec, a ``cmd:`` engine) fails parity, and the parity job, ``g4h explain``,
``g4h compare`` and ``g4h diff`` name exactly that variant; the unmodified reference is explained by none; pairs of
variants are found; the multimodal merge's and the MTP drafter's variants likewise (in-process engines: the
subprocess protocol carries neither images nor drafts).

The models are tests/variant_lab.py's (every text variant changes something there); the prompts are three of
cases/prompts/synthetic.jsonl, longer than the lab's window of 4.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from variant_lab import build

import gemma4_harness.reference.drafter as rd
from gemma4_harness.harness.cli import main as g4h_main
from gemma4_harness.harness.core.cases import MODELS_DIR, PROMPTS
from gemma4_harness.harness.core.gates import DEFAULT_GATES
from gemma4_harness.harness.core.prompts import load_prompts
from gemma4_harness.harness.engines.reference import ReferenceEngine
from gemma4_harness.harness.engines.variants import VARIANTS, family, under
from gemma4_harness.harness.parity.checks.server import ServerOptions
from gemma4_harness.harness.parity.explain_search import Observed, Trial, search
from gemma4_harness.harness.parity.explain_mm import DraftObserved, MMReference, explain_drafter, explain_mm
from gemma4_harness.harness.parity.job import run as run_parity
from gemma4_harness.harness.traces.format import TraceWriter
from gemma4_harness.reference.multimodal import Injection

STUB = Path(__file__).resolve().parent / "cmd_stub.py"
LOGIT_GATE = DEFAULT_GATES["reference~cmd.max_abs_logit"].limit  # what an fp32 engine is held to
#: gelu_fp16_table fails the logit gate on len16-window; on len1-bos attention has one key, so its scale changes
#: nothing there (the search must not rank a variant by a prompt another did not reach)
PROMPT_IDS = ("len1-bos", "len5", "len16-window", "len17-window+1")

#: The variants each lab model's parity run holds, one engine each (lab-moe: the MoE ones and the missing softcap;
#: the rest are shown on lab-dense).
SINGLES = {"lab-dense": [v.name for v in family("text") if v.name not in
                         ("router_expert_input", "router_dense_input", "softcap_default_30", "experts_swiglu")],
           "lab-moe": ["router_expert_input", "router_dense_input", "softcap_default_30", "experts_swiglu"]}
PAIRS = {"lab-dense": [("window_inclusive", "head_tied"), ("kv_donor_position", "ple_token_unscaled"),
                       ("rope_freqs_ignored", "softcap_dropped"), ("kv_donor_first", "attn_scale_head_dim")],
         "lab-moe": [("router_expert_input", "softcap_default_30")]}


@dataclasses.dataclass
class Ran:
    returncode: int
    stdout: str


@pytest.fixture
def g4h(capsys):
    """``g4h ARGS`` in this process (the CLI's own code path, without a new interpreter's imports per call)."""
    def run(*args: str) -> Ran:
        capsys.readouterr()
        rc = g4h_main(list(args))
        return Ran(rc, capsys.readouterr().out)
    return run


def _cmd(*spec: str) -> str:
    return f"cmd:'{sys.executable} {STUB}" + (f" --spec {','.join(spec)}" if spec else "") + "'"


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> dict[str, Path]:
    return build(tmp_path_factory.mktemp("lab"))


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    rows = [p for p in load_prompts(PROMPTS) if p["id"] in PROMPT_IDS]
    path.write_text("".join(json.dumps({"id": p["id"], "prompt_ids": p["prompt_ids"]}) + "\n" for p in rows))
    return path


@pytest.fixture(scope="module")
def runs(lab, prompts_file, tmp_path_factory) -> dict[str, tuple[dict, int, list[tuple[str, ...]]]]:
    """One ``g4h parity --model`` run per lab model: the unmodified reference, then one engine per variant of
    :data:`SINGLES`, then one per pair of :data:`PAIRS`; model -> (results, status, the variants of each engine)."""
    out = {}
    for name, path in lab.items():
        engines = [(), *[(v,) for v in SINGLES[name]], *PAIRS[name]]
        data, status = run_parity(models=[str(path)], against=[_cmd(*e) for e in engines], quiet=True,
                                  out=str(tmp_path_factory.mktemp("reports")), prompts=prompts_file,
                                  server=ServerOptions(max_new_tokens=2))  # short greedy streams: CI time
        out[name] = (data, status, engines)
    return out


def _pair_checks(data: dict, number: int) -> list[dict]:
    pair = "reference~cmd" if number == 1 else f"reference~cmd#{number}"
    return [c for c in data["cases"][0]["checks"] if c["gate"].rsplit(".", 1)[0] == pair]


def _explanation(checks: list[dict]) -> dict | None:
    return next((c["explanation"] for c in checks if "explanation" in c), None)


@pytest.mark.parametrize("model", ["lab-dense", "lab-moe"])
def test_every_variant_fails_parity_and_is_explained_by_exactly_it(runs, model):
    data, status, engines = runs[model]
    assert status == 1
    for number, spec in enumerate(engines, 1):
        if len(spec) != 1:
            continue
        checks = _pair_checks(data, number)
        failed = [c["gate"] for c in checks if not c["pass"] and not c.get("informational")]
        assert failed, f"{spec[0]}: the engine passed every gate"
        e = _explanation(checks)
        assert e is not None and e["status"] == "explained", (spec, e and e["line"])
        assert [t["variants"] for t in e["explained_by"]] == [list(spec)], (spec, e["line"])
        best = e["explained_by"][0]
        assert best["figures"]["max_abs_logit"] <= LOGIT_GATE < e["baseline"]["figures"]["max_abs_logit"]
        assert e["line"].startswith(f"explained by {spec[0]}: max |Δlogit| ")
        assert VARIANTS[spec[0]].sources[0].where in e["line"]


@pytest.mark.parametrize("model", ["lab-dense", "lab-moe"])
def test_the_unmodified_reference_passes_and_is_explained_by_nothing(runs, model):
    data, _, engines = runs[model]
    assert engines[0] == ()
    checks = _pair_checks(data, 1)
    assert checks and all(c["pass"] for c in checks), [c["gate"] for c in checks if not c["pass"]]
    assert _explanation(checks) is None


@pytest.mark.parametrize("model", ["lab-dense", "lab-moe"])
def test_pairs_of_variants_are_explained_together(runs, model):
    data, _, engines = runs[model]
    for number, spec in enumerate(engines, 1):
        if len(spec) != 2:
            continue
        e = _explanation(_pair_checks(data, number))
        assert e is not None and e["status"] == "explained", (spec, e and e["line"])
        assert [sorted(t["variants"]) for t in e["explained_by"]] == [sorted(spec)], (spec, e["line"])
        assert e["pairs_tried"] >= 1


def test_the_report_says_it_in_its_first_section(runs):
    data, _, engines = runs["lab-moe"]
    report = (Path(data["run_dir"]) / "report.md").read_text()
    head = report.split("\n| case ", 1)[0]  # before the summary table
    for spec in engines[1:]:
        assert f"explained by {' + '.join(spec)}" in head or f"explained by {' + '.join(reversed(spec))}" in head
    assert head.count("\n- **") == len(engines) - 1


def test_g4h_explain_names_the_variant_and_exits_1(g4h, lab, prompts_file, tmp_path):
    out = tmp_path / "e.json"
    proc = g4h("explain", "--model", str(lab["lab-moe"]), "--engine", _cmd("router_expert_input"),
                   "--prompts", str(prompts_file), "--json", str(out))
    assert proc.returncode == 1, proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("explained by router_expert_input: max |Δlogit| ")
    e = json.loads(out.read_text())
    assert e["first_point"] == "ffn_moe@0"
    assert e["candidates"][0]["variants"] == ["router_expert_input"]
    assert set(e["not_applicable"]) >= {"head_tied", "kv_donor_position", "ple_token_unscaled"}
    proc = g4h("explain", "--model", str(lab["lab-moe"]), "--engine", _cmd(), "--prompts", str(prompts_file))
    assert proc.returncode == 0 and "nothing to explain" in proc.stdout


@pytest.mark.parametrize("ops", [(), ("--ops", "generate")], ids=["logits", "streams-only"])
def test_g4h_explain_says_a_fault_only_in_decoding(g4h, lab, prompts_file, tmp_path, ops):
    """Exact logits, a repetition penalty in greedy decoding (cmd_stub --repeat-penalty): ``g4h explain`` runs the
    parity job's explanation (its streams judged too), so it says "in decoding", naming the request and the step,
    exits 1, and searches no variant; so does an engine that gives only streams and their log-probs (before: "nothing
    to explain", and "no known variant explains it")."""
    eng = f"cmd:'{sys.executable} {STUB} {' '.join(ops)} --repeat-penalty 1.5'"
    out = tmp_path / "e.json"
    proc = g4h("explain", "--model", str(lab["lab-dense"]), "--engine", eng, "--prompts", str(prompts_file),
               "--json", str(out))
    assert proc.returncode == 1, proc.stdout
    e = json.loads(out.read_text())
    d = e["decoding"]
    assert e["status"] == "decoding" and e["singles_tried"] == 0 and d["kind"] == "decoding"
    assert proc.stdout.strip().splitlines()[-1].startswith(
        f"in decoding, not in the logits: request {d['request']} step {d['step']}: it gave {d['ours']}, "), proc.stdout
    assert "a repeated token's logit lowered" in d["what"] and "repetition penalty" in d["what"], d["what"]
    assert d.get("evidence") == ("log-probs" if ops else None)


def test_g4h_explain_judges_by_the_declaration_and_tol(g4h, lab, prompts_file):
    """An fp32 engine that follows llama.cpp's fp16 GELU table without declaring it is held to the fp32 bound
    (``oracle~engine``, 1e-3 on logits): it fails on lab-moe and is explained by ``gelu_fp16_table``. With
    ``--tol 0.1`` the same difference is inside the user's bound: nothing to explain. Declared (``--approx``), the
    reference makes the table too: nothing to explain either."""
    eng = _cmd("gelu_fp16_table")
    proc = g4h("explain", "--model", str(lab["lab-moe"]), "--engine", eng, "--prompts", str(prompts_file))
    assert proc.returncode == 1 and "explained by gelu_fp16_table" in proc.stdout, proc.stdout
    proc = g4h("explain", "--model", str(lab["lab-moe"]), "--engine", eng, "--prompts", str(prompts_file),
               "--tol", "0.1")
    assert proc.returncode == 0 and "nothing to explain" in proc.stdout, proc.stdout
    declared = eng[:-1] + " --approx gelu_fp16_table'"
    proc = g4h("explain", "--model", str(lab["lab-moe"]), "--engine", declared, "--prompts", str(prompts_file))
    assert proc.returncode == 0 and "nothing to explain" in proc.stdout, proc.stdout


def test_an_unknown_fault_is_explained_by_no_variant(g4h, lab, prompts_file):
    """Noise on one weight (cmd_stub --perturb-layer) is no known rule: the closest candidates are listed."""
    proc = g4h("explain", "--model", str(lab["lab-dense"]), "--engine",
                   f"cmd:{sys.executable} {STUB} --perturb-layer 2", "--prompts", str(prompts_file))
    assert proc.returncode == 1
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("no known variant explains it; closest: ") and "pairs tried" in last, last


def test_g4h_compare_and_diff_name_the_variant(g4h, lab, tmp_path):
    model = lab["lab-dense"]
    (tmp_path / "p.json").write_text(json.dumps([2, 100, 200, 300, 17, 45, 99, 301, 302, 5, 6]))
    eng = _cmd("window_inclusive")
    assert g4h("logits", "--model", str(model), "--engine", eng, "--prompt-ids", str(tmp_path / "p.json"),
                   "--out", str(tmp_path / "z.npy")).returncode == 0
    proc = g4h("compare", str(tmp_path / "z.npy"), "--against", "reference", "--model", str(model),
                   "--prompt-ids", str(tmp_path / "p.json"))
    assert proc.returncode == 1
    assert "against the reference: explained by window_inclusive: max |Δlogit|" in proc.stdout
    for side, engine in (("a", _cmd("kv_donor_position")), ("b", "reference")):
        assert g4h("trace", "--model", str(model), "--engine", engine, "--prompt-ids", str(tmp_path / "p.json"),
                       "--out", str(tmp_path / f"{side}.jsonl"), "--dump-tensors",
                       str(tmp_path / f"{side}-t")).returncode == 0
    proc = g4h("diff", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--model", str(model))
    assert proc.returncode == 1
    assert "against the reference: explained by kv_donor_position: worst rel. L2" in proc.stdout


def test_greedy_streams_alone_are_explained(g4h, lab, prompts_file, tmp_path):
    """A server gives no logits: the streams and their top-5 log-probs are enough (g4h compare on generations)."""
    gen = tmp_path / "g.jsonl"
    assert g4h("generate", "--model", str(lab["lab-dense"]), "--engine", _cmd("head_tied"), "--prompts",
                   str(prompts_file), "--max-new-tokens", "4", "--out", str(gen)).returncode == 0
    proc = g4h("compare", str(gen), "--against", "reference", "--model", str(lab["lab-dense"]), "--prompts",
                   str(prompts_file))
    assert proc.returncode == 1
    assert "explained by head_tied: max |Δlogprob|" in proc.stdout, proc.stdout


def test_the_budget_bounds_the_search_and_says_what_it_left(tiny_gguf):
    """:func:`search` with a fake subject: a zero budget tries nothing after the baseline and lists every candidate;
    the variants whose first point is the diverging point are tried first."""
    calls = []

    def measure(vs, full=False):
        calls.append(tuple(v.name for v in vs))
        return Trial(tuple(v.name for v in vs), passed=vs == (VARIANTS["softcap_dropped"],),
                     figures={"max_abs_logit": 0.0 if vs else 1.0}, first_divergence=None if vs else "result_output")

    cfg = ReferenceEngine(tiny_gguf).cfg
    e = search(measure, family("text"), cfg, budget_s=0.0)
    assert e.status == "unexplained" and calls == [()] and "softcap_dropped" in e.not_tried
    assert "ple_token_unscaled" in e.not_applicable  # the tiny model has no PLE
    calls.clear()
    e = search(measure, family("text"), cfg, budget_s=60.0)
    assert e.status == "explained" and calls[1] == ("softcap_dropped",)  # in scope of result_output: tried first


# --------------------------------------------------------------------------- multimodal merge and drafter


def _mm_model(lab):
    """lab-dense as a multimodal decoder: pad_token_id 1 (so the PLE row of placeholders differs between
    transformers and llama.cpp / JAX), bidirectional image blocks on sliding layers, two prompts with an image block
    of random soft tokens (the merge's variants act on what the encoders give, held fixed)."""
    ref = ReferenceEngine(lab["lab-dense"])
    cfg = dataclasses.replace(ref.cfg, pad_token_id=1, use_bidirectional_attention="vision")
    rng = np.random.default_rng(1)
    inj = {}
    for n, (lo, hi) in ((14, (3, 10)), (9, (2, 6))):
        ids = [2] + [int(x) for x in rng.integers(4, 499, size=n - 1)]
        ph = np.zeros(n, bool)
        ph[lo:hi] = True
        ids = [500 if p else t for t, p in zip(ids, ph)]
        inj[tuple(ids)] = Injection(rng.normal(0.0, 1.0, (hi - lo, cfg.hidden_size)), ph, np.where(ph, 1, 0))
    return MMReference(cfg, ref.weights, inj)


def _mm_engine(mm: MMReference, variants) -> list[Observed]:
    out = []
    with under(variants, fast=False):
        for i, ids in enumerate(mm.injections):
            w = TraceWriter("engine", list(ids), dtype="float64", keep_tensors=True)
            z = mm.logits(ids, trace=w).astype(np.float32).astype(np.float64)
            out.append(Observed(str(i), list(ids), z, w.trace()))
    return out


def test_multimodal_variants_are_explained_by_exactly_themselves(lab):
    mm = _mm_model(lab)
    assert explain_mm(mm, _mm_engine(mm, [])).status == "nothing_to_explain"
    for v in family("multimodal"):
        assert v.why_not(mm.cfg) is None, v.name
        e = explain_mm(mm, _mm_engine(mm, [v]))
        assert [t.variants for t in e.explained_by] == [(v.name,)], (v.name, e.line())
        assert e.baseline.figures["max_abs_logit"] > LOGIT_GATE
    e = explain_mm(mm, _mm_engine(mm, [VARIANTS["mm_ple_row_zero"], VARIANTS["window_inclusive"]]))
    assert [set(t.variants) for t in e.explained_by] == [{"mm_ple_row_zero", "window_inclusive"}], e.line()


def test_drafter_variants_are_explained_by_exactly_themselves():
    from gemma4_harness.harness.synth.drafter import ensure_drafter_built
    from gemma4_harness.reference.drafter_weights import load_drafter
    from gemma4_harness.reference.weights import load_model

    built = ensure_drafter_built(MODELS_DIR / "e2b-assistant.toml")  # built by test_drafter.py too (cached)
    target, TW = load_model(built.target.gguf["F32"])
    d, DW = load_drafter(built.hf_dir)
    d = rd.bind(d, target)
    rng = np.random.default_rng(3)
    prompts = [[2] + [int(x) for x in rng.integers(4, 500, size=n)] for n in (20, 24)]  # beyond the window of 16

    def engine(variants):
        out = []
        with under(variants, fast=False):
            for i, ids in enumerate(prompts):
                cache, tok, h = rd.after_prefill(target, TW, ids)
                toks, logits, _ = rd.draft(d, DW, target, TW, cache, tok, h, 4)
                out.append(DraftObserved(str(i), ids, [z.astype(np.float32) for z in logits], toks))
        return out

    assert explain_drafter(d, DW, target, TW, engine([])).status == "nothing_to_explain"
    for v in family("drafter"):
        e = explain_drafter(d, DW, target, TW, engine([v]))
        assert [t.variants for t in e.explained_by] == [(v.name,)], (v.name, e.line())
        assert e.baseline.figures["max_abs_logit"] > LOGIT_GATE


@pytest.mark.slow
def test_g4h_explain_takes_images(g4h, tmp_path):
    """``g4h explain --image``: the fast engine on the built multimodal case agrees with the reference (its soft
    tokens and the decoder with the reference's): nothing to explain, exit 0; the merge's variants are the ones
    considered (``not_applicable`` names them where they cannot act)."""
    from gemma4_harness.harness.core.mm_prompts import make_image, write_png

    write_png(tmp_path / "i.png", make_image(72, 120, 1))
    (tmp_path / "p.json").write_text("[2, 10, 500, 11]")
    proc = g4h("explain", "--model", "mm-llamacpp", "--engine", "fast", "--image", str(tmp_path / "i.png"),
               "--prompt-ids", str(tmp_path / "p.json"), "--json", str(tmp_path / "e.json"))
    assert proc.returncode == 0 and "nothing to explain" in proc.stdout, proc.stdout
    assert json.loads((tmp_path / "e.json").read_text())["status"] == "nothing_to_explain"


def test_real_llamacpp_is_explained_by_its_default_softcap(g4h, prompts_file):
    """A real engine: llama.cpp on a model that states no final softcap (the built-in edge-no-softcap case) applies
    its default of 30 (src/llama-hparams.h); g4h explain names that disagreement."""
    import llama_cpp  # noqa: F401  (missing: nox -s tests installs it from the build cache)

    proc = g4h("explain", "--model", "edge-no-softcap", "--engine", "llamacpp", "--prompts", str(prompts_file))
    assert proc.returncode == 1
    assert proc.stdout.strip().splitlines()[-1].startswith("explained by softcap_default_30: max |Δlogit| "), \
        proc.stdout


def test_the_fast_twin_follows_the_multimodal_variants_it_has_a_form_of(lab):
    from gemma4_harness.fast.model import FastModel

    mm = _mm_model(lab)
    bound = DEFAULT_GATES["reference~fast.max_abs_logit"].limit
    plain = {ids: mm.logits(ids) for ids in mm.injections}
    for v in family("multimodal"):
        if not v.has_fast:
            continue
        with under([v]):
            fm = FastModel(mm.cfg, mm.W, "cpu", "float32")
            for ids, inj in mm.injections.items():
                want = mm.logits(ids)
                assert np.max(np.abs(np.asarray(fm.logits(list(ids), mm=inj).double()) - want)) <= bound, v.name
                assert np.max(np.abs(want - plain[ids])) > bound, v.name  # the variant changed something


@pytest.mark.parametrize("ops", [(), ("--ops", "generate")], ids=["logits+trace", "streams-only"])
def test_g4h_explain_judges_a_declaring_engine_at_the_pairs_limits(g4h, tmp_path, ops):
    """An engine declaring llama.cpp's GELU table and an f16 KV cache that computes exactly (cmd_stub: one effect
    from the emulating reference, as tests/test_declared_numerics.py has it) on the F32 odd-h88-v515-gqa shape:
    ``g4h explain`` raises each limit by the effect of the declared approximations as ``g4h parity`` does
    (harness.parity.checks.pair.declared_effects, pair_near_tie), so it exits 0 (before: 1, a false alarm where
    parity passes); at the fp32 limits (``--tol``, which no effect raises) the same engine stands apart, so the
    effect is what decides. Half of one matrix's rows x1.02 (``--scale-rows``) still exits 1."""
    from gemma4_harness.harness import synth

    gguf = synth.ensure_built(Path(__file__).resolve().parent / "shapes" / "odd-h88-v515-gqa.toml").gguf["F32"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"g{len(ids)}", "prompt_ids": ids}) + "\n"
                               for ids in ([2, 40, 311, 7, 199], [2, 13, 500, 77, 256, 91, 8, 430, 61, 5, 388, 17, 3])))
    declared = f"cmd:'{sys.executable} {STUB} {' '.join(ops)} --approx gelu_fp16_table --kv-cache float16"
    run = ("explain", "--model", str(gguf), "--prompts", str(prompts), "--explain-budget", "5")
    proc = g4h(*run, "--engine", declared + "'")
    assert proc.returncode == 0 and "nothing to explain" in proc.stdout, proc.stdout
    fp32 = DEFAULT_GATES["reference~cmd.max_abs_logprob" if ops else "reference~cmd.max_abs_logit"].limit
    proc = g4h(*run, "--engine", declared + "'", "--tol", f"{fp32:g}")
    assert proc.returncode == 1 and "0 of 2 prompts diverge" not in proc.stdout, proc.stdout
    proc = g4h(*run, "--engine", declared + " --scale-rows 1'")
    assert proc.returncode == 1 and "nothing to explain" not in proc.stdout, proc.stdout
