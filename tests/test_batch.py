"""``reference.batch.forward_chains``: many forwards over one read of the weights give what
``reference.model.forward`` gives one call at a time, bit for bit.

The old path is the oracle: each prompt's ``forward`` with a trace, the same prompt prefilled in half and then
continued one token at a time, greedy steps continuing a prefill's cache. The new path runs all of them
layer-outer in one call (prompts of every length in the set, a one-token prompt among them, under llama.cpp's GELU
emulation for some chains and not for others) and must give equal arrays (``np.array_equal``), equal traces
and caches that continue alike. Why it can: no call's rows are stacked with another's (see the module); these
tests are what holds it to that on every model family (PLE and KV sharing, MoE, k_eq_v, no softcap).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gemma4_harness.harness import synth
from gemma4_harness.harness.core.cases import PROMPTS, builtin_specs
from gemma4_harness.harness.engines.llamacpp.numerics import llamacpp_numerics
from gemma4_harness.harness.traces.format import TraceWriter
from gemma4_harness.reference import batch as B
from gemma4_harness.reference import model as M
from gemma4_harness.reference.batch import Chain, forward_chains, linear_rows, lm_head_many, row_bounds, rows_split_exact
from gemma4_harness.reference.errors import PromptError
from gemma4_harness.reference.weights import load_model

CASES = ("e2b", "26b-a4b", "edge-keqv-shared-donor", "edge-no-softcap")


def _prompts() -> list[list[int]]:
    return [json.loads(line)["prompt_ids"] for line in Path(PROMPTS).read_text().splitlines() if line.strip()]


def _spec(name: str) -> Path:
    return next(p for p in builtin_specs() if p.stem == name)


def _model(name: str, qtype: str = "Q8_0", cache_bytes: int = 0):
    built = synth.ensure_built(_spec(name))
    return load_model(built.gguf[qtype] if qtype in built.gguf else built.gguf["F32"], cache_bytes=cache_bytes)


def _traces_equal(a: TraceWriter, b: TraceWriter) -> bool:
    ta, tb = a.trace(), b.trace()
    keys = [(r["point"], r["layer"]) for r in ta.records]
    return (keys == [(r["point"], r["layer"]) for r in tb.records]
            and [r["checksums"] for r in ta.records] == [r["checksums"] for r in tb.records]
            and ta.tensors.keys() == tb.tensors.keys()
            and all(np.array_equal(ta.tensors[k], tb.tensors[k]) for k in ta.tensors))


@pytest.fixture(params=["1MB", "64-row"])
def row_blocks(request, monkeypatch):
    """One-token products in the default row blocks, and in blocks of 64 rows (so that the tiny synthetic models'
    matrices are split too: their widest have 256 rows)."""
    if request.param == "64-row":
        monkeypatch.setattr(B, "ROW_BLOCK_BYTES", 0)
    monkeypatch.setattr(B, "_split_exact", {})
    return request.param


@pytest.mark.parametrize("case", CASES)
def test_chains_equal_forward_call_by_call(case, row_blocks):
    cfg, W = _model(case)
    prompts = [p for p in _prompts() if len(p) + 3 <= cfg.context_length]
    old, new = {}, []
    # 1. every prompt with a trace, exact and under the GELU table; 2. half then one token at a time
    for emulate in (False, True):
        ctx = llamacpp_numerics if emulate else None
        for i, ids in enumerate(prompts):
            w = TraceWriter("reference", ids, keep_tensors=True)
            if ctx:
                with ctx():
                    old[("full", emulate, i)] = [M.forward(cfg, W, ids, trace=w)]
            else:
                old[("full", emulate, i)] = [M.forward(cfg, W, ids, trace=w)]
            old[("trace", emulate, i)] = w
            wn = TraceWriter("reference", ids, keep_tensors=True)
            new.append((("full", emulate, i), Chain([ids], traces=[wn], numerics=ctx or Chain.numerics)))
            old[("trace-new", emulate, i)] = wn
    for i, ids in enumerate(prompts):
        if len(ids) < 2:
            continue
        half = max(1, len(ids) // 2)
        cache = M.KVCache(cfg)
        old[("steps", False, i)] = [M.forward(cfg, W, ids[:half], cache)] + \
            [M.forward(cfg, W, [t], cache) for t in ids[half:]]
        new.append((("steps", False, i), Chain([ids[:half]] + [[t] for t in ids[half:]])))
    got = forward_chains(cfg, W, [c for _, c in new])
    for (key, _), logits in zip(new, got):
        ref = old[key]
        assert len(ref) == len(logits)
        for a, b in zip(ref, logits):
            assert np.array_equal(a, b), f"{case} {key}: max |diff| {np.max(np.abs(a - b)):.3g}"
    for emulate in (False, True):
        for i, _ in enumerate(prompts):
            assert _traces_equal(old[("trace", emulate, i)], old[("trace-new", emulate, i)]), (case, emulate, i)
    if row_blocks == "64-row":
        assert any(B._split_exact.values())  # some one-token products really went a block of rows at a time


@pytest.mark.parametrize("case", ("e2b", "26b-a4b"))
def test_greedy_steps_continue_a_shared_prefill(case, row_blocks):
    """Greedy streams: the prefill of chains, then one-token chains on the same caches, equal
    ``forward`` prefill-then-steps; a call whose head is not wanted still fills the cache."""
    cfg, W = _model(case, cache_bytes=10**12)
    prompts = [p for p in _prompts() if len(p) + 4 <= cfg.context_length][:5]
    with llamacpp_numerics():
        ref = []
        for ids in prompts:
            cache = M.KVCache(cfg)
            z = M.forward(cfg, W, ids, cache)[-1]
            toks = []
            for _ in range(3):
                toks.append(int(np.argmax(z)))
                z = M.forward(cfg, W, [toks[-1]], cache)[-1]
            ref.append((toks, z))
    chains = [Chain([ids], numerics=llamacpp_numerics) for ids in prompts]
    last = [z[0][-1] for z in forward_chains(cfg, W, chains)]
    toks = [[] for _ in prompts]
    for _ in range(3):
        for t, z in zip(toks, last):
            t.append(int(np.argmax(z)))
        steps = [Chain([[t[-1]]], cache=c.cache, numerics=llamacpp_numerics) for t, c in zip(toks, chains)]
        last = [z[0][-1] for z in forward_chains(cfg, W, steps)]
    for (rt, rz), t, z in zip(ref, toks, last):
        assert rt == t and np.array_equal(rz, z)
    skipped = [Chain([prompts[0]], heads=[False])]
    assert forward_chains(cfg, W, skipped) == [[None]] and skipped[0].cache.n_past == len(prompts[0])


@pytest.mark.parametrize("case", CASES)
def test_reseeded_chains_equal_reseeded_forwards_null_draws_too(case):
    """Re-seeded forwards (``layer_inputs``: another stream into every layer and the final norm) under llama.cpp's
    quantized activations, and their ``jitter_sums`` null (every product's output moved by a random stream), all
    prompts in one call of ``forward_chains``: each chain's logits and trace equal ``forward(..., layer_inputs=...)``
    inside one entry of the same emulations, bit for bit, the null's too, when each null chain draws from one
    ``Generator`` of seed 0 kept across its entries (what ``ReferenceRuns.reseeded_many`` does). A stream started
    afresh at each entry draws other numbers (the check can fail). A seed of the wrong shape stops the call before
    any layer runs."""
    from gemma4_harness.harness.engines.numerics import emulate

    cfg, W = _model(case)
    prompts = [p for p in _prompts() if len(p) <= cfg.context_length][:4]
    approx = ("quantized_activations",)
    rng = np.random.default_rng(3)
    seeds = []
    for ids in prompts:  # the plain stream, moved off in its last bits: another engine's, with its own roundings
        w = TraceWriter("reference", ids, keep_tensors=True)
        M.forward(cfg, W, ids, trace=w)
        t = w.trace()
        s = {0: t.tensor("inp_scaled", -1), **{il + 1: t.tensor("l_out", il) for il in range(cfg.n_layer)}}
        seeds.append({k: v * (1 + 1e-6 * rng.standard_normal(v.shape)) for k, v in s.items()})
    old, chains, writers = [], [], []
    for ids, s in zip(prompts, seeds):
        for a in (approx, (*approx, "jitter_sums")):
            w = TraceWriter("reference", ids, keep_tensors=True)
            with emulate(a):
                old.append((M.forward(cfg, W, ids, trace=w, layer_inputs=s), w))
            wn = TraceWriter("reference", ids, keep_tensors=True)
            g = np.random.default_rng(0)
            chains.append(Chain([ids], traces=[wn], layer_inputs=[s],
                                numerics=lambda a=a, g=g: emulate(a, jitter_rng=g)))
            writers.append(wn)
    got = forward_chains(cfg, W, chains)
    for k, ((z, w), [zn], wn) in enumerate(zip(old, got, writers)):
        assert np.array_equal(z, zn), (case, k, float(np.max(np.abs(z - zn))))
        assert _traces_equal(w, wn), (case, k)
    assert not np.array_equal(old[0][0], old[1][0])  # the null moved the logits
    fresh = forward_chains(cfg, W, [Chain([prompts[0]], layer_inputs=[seeds[0]],
                                          numerics=lambda: emulate((*approx, "jitter_sums")))])
    assert not np.array_equal(fresh[0][0], old[1][0])
    bad = {**seeds[0], 2: seeds[0][2][:-1]}
    with pytest.raises(ValueError, match=r"layer_inputs\[2\]"):
        forward_chains(cfg, W, [Chain([prompts[0]]), Chain([prompts[0]], layer_inputs=[bad])])


def test_weights_hold_reads_each_tensor_once():
    cfg, W = _model("e2b")
    reads = []
    original = W._lazy["blk.0.ffn_up.weight"]
    W._lazy["blk.0.ffn_up.weight"] = type(original)(**{**original.__dict__,
                                                       "read_rows": lambda i, f=original.read_rows: reads.append(1)
                                                       or f(i)})
    prompts = _prompts()[:4]
    forward_chains(cfg, W, [Chain([p]) for p in prompts])
    n_once = len(reads)
    reads.clear()
    for p in prompts:
        M.forward(cfg, W, p)
    assert n_once > 0 and len(reads) == len(prompts) * n_once


def test_bad_call_stops_before_any_layer():
    cfg, W = _model("e2b")
    with pytest.raises(PromptError):
        forward_chains(cfg, W, [Chain([[2, 3]]), Chain([[2, cfg.vocab_size]])])
    with pytest.raises(ValueError):
        forward_chains(cfg, W, [Chain([[2, 3]], heads=[True, False])])


def test_lm_head_many_is_lm_head():
    cfg, W = _model("e2b")
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((t, cfg.hidden_size)) for t in (1, 2, 7)]
    for x, z in zip(xs, lm_head_many(cfg, W, xs)):
        assert np.array_equal(z, M.lm_head(cfg, W, x))


@pytest.mark.parametrize("n, k", [(2048, 1536), (6144, 1536), (1536, 12288), (8960, 1536), (389, 100), (1025, 48),
                                  (2049, 2816)])
def test_linear_rows_is_linear_bit_for_bit(n, k):
    """Whatever the shape (a remainder of one row, a row count the BLAS threads split unevenly), the one-token
    products equal the one-call product; on the real models' shapes (multiples of 64 rows) they are made a block of
    rows at a time on this machine, which is what the speed rests on."""
    rng = np.random.default_rng(n)
    w = rng.standard_normal((n, k))
    xs = [rng.standard_normal((1, k)) for _ in range(3)]
    for x, y in zip(xs, linear_rows(xs, w)):
        assert np.array_equal(y, M.linear(x, w))
    if n % 64 == 0:
        assert len(row_bounds(n, k)) > 1 and rows_split_exact(w)
    assert all(b - a >= min(n, B.ROW_ALIGN) for a, b in row_bounds(n, k))  # never a one-row remainder
