"""The per-layer gate of an emulated pair whose engine gives its tensors (``<pair>_q8.local_median``,
harness/parity/checks/quantized.py ``local_figure``; docs/quantized-activations.md): the emulating reference re-seeded
from the engine's own stream (``layer_inputs`` of :func:`reference.model.forward`), so an int8 rounding flip cannot
carry into the later layers, while a fault in a matrix shows at its own layer.

The fast tests: a re-seeded forward fed its own stream is the forward, bit for bit (Gemma 4 with PLE and KV sharing,
and a plain shape); the real ``llamacpp`` engine on small quantized files of varied shapes passes, and a copy with the
first half of one matrix's rows x1.02 fails with its layer named; so do one block's scale and two rows swapped in
Q4_1/Q5_1 (Q8_1 dot products), and a fault in one MoE expert (a minority of the positions).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

import gemma4_harness.reference.model as rm
from gemma4_harness.harness.traces.format import TraceWriter
from gemma4_harness.reference.weights import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ggml_lib import need_llamacpp  # noqa: E402

SHAPES = Path(__file__).parent / "shapes"

VARIANTS = {
    # odd-h72-v300 widened to whole Q8_0 blocks: 4 layers, one KV head, a tied head; attention outputs stay F16
    "h96-q8_0": ("odd-h72-v300.toml", {"hidden_size": 96, "intermediate_size": 160}, "Q8_0"),
    # odd-h100-v389-ple in Q4_0: PLE (its rows of 8 in F16), a KV-shared tail, a double-wide MLP, an untied head
    "h128-ple-q4_0": ("odd-h100-v389-ple.toml", {"hidden_size": 128, "intermediate_size": 192}, "Q4_0"),
    # the same two shapes in the types whose dot product takes the Q8_1 block sums (requantized from F32 by
    # gguf.quants: quant_faults.requantize); the other matrices stay F32
    "h96-q4_1": ("odd-h72-v300.toml", {"hidden_size": 96, "intermediate_size": 160}, "Q4_1"),
    "h128-ple-q5_1": ("odd-h100-v389-ple.toml", {"hidden_size": 128, "intermediate_size": 192}, "Q5_1"),
}


MOE = {
    # odd-h48-v777-moe widened to whole blocks: 5 experts top-2 (and the dense MLP beside them), k_eq_v full layer
    "h64-moe-q8_0": ("odd-h48-v777-moe.toml", {"hidden_size": 64, "intermediate_size": 96,
                                               "moe_intermediate_size": 64}, "Q8_0"),
    "h64-moe-q4_0": ("odd-h48-v777-moe.toml", {"hidden_size": 64, "intermediate_size": 96,
                                               "moe_intermediate_size": 64}, "Q4_0"),
}


def _built(variant: str, tmp_path: Path) -> tuple[Path, Path]:
    """The F32 and quantized GGUFs of a :data:`VARIANTS` or :data:`MOE` shape (built by ``g4h synth``'s builder,
    cached)."""
    from gemma4_harness.harness.synth import ensure_built

    from quant_faults import requantize

    base, changes, qtype = {**VARIANTS, **MOE}[variant]
    written = qtype not in ("Q4_1", "Q5_1")  # g4h synth writes the others
    text = (SHAPES / base).read_text()
    text = re.sub(r"^qtypes = .*$", f'qtypes = ["F32", "{qtype}"]' if written else 'qtypes = ["F32"]', text,
                  count=1, flags=re.M)
    for key, value in changes.items():
        text, n = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, count=1, flags=re.M)
        assert n == 1, key
    spec = tmp_path / f"local-{variant}.toml"
    spec.write_text(text)
    built = ensure_built(spec).gguf
    if not written:
        return Path(built["F32"]), requantize(Path(built["F32"]), tmp_path / f"{variant}.gguf", qtype)
    return Path(built["F32"]), Path(built[qtype])


@pytest.mark.parametrize("shape", ["odd-h100-v389-ple.toml", "odd-h72-v300.toml"])
def test_reseeded_with_its_own_stream_is_the_forward(shape):
    """Each layer fed the reference's own ``l_out`` of the layer before (and the first its own ``inp_scaled``) gives
    the plain forward's logits bit for bit: the re-seeding replaces the stream and nothing else (PLE, the KV cache,
    a shared layer's donor K/V follow). A stream of another shape is refused."""
    from gemma4_harness.harness.synth import ensure_built

    cfg, W = load_model(ensure_built(SHAPES / shape).gguf["F32"])
    ids = [3, 17, 42, 5, 99, 7, 11, 2, 64, 23, 31, 8, 77, 1]
    w = TraceWriter("ref", ids, keep_tensors=True)
    plain = rm.forward(cfg, W, ids, trace=w)
    tr = w.trace()
    seeds = {0: tr.tensor("inp_scaled", -1), **{il + 1: tr.tensor("l_out", il) for il in range(cfg.n_layer)}}
    assert np.array_equal(rm.forward(cfg, W, ids, layer_inputs=seeds), plain)
    moved = dict(seeds)
    moved[2] = seeds[2] * 1.01  # a different stream into layer 2 changes that layer, not the one before
    w2 = TraceWriter("ref", ids, keep_tensors=True)
    rm.forward(cfg, W, ids, trace=w2, layer_inputs=moved)
    assert np.array_equal(w2.trace().tensor("l_out", 1), tr.tensor("l_out", 1))
    assert not np.array_equal(w2.trace().tensor("l_out", 2), tr.tensor("l_out", 2))
    with pytest.raises(ValueError, match=r"layer_inputs\[1\]"):
        rm.forward(cfg, W, ids, layer_inputs={1: seeds[1][:-1]})
    if cfg.ple_dim:  # the PLE projection takes the given embedding (an engine's: its own fp32 bits), as layer 0 does
        w3 = TraceWriter("ref", ids, keep_tensors=True)
        rm.forward(cfg, W, ids, trace=w3, layer_inputs={**seeds, 0: seeds[0] * 1.01})
        assert not np.array_equal(w3.trace().tensor("inp_per_layer", -1), tr.tensor("inp_per_layer", -1))
        assert np.array_equal(w3.trace().tensor("inp_scaled", -1), tr.tensor("inp_scaled", -1))


@pytest.mark.parametrize("variant", ["h128-ple-q4_0", "h64-moe-q8_0"])
def test_reseeded_many_is_reseeded_one_by_one(variant, tmp_path):
    """``ReferenceRuns.reseeded_many`` (every prompt's re-seeded forward and its ``jitter_sums`` null in one pass over
    the weights, what the pair's ``local_median`` takes) gives each prompt's traces of ``reseeded`` one prompt at a
    time, bit for bit, the null's too, and the same ``local_errors``; a trace that cannot re-seed gets None in its
    place. On a quantized file with PLE and one with MoE experts, seeded from streams that differ from the
    reference's in their last bits (as an engine's do)."""
    from gemma4_harness.harness.engines.reference import ReferenceEngine
    from gemma4_harness.harness.parity.checks.reference_runs import ReferenceRuns, local_errors

    _, path = _built(variant, tmp_path)
    runs = ReferenceRuns(ReferenceEngine(path))
    cfg = runs.ref.cfg
    approx = runs.effective(("quantized_activations",))
    assert approx == ("quantized_activations",)
    rng = np.random.default_rng(5)
    prompts, engines = [], []
    for k, ids in enumerate(([3, 17, 42, 5, 99, 7, 11, 2, 64, 23, 31, 8, 77, 1], [9, 4, 250, 18], [6])):
        w = TraceWriter("engine", ids, keep_tensors=True)
        ref = runs.trace(approx, {"id": f"p{k}", "prompt_ids": ids})
        for r in ref.records:
            t = ref.tensor(r["point"], int(r["layer"]))
            w(r["point"], int(r["layer"]), (t * (1 + 1e-6 * rng.standard_normal(t.shape))).astype(np.float32))
        prompts.append({"id": f"p{k}", "prompt_ids": ids})
        engines.append(w.trace())
    lacking = TraceWriter("engine", prompts[0]["prompt_ids"], keep_tensors=True)
    lacking("inp_scaled", -1, engines[0].tensor("inp_scaled", -1))
    passes = runs.passes
    many = runs.reseeded_many(approx, prompts + [prompts[0]], engines + [lacking.trace()])
    assert runs.passes == passes + 1 and many[-1] is None
    for p, e, (seeded, null) in zip(prompts, engines, many):
        one = runs.reseeded(approx, p, e)
        for a, b in zip(one, (seeded, null)):
            assert a.tensors.keys() == b.tensors.keys()
            assert all(np.array_equal(a.tensors[k], b.tensors[k]) for k in a.tensors), (variant, p["id"])
        assert not np.array_equal(seeded.tensor("l_out", cfg.n_layer - 1), null.tensor("l_out", cfg.n_layer - 1))
        want = local_errors(e, *one, cfg.n_layer)
        got = runs.local_errors(approx, p, e)
        assert want.keys() == got.keys() and all(np.array_equal(want[k][i], got[k][i]) for k in want for i in (0, 1))
    assert runs.local_errors_many((), prompts, engines) == [None] * len(prompts)


def test_passing_cache_keeps_only_what_later_layers_read():
    """``PassingCache`` (the caches of ``reseeded_many``'s chains): a forward through it gives the plain forward's
    logits bit for bit on a shape with a KV-shared tail (the shared layers read their donors' K/V after them), and
    at its end holds only the K/V of the layers read at or after the last layer that appends its own, not every
    layer's."""
    from gemma4_harness.harness.parity.checks.reference_runs import PassingCache
    from gemma4_harness.harness.synth import ensure_built

    cfg, W = load_model(ensure_built(SHAPES / "odd-h100-v389-ple.toml").gguf["F32"])
    assert any(layer.kv_donor != layer.index for layer in cfg.layers)
    ids = [3, 17, 42, 5, 99, 7, 11, 2, 64, 23, 31, 8, 77, 1]
    whole, passing = rm.KVCache(cfg), PassingCache(cfg)
    assert np.array_equal(rm.forward(cfg, W, ids, passing), rm.forward(cfg, W, ids, whole))
    last = max(whole.k)
    assert set(passing.k) == {j for j in whole.k if passing.last_reader[j] >= last} and len(passing.k) < len(whole.k)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_llamacpp_local_gate_passes_correct_names_faulty_layer(variant, tmp_path):
    """The ``llamacpp`` engine on a small quantized file passes ``local_median`` (within its floor, far below it), and
    on a copy whose ``blk.1.ffn_down`` has the first half of its rows x1.02 fails it, naming layer 1 (its ``ffn_out``)
    as the first diverging point; ``agreeing_positions`` is reported beside it."""
    from quant_faults import make_fault
    from quant_pairs import judge, prompts_for

    from gemma4_harness.harness.engines.reference import ReferenceEngine
    from gemma4_harness.harness.parity.checks.reference_runs import ReferenceRuns

    need_llamacpp()
    _, path = _built(variant, tmp_path)
    runs = ReferenceRuns(ReferenceEngine(path))
    assert runs.unemulated_types()  # quantized or 16-bit matrices: the emulated pair
    prompts = prompts_for(path, runs.ref.cfg)[:4]
    gate = "reference~llamacpp_q8.local_median"
    good = judge(runs, path, prompts, n_tokens=2)
    assert good["passed"], {g: v["worst"] for g, v in good["gates"].items() if v["fail"]}
    local = good["gates"][gate]
    assert local["worst"] < local["limit"] / 10 and local["detail"]["first_divergence"] is None, local
    assert good["gates"]["reference~llamacpp_q8.agreeing_positions"]["informational"]
    bad_file, _ = make_fault("rows", path, tmp_path / "rows.gguf", "blk.1.ffn_down.weight")
    bad = judge(runs, bad_file, prompts, n_tokens=2)
    local = bad["gates"][gate]
    assert not bad["passed"] and local["fail"], local
    assert local["detail"]["first_layer"] == 1 and local["detail"]["first_divergence"] == "ffn_out@1", local


@pytest.mark.parametrize("variant", ["h96-q4_1", "h128-ple-q5_1"])
def test_llamacpp_local_gate_names_block_and_swap_faults_with_q8_1_dot_products(variant, tmp_path):
    """Q4_1/Q5_1 (their products take Q8_1 activations with block sums): a copy of the file with one block's scale
    (d and m) x1.5 in ``blk.1.ffn_down``, and one with two of its rows swapped, each fail ``local_median`` through
    the ``llamacpp`` engine, naming layer 1 (its ``ffn_out``); the correct file passes (the test above)."""
    from quant_faults import make_fault
    from quant_pairs import judge, prompts_for

    from gemma4_harness.harness.engines.reference import ReferenceEngine
    from gemma4_harness.harness.parity.checks.reference_runs import ReferenceRuns

    need_llamacpp()
    _, path = _built(variant, tmp_path)
    runs = ReferenceRuns(ReferenceEngine(path))
    prompts = prompts_for(path, runs.ref.cfg)[:4]
    for kind in ("block", "swap"):
        bad_file, what = make_fault(kind, path, tmp_path / f"{kind}.gguf", "blk.1.ffn_down.weight")
        bad = judge(runs, bad_file, prompts, n_tokens=2)
        local = bad["gates"]["reference~llamacpp_q8.local_median"]
        assert not bad["passed"] and local["fail"], (what, local)
        assert local["detail"]["first_layer"] == 1 and local["detail"]["first_divergence"] == "ffn_out@1", (what, local)


@pytest.mark.parametrize("variant", list(MOE))
def test_llamacpp_local_gate_names_a_fault_in_one_moe_expert(variant, tmp_path):
    """A fault in one expert moves only the positions routed to it: the first half of expert 0's rows of
    ``blk.2.ffn_down_exps`` x1.02 moves fewer than half of the 217 positions of the synthetic prompts at ``ffn_moe@2``
    (so a median over positions would pass it), and ``local_median``, judged at the rank the flips allow, fails,
    naming layer 2; the correct file passes with at most as many positions beyond the limit as flips explain."""
    from quant_faults import make_fault
    from quant_pairs import judge, prompts_for

    from gemma4_harness.harness.engines.reference import ReferenceEngine
    from gemma4_harness.harness.parity.checks.reference_runs import ReferenceRuns

    need_llamacpp()
    _, path = _built(variant, tmp_path)
    runs = ReferenceRuns(ReferenceEngine(path))
    prompts = prompts_for(path, runs.ref.cfg)  # all of them: the resolution grows with the positions
    gate = "reference~llamacpp_q8.local_median"
    good = judge(runs, path, prompts, n_tokens=2)
    assert good["passed"], {g: v["worst"] for g, v in good["gates"].items() if v["fail"]}
    local = good["gates"][gate]
    assert local["detail"]["first_divergence"] is None
    assert all(b <= m for _, _, b, _, m in local["detail"]["moved_per_point"]), local["detail"]["moved_per_point"]
    bad_file, what = make_fault("expert", path, tmp_path / "expert.gguf", "blk.2.ffn_down_exps.weight")
    bad = judge(runs, bad_file, prompts, n_tokens=2)
    local = bad["gates"][gate]
    assert not bad["passed"] and local["fail"], (what, local)
    assert local["detail"]["first_layer"] == 2 and local["detail"]["first_divergence"] == "ffn_moe@2", local
    positions = sum(len(p["prompt_ids"]) for p in prompts)
    (moved,) = [b for p, il, b, _, _ in local["detail"]["moved_per_point"] if (p, il) == ("ffn_moe", 2)]
    assert 0 < moved < positions / 2, (moved, positions)  # a minority: the median alone is blind to it


def test_flips_explained_is_the_poisson_bound_it_says():
    """:func:`flips_explained`: for a null count n, the rate u whose P(X <= n) is alpha, and the least m whose
    P(X > m) under twice that rate is at most alpha (and m - 1 is not); growing with n."""
    import math

    from gemma4_harness.harness.core.gates import EFFECT_FACTOR, Q8_LOCAL_ALPHA
    from gemma4_harness.harness.parity.checks.quantized import flips_explained, poisson_cdf

    ms = [flips_explained(n) for n in range(8)]
    assert ms == sorted(ms) and len(set(ms)) == len(ms), ms
    for n, m in enumerate(ms):
        lo, hi = 0.0, 100.0
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if poisson_cdf(n, mid) > Q8_LOCAL_ALPHA else (lo, mid)
        lam = EFFECT_FACTOR * hi
        tail = 1.0 - sum(math.exp(-lam) * lam**i / math.factorial(i) for i in range(m + 1))
        assert tail <= Q8_LOCAL_ALPHA * (1 + 1e-9) and 1.0 - poisson_cdf(m - 1, lam) > Q8_LOCAL_ALPHA, (n, m)


@pytest.mark.slow
def test_g4h_parity_on_a_quantized_file_writes_its_report_with_the_local_gate(tmp_path):
    """``g4h parity --model Q --against llamacpp`` end to end on a quantized file: the local gate's figure goes
    through results.json, the report and its per-layer plot (a figure whose ``per_point`` rows had a fourth column
    once ended the run with a traceback in ``report.per_layer_frame``, after every check had passed)."""
    import json
    import subprocess

    need_llamacpp()
    _, path = _built("h96-q8_0", tmp_path)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "gemma4_harness", "parity", "--model", str(path), "--against",
                           "llamacpp", "--out", str(out), "--quiet"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # no spurious warning: llama-cpp-python's two /dev/null files, left open for good, ended every such run with
    # "sys:1: ResourceWarning" (harness/cli/__init__.py, _warnings_shown)
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]
    (results,) = out.glob("*-parity/results.json")
    checks = [c for case in json.loads(results.read_text())["cases"] for c in case.get("checks", [])]
    local = [c for c in checks if c["gate"].endswith("_q8.local_median")]
    assert local and all(c["pass"] and len(row) == 3 for c in local for row in c["per_point"]), local[:1]
    assert (results.parent / "report.md").is_file()


@pytest.mark.slow
def test_a_quantized_pair_is_explained_by_the_same_local_gate(tmp_path):
    """Where an engine that rounds its activations is judged by ``local_median`` (a quantized file), the explanation
    is judged by it too, re-seeded under each trial's variants. ``g4h parity`` on a Q8_0 file without
    ``final_logit_softcapping`` (llama.cpp applies 30 where the file says nothing: the known disagreement
    ``softcap_default_30``): explained by that variant. The engine on a copy with half of one matrix's rows x1.02,
    against the reference of the correct file: explained by no variant, its layer named. Judged by the plain gates
    instead, no variant could pass on a quantized file (the int8 flips alone exceed them): the first read "no known
    variant explains it" before."""
    import json
    import subprocess

    from quant_faults import make_fault
    from quant_pairs import prompts_for

    from gemma4_harness.harness.core.gates import DEFAULT_GATES
    from gemma4_harness.harness.engines import make_engine
    from gemma4_harness.harness.engines.reference import ReferenceEngine
    from gemma4_harness.harness.parity.checks.explain_pair import explain_failing_pair
    from gemma4_harness.harness.parity.checks.pair import _measure
    from gemma4_harness.harness.parity.checks.reference_runs import ReferenceRuns
    from gemma4_harness.harness.parity.result import CaseResult
    from gemma4_harness.harness.synth import ensure_built

    need_llamacpp()
    base, changes, qtype = VARIANTS["h96-q8_0"]
    text = (SHAPES / base).read_text()
    text, n = re.subn(r"^final_logit_softcapping = .*\n", "", text, count=1, flags=re.M)
    assert n == 1
    text = re.sub(r"^qtypes = .*$", f'qtypes = ["F32", "{qtype}"]', text, count=1, flags=re.M)
    for key, value in changes.items():
        text = re.sub(rf"^{key} = .*$", f"{key} = {value}", text, count=1, flags=re.M)
    spec = tmp_path / "local-nosoftcap.toml"
    spec.write_text(text)
    nosoftcap = Path(ensure_built(spec).gguf[qtype])
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "gemma4_harness", "parity", "--model", str(nosoftcap), "--against",
                           "llamacpp", "--out", str(out), "--quiet"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    (results,) = out.glob("*-parity/results.json")
    checks = [c for case in json.loads(results.read_text())["cases"] for c in case.get("checks", [])]
    local = next(c for c in checks if c["gate"] == "reference~llamacpp_q8.local_median")
    assert not local["pass"] and local["first_divergence"] == "result_output@-1", local
    (expl,) = [c["explanation"] for c in checks if isinstance(c.get("explanation"), dict)]
    assert expl["status"] == "explained" and expl["line"].startswith("explained by softcap_default_30:"), expl["line"]
    assert "median rel. L2 re-seeded" in expl["line"], expl["line"]

    _, good = _built("h96-q8_0", tmp_path)
    rows, _ = make_fault("rows", good, tmp_path / "rows.gguf", "blk.1.ffn_down.weight")
    runs = ReferenceRuns(ReferenceEngine(good))
    prompts = prompts_for(good, runs.ref.cfg)[:4]
    eng = make_engine("llamacpp", rows)
    try:
        figs: list = []
        _measure(runs, eng, "llamacpp", "reference~llamacpp", prompts, lambda m: None, "q", 2, out=figs)
        res = CaseResult(case="q", kind="user", model=str(rows))
        res.apply(figs, DEFAULT_GATES)
        assert not res.passed
        explain_failing_pair(runs, eng, "llamacpp", "reference~llamacpp", prompts, figs, lambda m: None, "q")
    finally:
        close = getattr(eng, "close", None)  # the in-process engine has nothing to close
        if close:
            close()
    (expl,) = [f.detail["explanation"] for f in figs if "explanation" in f.detail]
    assert expl["status"] == "unexplained" and expl["line"].startswith("no known variant explains it"), expl["line"]
    assert expl["baseline"]["first_divergence"] == "ffn_out@1", expl["baseline"]
