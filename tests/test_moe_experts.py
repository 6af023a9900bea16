"""The reference's MoE layers read only the experts their tokens chose (:meth:`reference.weights.Weights.experts`,
:func:`reference.model.expert_weights`) and compute, bit for bit, what they computed from the whole stacks.

The old path is the oracle: the same weights behind a mapping without ``experts`` (:class:`WholeStacks`), so that
:func:`reference.model.moe_block` reads each stack whole (``W[name]``) as it did. Compared with ``np.array_equal``
on the built-in MoE case and on variants of it with other expert counts, top-k, widths and seeds; on F32, Q8_0
and Q4_0 files; exact and under llama.cpp's quantized activations (which read the stored type each expert
carries); one forward at a time, and layer-outer (:func:`reference.batch.forward_chains`, experts held per
layer). The routing the prompts take is recorded, so that the test states that tokens of one call chose
overlapping experts and disjoint ones.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest

from gemma4_harness.harness import synth
from gemma4_harness.harness.core.cases import PROMPTS, builtin_specs
from gemma4_harness.harness.engines.llamacpp.numerics import quantized_activations_numerics
from gemma4_harness.harness.traces.format import TraceWriter
from gemma4_harness.reference import model as M
from gemma4_harness.reference.batch import Chain, forward_chains
from gemma4_harness.reference.weights import GGMLArray, load_model

CASE = next(p for p in builtin_specs() if p.stem == "26b-a4b")
# (seed, experts, experts per token, expert width): the built-in case, then two others
VARIANTS = [None, (11, 16, 4, 64), (12, 32, 8, 96)]
QTYPES = ("F32", "Q8_0", "Q4_0")
STACKS = ("ffn_gate_up_exps.weight", "ffn_down_exps.weight")


class WholeStacks:
    """The weights as the reference read them before: every expert stack whole (``W[name]``); no ``experts``."""

    def __init__(self, W):
        self.W = W

    def __getitem__(self, name):
        return self.W[name]

    def __contains__(self, name):
        return name in self.W

    def rows(self, name, ids):
        return self.W.rows(name, ids)

    def row_blocks(self, name):
        return self.W.row_blocks(name)


def _spec(variant, tmp_dir: Path) -> Path:
    if variant is None:
        return CASE
    seed, experts, k, width = variant
    text = CASE.read_text()
    for key, value in (("seed", seed), ("num_experts", experts), ("top_k_experts", k),
                       ("moe_intermediate_size", width)):
        head, sep, rest = text.partition(f"\n{key} = ")
        assert sep, key
        text = head + sep + str(value) + "\n" + rest.split("\n", 1)[1]
    path = tmp_dir / f"moe-{seed}-{experts}-{k}-{width}.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module", params=VARIANTS, ids=lambda v: "builtin" if v is None else "-".join(map(str, v)))
def built(request, tmp_path_factory):
    return synth.ensure_built(_spec(request.param, tmp_path_factory.mktemp("spec")))


def _prompts(cfg) -> list[list[int]]:
    prompts = [json.loads(line)["prompt_ids"] for line in Path(PROMPTS).read_text().splitlines() if line.strip()]
    return [p for p in prompts if len(p) <= 40] + [[7] * 6]  # a repeated token: its copies route alike


@pytest.mark.parametrize("qtype", QTYPES)
def test_experts_read_alone_are_the_stacks_experts(built, qtype):
    cfg, W = load_model(built.gguf[qtype], cache_bytes=0)
    rng = np.random.default_rng(3)
    for layer in cfg.layers:
        for stack in STACKS:
            name = f"blk.{layer.index}.{stack}"
            whole = W[name]
            lazy = W._lazy[name]
            reads = []
            read_rows, lazy.read_rows = lazy.read_rows, lambda index, f=lazy.read_rows: reads.append(index) or f(index)
            read, lazy.read = lazy.read, None  # a read of the whole stack would fail
            try:
                chosen = rng.integers(0, cfg.n_expert, size=2 * cfg.n_expert_used)
                got = W.experts(name, chosen)
            finally:
                lazy.read_rows, lazy.read = read_rows, read
            assert sorted(got) == sorted(set(chosen.tolist()))
            assert len(reads) == len(got), "each chosen expert read once, no other"
            for e, arr in got.items():
                assert np.array_equal(arr, whole[e]), (name, e)
                assert isinstance(arr, GGMLArray) and arr.ggml_type == W.raw_dtype(name)


def _route_patterns(E: int, K: int, rng) -> dict[str, np.ndarray]:
    T = E // K
    return {
        "overlapping": np.stack([rng.permutation(np.arange(K)) for _ in range(T)]),  # the same K, in other orders
        "disjoint": rng.permutation(E)[:T * K].reshape(T, K),
        "random": np.stack([rng.choice(E, size=K, replace=False) for _ in range(T + 3)]),
    }


@pytest.mark.parametrize("qtype", QTYPES)
def test_moe_experts_equal_on_whole_stacks(built, qtype):
    cfg, W = load_model(built.gguf[qtype], cache_bytes=0)
    rng = np.random.default_rng(int(cfg.n_expert))
    b = "blk.0."
    gu, dn = (W[b + s] for s in STACKS)
    for pattern, idx in _route_patterns(cfg.n_expert, cfg.n_expert_used, rng).items():
        x = rng.normal(0.0, 1.0, (idx.shape[0], cfg.hidden_size))
        wgt = rng.uniform(0.1, 1.0, idx.shape)
        for emulate in (False, True):
            with quantized_activations_numerics() if emulate else contextlib.nullcontext():
                old = M.moe_experts(x, gu, dn, idx, wgt)
                new = M.moe_experts(x, M.expert_weights(W, b + STACKS[0], idx),
                                    M.expert_weights(W, b + STACKS[1], idx), idx, wgt)
            assert np.array_equal(old, new), (qtype, pattern, emulate, float(np.abs(old - new).max()))


def _record_routes(monkeypatch) -> list[np.ndarray]:
    routes = []
    route = M.moe_route

    def recording(*args, **kwargs):
        idx, wgt = route(*args, **kwargs)
        routes.append(idx)
        return idx, wgt

    monkeypatch.setattr(M, "moe_route", recording)
    return routes


def _has_overlap_and_disjoint(routes: list[np.ndarray]) -> tuple[bool, bool]:
    pairs = [(set(a.tolist()), set(b.tolist())) for idx in routes for i, a in enumerate(idx) for b in idx[i + 1:]]
    return any(a & b for a, b in pairs), any(not a & b for a, b in pairs)


@pytest.mark.parametrize("qtype", ("Q8_0", "Q4_0"))
def test_forward_equals_whole_stacks(built, qtype, monkeypatch):
    cfg, W = load_model(built.gguf[qtype], cache_bytes=0)
    routes = _record_routes(monkeypatch)
    prompts = _prompts(cfg)
    for emulate in (False, True):
        for ids in prompts:
            with quantized_activations_numerics() if emulate else contextlib.nullcontext():
                ta, tb = TraceWriter("old", ids, keep_tensors=True), TraceWriter("new", ids, keep_tensors=True)
                old = M.forward(cfg, WholeStacks(W), ids, trace=ta)
                new = M.forward(cfg, W, ids, trace=tb)
            assert np.array_equal(old, new), (qtype, emulate, len(ids))
            a, b = ta.trace(), tb.trace()
            assert a.tensors.keys() == b.tensors.keys()
            assert all(np.array_equal(a.tensors[k], b.tensors[k]) for k in a.tensors), (qtype, emulate, len(ids))
    overlap, disjoint = _has_overlap_and_disjoint(routes)
    assert overlap and disjoint, "the prompts route tokens of one call to shared experts and to disjoint ones"


def test_layer_outer_pass_equals_whole_stacks(built):
    """forward_chains holds each layer's chosen experts for all its calls: the union is read once per layer."""
    cfg, W = load_model(built.gguf["Q4_0"], cache_bytes=0)
    prompts = _prompts(cfg)
    old = [M.forward(cfg, WholeStacks(W), ids) for ids in prompts]
    caches = [M.KVCache(cfg) for _ in prompts]
    new = forward_chains(cfg, W, [Chain(calls=[ids], cache=c) for ids, c in zip(prompts, caches)])
    for ids, o, n in zip(prompts, old, new):
        assert np.array_equal(o, n[0]), len(ids)
    # one greedy step of every prompt, as the parity job's passes 2 .. N run them
    steps = [[int(np.argmax(o[-1]))] for o in old]
    old_caches = [M.KVCache(cfg) for _ in prompts]
    for ids, c in zip(prompts, old_caches):
        M.forward(cfg, WholeStacks(W), ids, c)
    want = [M.forward(cfg, WholeStacks(W), s, c) for s, c in zip(steps, old_caches)]
    got = forward_chains(cfg, W, [Chain(calls=[s], cache=c) for s, c in zip(steps, caches)])
    for w, g in zip(want, got):
        assert np.array_equal(w, g[0])


class _Counted(np.ndarray):
    """An expert's matrix that records, in ``log``, its ``tag`` and the number of input rows (1 for a vector) of
    every matrix product it takes part in."""

    def __array_finalize__(self, obj):
        self.tag, self.log = getattr(obj, "tag", None), getattr(obj, "log", None)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if ufunc is np.matmul:
            rows = 1 if inputs[0].ndim == 1 or isinstance(inputs[0], _Counted) else inputs[0].shape[0]
            self.log.extend((a.tag, rows) for a in inputs if isinstance(a, _Counted))
        return getattr(ufunc, method)(*(np.asarray(a) for a in inputs), **kwargs)


class CountedStacks(WholeStacks):
    """The weights with every expert of the two stacks a :class:`_Counted` matrix tagged (layer, stack, expert)."""

    def __init__(self, W, cfg):
        super().__init__(W)
        self.log, self.stacks = [], {}
        for layer in cfg.layers:
            for stack in STACKS if layer.has_moe else ():
                name = f"blk.{layer.index}.{stack}"
                experts = {}
                for e, arr in enumerate(np.asarray(W[name])):
                    experts[e] = arr.view(_Counted)
                    experts[e].tag, experts[e].log = (layer.index, stack, e), self.log
                self.stacks[name] = experts

    def __getitem__(self, name):
        return self.stacks[name] if name in self.stacks else self.W[name]


def test_layer_outer_pass_multiplies_each_expert_once(built, monkeypatch):
    """In a layer-outer pass (several prompts, each prefilled then continued by one token) the rows of every call
    that routed several tokens to an expert go through one matrix product per layer and stack, whatever the number
    of calls and tokens (the old code made one matrix-vector product per token and expert). A call that routed one
    token to it makes a one-row product, as the dense products of one-token calls do
    (:func:`reference.batch.linear_rows`)."""
    cfg, W = load_model(built.gguf["F32"], cache_bytes=0)
    prompts = [p for p in _prompts(cfg) if len(p) > 1]

    def chains():
        return [Chain(calls=[ids[:-1], ids[-1:]]) for ids in prompts]

    want = []
    for ids in prompts:  # the same calls one forward at a time
        cache = M.KVCache(cfg)
        want.append([M.forward(cfg, W, ids[:-1], cache), M.forward(cfg, W, ids[-1:], cache)])
    forward_chains(cfg, W, chains())  # the first pass makes the BLAS checks (reference.model.tiles_exact)
    counted = CountedStacks(W, cfg)
    routes = _record_routes(monkeypatch)
    got = forward_chains(cfg, counted, chains())
    for w, g in zip(want, got):
        assert all(np.array_equal(a, b) for a, b in zip(w, g))  # the forward's bits, call by call
    moe_layers = [layer.index for layer in cfg.layers if layer.has_moe for _ in range(2 * len(prompts))]
    chosen = {(il, stack, int(e)) for il, idx in zip(moe_layers, routes) for stack in STACKS for e in np.unique(idx)}
    several = {(il, stack, int(e)) for il, idx in zip(moe_layers, routes) for stack in STACKS
               for e, n in zip(*np.unique(idx, return_counts=True)) if n > 1}
    stacked, vectors = {}, {}
    for tag, rows in counted.log:
        assert tag in chosen
        count = stacked if rows > 1 else vectors
        count[tag] = count.get(tag, 0) + 1
    assert several, "the prompts route several tokens of a call to one expert"
    # stacking is taken only where this machine's BLAS gives a row the same bits in any tile of the product
    # (M.tiles_exact, the rule expert_products follows); OpenBLAS's AVX-512 kernels (SkylakeX) measured not to at
    # these shapes, where each call's rows rightly take their own product (the bits above still the forward's)

    def total(key):  # the rows stacked for an expert in a layer: every call's that routed several to it, padded
        il, _, e = key
        n = sum(k for k in (int(np.sum(idx == e)) for l, idx in zip(moe_layers, routes) if l == il) if k > 1)
        return -(-n // M.EXPERT_TILE) * M.EXPERT_TILE

    exact = {k for k in several if M.tiles_exact(np.asarray(W[f"blk.{k[0]}.{k[1]}"])[k[2]], total(k))}
    if not exact:
        pytest.skip(f"this BLAS gives tile-exact rows at none of the {len(several)} expert products "
                    "(reference.model.tiles_exact): each call's rows take their own product there, by design")
    once = {k: v for k, v in stacked.items() if k in exact}
    assert once == dict.fromkeys(exact, 1), (len(exact), len(several),
                                             sorted(vectors.items(), key=lambda kv: -kv[1])[:5])
