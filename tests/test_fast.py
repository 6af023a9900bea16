"""The torch fast path against the float64 reference, and its serving shape (paged cache, batching)."""

from __future__ import annotations

import pytest
import torch

from gemma4_harness.fast.engine import Engine, Request
from gemma4_harness.fast.model import FastModel
from gemma4_harness.harness import synth
from gemma4_harness.harness.core.cases import MODELS_DIR, builtin_specs
from gemma4_harness.harness.core.gates import resolve
from gemma4_harness.harness.core.prompts import load_prompts
from gemma4_harness.harness.engines.checked import CheckedEngine
from gemma4_harness.harness.engines.reference import ReferenceEngine
from gemma4_harness.harness.parity.cases import synthetic_case, user_case
from gemma4_harness.harness.parity.checks.fast import batched_vs_solo, chunked_vs_oneshot
from gemma4_harness.harness.parity.checks.pair import pair_checks
from gemma4_harness.harness.parity.checks.reference_runs import ReferenceRuns
from gemma4_harness.harness.parity.job import quick_prompts
from gemma4_harness.harness.parity.result import CaseResult
from gemma4_harness.reference import load_model

SPECS = [p.stem for p in builtin_specs()]
PROMPTS = load_prompts()


@pytest.fixture(scope="module", params=SPECS)
def case(request):
    spec = synth.load_spec(MODELS_DIR / f"{request.param}.toml")
    built = synth.ensure_built(spec.path)
    cfg, w = load_model(built.gguf["F32"])
    return spec, cfg, w, FastModel(cfg, w, "cpu", "float32"), built


def _fast_pair(spec, built, dtype: str) -> list[dict]:
    """The checks of the pair pipeline (what a built-in case and ``--model`` both run) for fast in ``dtype`` on the
    case's F32 GGUF, judged by the case's gates."""
    path = built.gguf["F32"]
    runs = ReferenceRuns(CheckedEngine(ReferenceEngine(path), "reference"))
    res = CaseResult(case=spec.name, kind="synthetic", model=str(path))
    res.apply(pair_checks(runs, "fast", path, PROMPTS, lambda m: None, spec.name,
                          options={"device": "cpu", "dtype": dtype}), resolve(spec.gates, spec.name))
    return res.checks


def test_fast_fp32_matches_reference(case):
    spec, cfg, _, _, built = case
    checks = _fast_pair(spec, built, "float32")
    assert {c["gate"] for c in checks} == {f"reference~fast.{m}" for m in (
        "runs", "max_abs_logit", "mean_kld", "same_top1_decisive", "layer_rel_l2", "greedy", "max_abs_logprob")}
    bad = [(c["gate"], c["prompt"], c["measured"], c.get("first_divergence")) for c in checks if not c["pass"]]
    assert not bad
    layers = [c for c in checks if c["gate"] == "reference~fast.layer_rel_l2"]
    assert len(layers) == len(PROMPTS)
    assert all(len(c["per_point"]) >= 3 * cfg.n_layer for c in layers)


def test_fast_bf16_pair(case, record_property):
    """Gated where the case gates bf16; on the narrow cases a measurement that is reported (the test passes
    and records the figure), with the case's reason for not gating it."""
    spec, _, _, _, built = case
    checks = _fast_pair(spec, built, "bfloat16")
    kld = [c for c in checks if c["gate"] == "reference~fast_bf16.mean_kld"]
    assert len(kld) == len(PROMPTS)
    assert all(0 < c["measured"] < float("inf") for c in kld)  # bf16 really ran in bf16, and nothing overflowed
    record_property("bf16_mean_kld", max(c["measured"] for c in kld))
    for c in checks:
        if c.get("informational"):
            print(f"{spec.name}: {c['gate']} {c['prompt']}: {c['measured']:.3g} (reported, not gated: {c['reason']})")
        else:
            assert c["pass"], (c["gate"], c["prompt"], c["measured"], c["limit"])


def test_bf16_gate_is_enforced_somewhere():
    assert any(not synth.load_spec(p).gates.get("reference~fast_bf16.mean_kld", {}).get("informational")
               for p in builtin_specs())


def test_builtin_case_and_model_measure_fast_alike():
    """One pair pipeline: a built-in case and ``g4h parity --model`` on the same F32 GGUF give the same
    ``reference~fast.*`` figures, bit for bit (the same function, :func:`harness.parity.cases.pairs`)."""
    spec = MODELS_DIR / "e2b.toml"
    prompts = quick_prompts(PROMPTS, 2)
    built = synth.ensure_built(spec)
    builtin = synthetic_case(spec, prompts, lambda m: None, skip=("speculative", "llamacpp"), weights="dequantized")
    model = user_case(str(built.gguf["F32"]), ["fast"], prompts, lambda m: None,
                      engine_options={"device": "cpu", "dtype": "float32"})

    def fast(res):
        return [(c["gate"], c["prompt"], c["measured"]) for c in res.checks if c["gate"].startswith("reference~fast.")]

    assert fast(builtin) and fast(builtin) == fast(model)


@pytest.mark.slow
def test_batched_equals_solo_and_neighbours_are_isolated(case):
    spec, cfg, w, fm, _ = case
    gates = resolve(spec.gates, spec.name)
    r = batched_vs_solo(fm)
    assert r["max_batch_seen"] >= 4 and r["retired_mid_batch"], r
    assert any(q["prompt_len"] > 3 * cfg.sliding_window for q in r["requests"])
    assert gates["fast.batched~solo.same_tokens"].check(r["same_tokens"])
    assert gates["fast.batched~solo.max_abs_logit"].check(r["max_abs_logit"])
    assert gates["fast.neighbour_isolation.max_abs_logit"].check(r["isolation_max_abs"])


@pytest.mark.slow
def test_chunked_prefill_and_prefix_decode_equal_one_shot(case):
    spec, cfg, w, fm, _ = case
    gate = resolve(spec.gates, spec.name)["fast.chunked~oneshot.max_abs_logit"]
    longest = max(PROMPTS, key=lambda p: len(p["prompt_ids"]))["prompt_ids"]
    for variant, v in chunked_vs_oneshot(fm, longest).items():
        assert gate.check(v), (variant, v)


def test_cache_memory_layout(case):
    _, cfg, w, fm, _ = case
    cache = fm.new_cache(max_seqs=2, max_tokens=100)
    slot = cache.alloc()
    ids = list(range(4, 4 + 90))
    with torch.inference_mode():
        for start in range(0, 90, 25):  # chunks larger than the window
            from gemma4_harness.fast.model import SeqStep

            fm.step(cache, [SeqStep(slot, torch.tensor(ids[start:start + 25]), start)])
    alloc = cache.allocated_bytes()
    for layer in cfg.layers:
        store = cache.stores[layer.index]
        if not layer.has_kv:
            assert alloc[layer.index] == 0
            assert store is cache.stores[layer.kv_donor]  # aliases the donor's storage
            continue
        assert alloc[layer.index] > 0
        if layer.is_sliding:
            assert store.v.shape[1] == cfg.sliding_window
            assert store.held(slot) == cfg.sliding_window < 90
        if not layer.has_v_proj:
            assert store.k is None  # k_eq_v: one tensor
        else:
            assert store.k is not None and store.k.shape == store.v.shape


def test_k_eq_v_layers_exist_in_the_cases():
    kinds = set()
    for p in builtin_specs():
        cfg, _ = load_model(synth.ensure_built(p).gguf["F32"])
        kinds |= {"k_eq_v" for l in cfg.layers if l.has_kv and not l.has_v_proj}
        kinds |= {"shared" for l in cfg.layers if not l.has_kv}
    assert kinds == {"k_eq_v", "shared"}


def test_retired_slot_is_reused_and_cache_is_bounded():
    cfg, w = load_model(synth.ensure_built(MODELS_DIR / "e2b.toml").gguf["F32"])
    fm = FastModel(cfg, w, "cpu", "float32")
    eng = Engine(fm, max_batch=2, prefill_chunk=8, max_tokens=64)
    reqs = [Request(str(i), [2, 5, 6, 7 + i], 3, arrival=i) for i in range(5)]
    out = eng.run(reqs)
    assert sorted(out) == [str(i) for i in range(5)] and max(eng.batch_sizes) == 2
    with pytest.raises(Exception, match="max_tokens"):
        Engine(fm, max_tokens=8).run([Request("x", [2] * 7, 5)])


def test_only_the_rows_asked_for_go_through_the_kv_shared_tail(monkeypatch):
    """Without a trace, a step narrows to the rows it returns before the KV-shared tail (``_keep_rows``): two
    sequences, rows asked out of order and twice; the tail layers see only those rows, the logits keep the order
    asked for and equal the all-rows step's within the batched~solo gate (same math, other GEMM shapes)."""
    from gemma4_harness.fast.model import SeqStep

    spec = synth.load_spec(MODELS_DIR / "e2b.toml")
    cfg, w = load_model(synth.ensure_built(spec.path).gguf["F32"])
    tail = [L.index for L in cfg.layers if not L.has_kv]
    assert tail and tail == list(range(tail[0], cfg.n_layer))
    fm = FastModel(cfg, w, "cpu", "float32")
    gate = resolve(spec.gates, spec.name)["fast.batched~solo.max_abs_logit"]
    a, b = list(range(4, 4 + 40)), list(range(50, 50 + 25))

    def run(**kw):
        cache = fm.new_cache(2, 80)
        s0, s1 = cache.alloc(), cache.alloc()
        with torch.inference_mode():
            return fm.step(cache, [SeqStep(s0, torch.tensor(a), 0), SeqStep(s1, torch.tensor(b), 0)], **kw)

    full = run(all_logits=True)
    seen: dict[int, int] = {}
    layer_fn = FastModel.decoder_layer

    def spy(self, layer, x, batch, ple, tr):
        seen[layer.index] = x.shape[0]
        return layer_fn(self, layer, x, batch, ple, tr)

    monkeypatch.setattr(FastModel, "decoder_layer", spy)
    rows = [50, 3, 39, 3]
    part = run(rows=rows)
    assert all(seen[il] == len(a) + len(b) for il in range(tail[0]))
    assert all(seen[il] == 3 for il in tail)  # rows 3, 39, 50
    assert gate.check(float((part - full[rows]).abs().max()))
    last = run()
    assert seen[tail[0]] == 2
    assert gate.check(float((last - full[[len(a) - 1, len(a) + len(b) - 1]]).abs().max()))


def test_prompt_runs_continue_from_each_prompts_own_cache(case):
    """``prompt_runs``: each prompt's logits are its one-shot prefill's; its stream is what the solo engine
    generates, whether the streams decode together or one prompt at a time (the same tokens; log-probs within the
    batched~solo gate: the engine prefills in chunks, and other batch sizes take other paths in some operations);
    the teacher-forced rows are a full forward's over the prompt and those tokens (same gate)."""
    from gemma4_harness.fast.engine import generate, prompt_runs

    spec, cfg, w, fm, _ = case
    gate = resolve(spec.gates, spec.name)["fast.batched~solo.max_abs_logit"].limit
    prompts = [p["prompt_ids"] for p in PROMPTS if len(p["prompt_ids"]) + 5 <= cfg.context_length][:5]
    runs = prompt_runs(fm, prompts, new_tokens=5, top_n=4, max_batch=3)
    alone = prompt_runs(fm, prompts, new_tokens=5, top_n=4, max_batch=1)
    forced = prompt_runs(fm, prompts, forced=[r.stream.tokens[:-1] for r in runs])
    for ids, run, one, f in zip(prompts, runs, alone, forced):
        assert torch.equal(run.logits, fm.logits(ids)) and torch.equal(f.logits, run.logits)
        solo = generate(fm, [ids], 5, batched=False, top_n=4)[0]
        assert run.stream.tokens[0] == int(torch.argmax(run.logits[-1]))
        for other in (one.stream, solo):
            assert run.stream.tokens == other.tokens
            for mine, theirs in zip(run.stream.top, other.top):
                assert max(abs(a - dict(theirs).get(i, float("inf"))) for i, a in mine) <= gate
        full = fm.logits(list(ids) + run.stream.tokens[:-1])[len(ids):]
        assert f.stream is None and f.forced.shape == full.shape
        assert float(torch.max(torch.abs(f.forced - full))) <= gate
    with pytest.raises(ValueError, match="not both"):
        prompt_runs(fm, [[2, 3]], new_tokens=2, forced=[[4]])
    with pytest.raises(ValueError, match="one entry per prompt"):
        prompt_runs(fm, [[2, 3]], forced=[[4], [5]])


@pytest.mark.parametrize("fmt", ("Q8_0", "Q4_0"))
def test_moe_expert_stacks_stay_packed_on_the_cpu(fmt):
    """With packed weights on the CPU a MoE layer's expert stacks stay the file's bytes (each expert a view through
    the packed kernels), the memory plan counts them as packed, and the logits and streams are the dequantized
    engine's within fp32 rounding (the batched~solo bound: the same products, other accumulation orders)."""
    from gemma4_harness.fast.quants import QuantizedTensor
    from gemma4_harness.harness.core import memory, memory_rules
    from gemma4_harness.harness.engines.fast import FastEngine

    spec = synth.load_spec(MODELS_DIR / "26b-a4b.toml")
    path = synth.ensure_built(spec.path).gguf[fmt]
    gate = resolve(spec.gates, spec.name)["fast.batched~solo.max_abs_logit"].limit
    packed, dense = FastEngine(path, weights="packed"), FastEngine(path, weights="dequantized")
    stacks = [n for n in packed.model.w.t if n.endswith("_exps.weight")]
    assert stacks and all(isinstance(packed.model.w[n], QuantizedTensor) for n in stacks)
    assert not any(isinstance(dense.model.w[n], QuantizedTensor) for n in stacks)
    info = memory.model_info(path)
    on_cpu = memory.plan("fast", info, weights="packed", device="cpu").breakdown
    on_gpu = memory_rules._fast_terms(info, 16, 16, "float32", "packed", 1, device="cuda")[0]  # no GPU needed to plan
    experts = sum(t.nbytes for n, t in info.tensors.items() if n.endswith("_exps.weight"))
    assert on_cpu["packed weights"] - on_gpu["packed weights"] == experts > 0
    for p in PROMPTS[:4]:
        a, b = packed.logits(p["prompt_ids"]), dense.logits(p["prompt_ids"])
        assert float(abs(a - b).max()) <= gate, p["id"]
    ids = [p["prompt_ids"] for p in PROMPTS[:3]]
    assert packed.generate(ids, 4) == dense.generate(ids, 4)
