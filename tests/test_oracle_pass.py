"""The parity job's reference side in as few passes as the checks allow (``ReferenceRuns.prefetch``,
:mod:`harness.parity.checks.oracle_pass`) gives what the one-by-one path gives, bit for bit: every prompt's
logits and trace under each approximation set, the greedy streams with their log-probs, and the cached-vs-uncached
logits; and a user-model parity run reads them (its figures equal the lazy path's)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gemma4_harness.harness import synth
from gemma4_harness.harness.core.cases import PROMPTS, builtin_specs
from gemma4_harness.harness.engines.reference import ReferenceEngine
from gemma4_harness.harness.parity.checks import pair
from gemma4_harness.harness.parity.checks.oracle_pass import reference_pass
from gemma4_harness.harness.parity.checks.pair import expected_sets
from gemma4_harness.harness.parity.checks.reference_runs import ReferenceRuns
from gemma4_harness.harness.parity.checks.reference import cached_vs_uncached

GELU = ("gelu_fp16_table",)


def _prompts(n: int | None = None) -> list[dict]:
    """Prompts of 1, 5 and 17 tokens (one past the synthetic cases' window), then the rest of the set."""
    lines = [json.loads(ln) for ln in Path(PROMPTS).read_text().splitlines() if ln.strip()]
    lines.sort(key=lambda p: len(p["prompt_ids"]) not in (1, 5, 17))
    return lines[:n] if n else lines


def _ref(case: str = "e2b") -> ReferenceEngine:
    built = synth.ensure_built(next(p for p in builtin_specs() if p.stem == case))
    return ReferenceEngine(built.gguf["Q8_0"], cache_gb=0)


@pytest.mark.parametrize("case", ("e2b", "26b-a4b"))
def test_prefetch_equals_the_lazy_path(case):
    ref = _ref(case)
    prompts = _prompts(3)
    lazy, ahead = ReferenceRuns(ref), ReferenceRuns(ref)
    ahead.prefetch([GELU], prompts, new_tokens=4, top_n=3, cached=True)
    assert ahead.passes == 4  # pass 1, then one per greedy step but the last
    for approx in ((), GELU):
        for p in prompts:
            (za, ta), (zb, tb) = lazy.logits(approx, p), ahead.logits(approx, p)
            assert np.array_equal(za, zb), (approx, p["id"])
            assert [r["checksums"] for r in ta.records] == [r["checksums"] for r in tb.records]
            assert all(np.array_equal(ta.tensors[k], tb.tensors[k]) for k in ta.tensors)
    gen = [p for p in prompts if len(p["prompt_ids"]) + 4 <= ref.cfg.context_length]
    for approx in ((), GELU):
        assert lazy.generations(approx, gen, 4, 3) == ahead.generations(approx, gen, 4, 3)
    for p in prompts:
        got = ahead.cached_logits(p)
        if len(p["prompt_ids"]) < 2:
            assert got is None
            continue
        k, z = got
        assert np.array_equal(z, ref.logits_cached(p["prompt_ids"], prefill=k))
        assert cached_vs_uncached(ref, p, lazy.logits((), p)[0], got) == \
            cached_vs_uncached(ref, p, lazy.logits((), p)[0])


def test_prefetch_under_the_server_dialects_emulations_equals_the_lazy_path():
    """The emulations of llama-server's and llama-cpp-python's defaults (f16 KV cache, flash attention or fp16
    operands: :data:`harness.engines.numerics.DIALECT_NUMERICS`) swap the reference's attention; the many-forwards
    path calls it through the module too, so the figures are the lazy path's."""
    from gemma4_harness.harness.engines.numerics import DIALECT_NUMERICS

    ref = _ref()
    prompts = _prompts(2)
    sets = [DIALECT_NUMERICS[d].emulation() for d in ("llama-server", "llama-cpp-python")]
    lazy, ahead = ReferenceRuns(ref), ReferenceRuns(ref)
    ahead.prefetch(sets, prompts, new_tokens=2, top_n=3)
    for approx in sets:
        for p in prompts:
            assert np.array_equal(lazy.logits(approx, p)[0], ahead.logits(approx, p)[0]), (approx, p["id"])
        assert not np.array_equal(lazy.logits(approx, prompts[-1])[0], lazy.logits((), prompts[-1])[0])
        assert lazy.generations(approx, prompts, 2, 3) == ahead.generations(approx, prompts, 2, 3)


@pytest.mark.parametrize("variant", ("window_inclusive", "experts_swiglu", "layer_scalar_branch", "norm_plus_one"))
def test_prefetch_under_a_spec_variant_equals_the_lazy_path(variant):
    """Under ``--spec`` the reference's functions are replaced; where the many-forwards path does one's work itself
    (:data:`reference.batch.REWRITTEN`) it steps aside, elsewhere it calls the replacement: the lazy path's bits."""
    from gemma4_harness.harness.engines.variants import VARIANTS, under

    ref = _ref("26b-a4b")
    prompts = _prompts(3)
    with under([VARIANTS[variant]], fast=False):
        lazy, ahead = ReferenceRuns(ref), ReferenceRuns(ref)
        ahead.prefetch([()], prompts, new_tokens=2, top_n=3)
        for p in prompts:
            assert np.array_equal(lazy.logits((), p)[0], ahead.logits((), p)[0]), p["id"]
        assert lazy.generations((), prompts, 2, 3) == ahead.generations((), prompts, 2, 3)
    plain = ReferenceRuns(ref).logits((), prompts[-1])[0]
    with under([VARIANTS[variant]], fast=False):
        assert not np.array_equal(plain, ReferenceRuns(ref).logits((), prompts[-1])[0])  # the variant moves it


def test_what_was_not_prefetched_is_computed_when_asked():
    ref = _ref()
    prompts = _prompts(3)
    runs = ReferenceRuns(ref)
    runs.prefetch([], prompts, new_tokens=2, top_n=2)
    assert runs.cached_logits(prompts[-1]) is None
    z, _ = runs.logits(GELU, prompts[1])  # not prefetched: one forward under the emulation
    assert np.array_equal(z, ReferenceRuns(ref).logits(GELU, prompts[1])[0])
    other = runs.generations(GELU, prompts, 3, 2)
    assert other == ReferenceRuns(ref).generations(GELU, prompts, 3, 2)


def test_one_token_streams_need_one_pass_and_no_step():
    ref = _ref()
    res = reference_pass(ref, [()], _prompts(2), [()], _prompts(2), 1, 5, False, ReferenceRuns(ref).numerics)
    assert res.passes == 1 and all(len(g.tokens) == 1 for g in res.generations[()])
    with pytest.raises(ValueError):
        reference_pass(ref, [()], _prompts(1), [GELU], _prompts(1), 2, 5, False, ReferenceRuns(ref).numerics)


def test_expected_sets_follow_the_engine_kinds():
    assert expected_sets(["llamacpp", "fast"]) == [(), (*GELU, "quantized_activations")]
    assert expected_sets(["llamacpp"], skip=("llamacpp",)) == []
    assert expected_sets(["cmd:./x", "transformers"]) == [()]


def test_an_oracle_without_prompt_runs_prefetches_nothing():
    ref = _ref()

    class Oracle:
        engine = "other"

    runs = ReferenceRuns(ref, Oracle())
    runs.prefetch([GELU], _prompts(2), 2)
    assert runs.passes == 0 and not runs._logits


@pytest.mark.parametrize("case", ("e2b", "26b-a4b"))
def test_fast_oracle_prefetch_runs_each_prompt_once_per_set(case, monkeypatch):
    """``--oracle fast``: the prefetch runs each prompt once per set (a traced prefill, then from its cache the
    emulated set's stream, or the exact set's teacher-forced tokens along that stream; the streams decode
    together); it gives the lazy path's
    logits and traces bit for bit, the lazy path's streams (their log-probs within the batched~solo gate: the lazy
    one prefills in chunks), and the log-prob effect of full forwards over prompt and stream (same gate, x2)."""
    from gemma4_harness.harness.core.gates import resolve
    from gemma4_harness.harness.engines.fast import FastEngine

    spec = next(p for p in builtin_specs() if p.stem == case)
    oracle = FastEngine(synth.ensure_built(spec).gguf["Q8_0"], dtype="float32")
    gate = resolve(synth.load_spec(spec).gates, case)["fast.batched~solo.max_abs_logit"].limit
    ref, prompts = _ref(case), _prompts(4)
    gen = [p for p in prompts if len(p["prompt_ids"]) + 4 <= ref.cfg.context_length]
    lazy, ahead = ReferenceRuns(ref, oracle), ReferenceRuns(ref, oracle)
    want = {a: lazy.generations(a, gen, 4, 3) for a in ((), GELU)}
    traced = {(a, str(p["id"])): lazy.logits(a, p) for a in ((), GELU) for p in prompts}
    effect = 0.0
    for p in gen:
        g = want[GELU][str(p["id"])]
        z = oracle.logits(list(p["prompt_ids"]) + g["tokens"][:-1])[len(p["prompt_ids"]) - 1:]
        lp = z - np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1, keepdims=True)) - z.max(-1, keepdims=True)
        effect = max([effect] + [abs(v - lp[i, t]) for i, d in enumerate(g["logprobs"]) for t, v in d.items()])
    runs = []
    real = FastEngine.prompt_runs
    monkeypatch.setattr(FastEngine, "prompt_runs",
                        lambda self, ps, **k: runs.extend(map(len, ps)) or real(self, ps, **k))
    monkeypatch.setattr(FastEngine, "logits", lambda *a, **k: pytest.fail("a forward outside the prefetch"))
    monkeypatch.setattr(FastEngine, "generate_full", lambda *a, **k: pytest.fail("a generate outside the prefetch"))
    ahead.prefetch([GELU], prompts, new_tokens=4, top_n=3)
    assert len(runs) == 2 * len(prompts)
    got, where = ahead.logprob_effect(GELU, gen, 4, 3)
    assert len(runs) == 2 * len(prompts) and where is not None  # the effect read the forced rows of the prefetch
    assert 0 < got and abs(got - effect) <= 2 * gate
    for approx in ((), GELU):
        for p in prompts:
            (za, ta), (zb, tb) = traced[(approx, str(p["id"]))], ahead.logits(approx, p)
            assert np.array_equal(za, zb), (approx, p["id"])
            assert [r["checksums"] for r in ta.records] == [r["checksums"] for r in tb.records]
    mine = ahead.generations(GELU, gen, 4, 3)
    assert mine.keys() == want[GELU].keys()
    for pid, s in want[GELU].items():
        assert mine[pid]["tokens"] == s["tokens"], pid
        assert max(abs(mine[pid]["logprobs"][i][t] - v) for i, d in enumerate(s["logprobs"]) for t, v in d.items()) \
            <= gate


def test_user_parity_reads_the_prefetched_outputs(monkeypatch, tmp_path):
    """The pairs ask for nothing the prefetch did not compute: no reference forward runs after it."""
    from gemma4_harness.harness.parity import run as run_parity

    built = synth.ensure_built(next(p for p in builtin_specs() if p.stem == "e2b"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in _prompts(2)))
    calls = []
    real = ReferenceEngine.logits

    def counted(self, ids, trace=None):
        calls.append(len(ids))
        return real(self, ids, trace)

    monkeypatch.setattr(ReferenceEngine, "logits", counted)
    monkeypatch.setattr(ReferenceEngine, "logits_cached", lambda *a, **k: pytest.fail("not prefetched"))
    monkeypatch.setattr(ReferenceEngine, "generate_full", lambda *a, **k: pytest.fail("not prefetched"))
    data, status = run_parity(models=[str(built.gguf["Q8_0"])], against=["fast"], out=str(tmp_path), quiet=True,
                              prompts=prompts)
    assert status == 0 and calls == []
    assert data["cases"][0]["info"]["reference_passes"] == pair.GREEDY_NEW_TOKENS


def test_many_raw_forwards_equal_one_by_one():
    ref = _ref()
    runs = ReferenceRuns(ref)
    seqs = [p["prompt_ids"] for p in _prompts(3)]
    for approx in ((), GELU):
        many = runs.raw_logits_many(approx, seqs)
        assert all(np.array_equal(z, runs.raw_logits(approx, s)) for z, s in zip(many, seqs)), approx
    assert runs.passes == 2


def test_an_engine_declaring_its_own_emulations_gets_them_in_passes(monkeypatch, tmp_path):
    """A ``cmd:`` engine whose hello declares llama.cpp's GELU table and an f16 KV cache (a set no engine kind
    foretells): its pair asks the reference for logits, streams and the effect forwards under that set, all in
    passes over the weights (no one-by-one forward, no reference generate), and the run passes."""
    import shlex
    import sys

    from gemma4_harness.harness.parity import run as run_parity

    built = synth.ensure_built(next(p for p in builtin_specs() if p.stem == "e2b"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in _prompts(3)))
    stub = Path(__file__).resolve().parent / "cmd_stub.py"
    engine = "cmd:" + shlex.join([sys.executable, str(stub), "--approx", "gelu_fp16_table", "--kv-cache", "float16"])
    monkeypatch.setattr(ReferenceEngine, "logits", lambda *a, **k: pytest.fail("a forward outside the passes"))
    monkeypatch.setattr(ReferenceEngine, "generate_full", lambda *a, **k: pytest.fail("not in the passes"))
    data, status = run_parity(models=[str(built.gguf["Q8_0"])], against=[engine], out=str(tmp_path), quiet=True,
                              prompts=prompts)
    checks = {c["gate"]: c for c in data["cases"][0]["checks"]}
    assert checks["reference~cmd.runs"]["numerics"]["emulated"] == ["gelu_fp16_table", "kv_cache=float16"]
    assert status == 0, [c for c in data["cases"][0]["checks"] if not c["pass"]]
    # the job's pass set (exact: a cmd engine foretells nothing), then the pair's: its set and the exact effect
    assert data["cases"][0]["info"]["reference_passes"] == 2 * pair.GREEDY_NEW_TOKENS + 1


def _same_weights(path):
    from gemma4_harness.reference.weights import load_model

    ref = ReferenceEngine(path, cache_gb=0)  # matrices through the packed C kernels
    _, plain = load_model(path, cache_bytes=0)  # gguf.quants
    seen = set()
    for name in plain:
        if len(plain.shape(name)) == 3:  # a MoE layer's expert stack: read whole, its rows through the kernels too
            assert np.array_equal(ref.weights[name], plain[name]), f"{path} {name}"
            seen.add(f"{plain.raw_dtype(name)} stack")
        if len(plain.shape(name)) != 2:
            continue
        seen.add(plain.raw_dtype(name))
        for a, b in zip(ref.weights.row_blocks(name), plain.row_blocks(name)):
            assert np.array_equal(a, b), f"{path} {name}"
        ids = np.array([0, plain.shape(name)[0] - 1, 1, 0])
        assert np.array_equal(ref.weights.rows(name, ids), plain.rows(name, ids)), f"{path} {name} rows"
    return seen


def test_the_reference_engine_reads_gguf_quants_values():
    """The engine dequantizes with the packed kernels (faster, every thread): the values gguf.quants gives."""
    seen = set()
    for case in ("e2b", "26b-a4b"):
        built = synth.ensure_built(next(p for p in builtin_specs() if p.stem == case))
        for q in ("Q8_0", "Q4_0"):
            seen |= _same_weights(built.gguf[q])
    assert {"Q8_0", "Q4_0", "Q8_0 stack", "Q4_0 stack"} <= seen


@pytest.mark.slow
def test_the_reference_engine_reads_gguf_quants_values_of_the_real_k_quants():
    from gemma4_harness.harness.core.realdata import gemma3_270m_gguf

    assert {"Q8_0", "Q5_0", "Q4_K", "Q6_K"} <= _same_weights(gemma3_270m_gguf())
